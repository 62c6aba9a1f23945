"""Rules about reproducibility: the removed ``torch.set_deterministic`` and its relatives,
``cudnn.benchmark`` switched on next to a request for determinism.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import FileAnalysis, exclusive_branches, kwarg, pos, version_guarded
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
        yield from _removed_attributes(f)
        yield from _removed_imports(f)


_REMOVED = {"torch.set_deterministic": "torch.use_deterministic_algorithms",
            "torch.is_deterministic": "torch.are_deterministic_algorithms_enabled"}


def _removed_attributes(f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
    """``torch.set_deterministic`` / ``torch.is_deterministic`` read outside a version check."""
    for node in f.nodes[ast.Attribute]:
        q = f.qualname(node)
        if q in _REMOVED and not isinstance(f.parent.get(node), ast.Attribute) and not version_guarded(f, node):
            yield node, f"{q} no longer exists (AttributeError): use {_REMOVED[q]}"


def _removed_imports(f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
    """``from torch import set_deterministic`` (or ``is_deterministic``) outside a version check."""
    for node in f.nodes[ast.ImportFrom]:
        if not _unguarded_torch_import(f, node):
            continue
        for alias in node.names:
            if f"torch.{alias.name}" in _REMOVED:
                new = _REMOVED["torch." + alias.name]
                yield node, f"torch.{alias.name} no longer exists (ImportError): use {new}"


def _unguarded_torch_import(f: FileAnalysis, node: ast.ImportFrom) -> bool:
    return node.module == "torch" and node.level == 0 and not version_guarded(f, node)


_BENCHMARK = "torch.backends.cudnn.benchmark"


def _literal(node: ast.AST | None, value: bool) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _flag_sets(f: FileAnalysis, name: str) -> list[ast.Assign]:
    return [a for a in f.nodes[ast.Assign] if any(f.qualname(t) == name for t in a.targets)]


def _anchors(f: FileAnalysis, node: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(frame, node in that frame) where ``node`` runs: its own frame, and the frames that call its
    function by name (one level up), at the call."""
    frame = f.function_scope(node)
    out = [(frame, node)]
    if isinstance(frame, (ast.FunctionDef, ast.AsyncFunctionDef)) and not isinstance(f.parent.get(frame), ast.ClassDef):
        out += [(f.function_scope(c), c) for c in f.calls_by_name.get(frame.name, [])]
    return out


@static_rule
class CudnnBenchmarkWithDeterminism(StaticRule):
    id = "TT132"
    name = "cudnn-benchmark-with-determinism"
    severity = "warning"
    source = ("T2, T17; seeds/000 其他技巧·重现 设置随机数种子 (torch.backends.cudnn.benchmark = False 与 "
              "deterministic = True 一起); seeds/002 其他技巧·重现; seeds/000 代码层面 (cudnn.benchmark = True)")
    message = ("torch.backends.cudnn.benchmark = True where the code also asks for determinism: benchmarking picks "
               "convolution algorithms by timing, so runs differ; set benchmark = False for reproducible runs")
    explanation = ("With cudnn.benchmark = True, cuDNN times several convolution algorithms on the first batch of "
                   "each shape and keeps the fastest. Which one wins depends on timing noise and the GPU's load, "
                   "so two runs can use different algorithms and get different floating-point results, even with "
                   "cudnn.deterministic = True or torch.use_deterministic_algorithms(True) (those only exclude "
                   "nondeterministic algorithms). Asking for both is a contradiction, usually a seeding helper "
                   "copied next to a speed tip. Fix: for reproducible runs set "
                   "torch.backends.cudnn.benchmark = False (the seeds' seed_torch does); keep benchmark = True only "
                   "where determinism is not wanted, e.g. `benchmark = not args.deterministic`.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        benchmarks = _flag_sets(f, _BENCHMARK)
        switched_on = _set_true(benchmarks)
        if not switched_on:
            return
        wants = _determinism_requests(f)
        for on in switched_on:
            want = _request_in_force(f, on, benchmarks, wants)
            if want is not None:
                yield on, (f"cudnn.benchmark = True while line {want.lineno} asks for determinism: benchmarking "
                           f"picks algorithms by timing, so runs differ; set benchmark = False for reproducible "
                           f"runs")


def _set_true(assigns: list[ast.Assign]) -> list[ast.Assign]:
    return [a for a in assigns if _literal(a.value, True)]


def _determinism_requests(f: FileAnalysis) -> list[ast.AST]:
    """``cudnn.deterministic = True`` and ``torch.use_deterministic_algorithms(True)``."""
    wants: list[ast.AST] = _set_true(_flag_sets(f, "torch.backends.cudnn.deterministic"))
    wants += [c for c in f.nodes[ast.Call] if f.qualname(c.func) == "torch.use_deterministic_algorithms"
              and _literal(kwarg(c, "mode", 0), True)]
    return wants


def _request_in_force(f: FileAnalysis, on: ast.Assign, benchmarks: list[ast.Assign],
                      wants: list[ast.AST]) -> ast.AST | None:
    """The first of ``wants`` that runs in one run with ``on`` (``benchmark = True``) while it holds;
    None when there is none, or a later assignment switches benchmarking off again."""
    if _switched_off_after(f, on, benchmarks):
        return None
    return next((w for w in wants if _in_one_run(f, on, w)), None)


def _switched_off_after(f: FileAnalysis, on: ast.Assign, benchmarks: list[ast.Assign]) -> bool:
    """A later assignment of ``cudnn.benchmark`` in the same function, on the same path, sets it to
    something other than True."""
    frame = f.function_scope(on)
    return any(a is not on and pos(a) > pos(on) and f.function_scope(a) is frame and not _literal(a.value, True)
               and not exclusive_branches(f, a, on) for a in benchmarks)


def _in_one_run(f: FileAnalysis, on: ast.AST, want: ast.AST) -> bool:
    """``on`` and ``want`` can run in one run: they (or the calls of the functions holding them)
    share a frame and do not sit in exclusive branches."""
    return any(fb is fd and not exclusive_branches(f, nb, nd)
               for fb, nb in _anchors(f, on) for fd, nd in _anchors(f, want))
