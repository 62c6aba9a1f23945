"""Rules about reproducibility: the removed ``torch.set_deterministic`` and its relatives.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import FileAnalysis, version_guarded
from torch_tricks.doctor.registry import StaticRule, static_rule


@static_rule
class SetDeterministicRemoved(StaticRule):
    id = "TT118"
    name = "set-deterministic-removed"
    severity = "error"
    source = "T17; seeds/002 其他技巧·重现 (强制确定性操作 torch.set_deterministic)"
    message = "torch.set_deterministic / is_deterministic no longer exist: use torch.use_deterministic_algorithms"
    explanation = ("torch.set_deterministic and torch.is_deterministic (PyTorch 1.7) were renamed in 1.8 and "
                   "later removed: calling them raises AttributeError. Fix: torch.use_deterministic_algorithms(True) "
                   "and torch.are_deterministic_algorithms_enabled(); on CUDA also set "
                   "CUBLAS_WORKSPACE_CONFIG=:4096:8.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        removed = {"torch.set_deterministic": "torch.use_deterministic_algorithms",
                   "torch.is_deterministic": "torch.are_deterministic_algorithms_enabled"}
        for node in f.nodes[ast.Attribute]:
            q = f.qualname(node)
            if q in removed and not isinstance(f.parent.get(node), ast.Attribute) and not version_guarded(f, node):
                yield node, f"{q} no longer exists (AttributeError): use {removed[q]}"
        for node in f.nodes[ast.ImportFrom]:
            if node.module == "torch" and node.level == 0 and not version_guarded(f, node):
                for alias in node.names:
                    if f"torch.{alias.name}" in removed:
                        new = removed["torch." + alias.name]
                        yield node, f"torch.{alias.name} no longer exists (ImportError): use {new}"
