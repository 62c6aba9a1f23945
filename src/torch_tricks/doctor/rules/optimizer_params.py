"""The same parameters given to one optimizer twice: a module and one of its own submodules both passed whole, or
two sub-models built around one shared module. The optimizer then holds those tensors twice and each step updates
them twice (torch only warns); the runtime doctor's TT215 finds it from the objects, this from the code.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import FileAnalysis, dotted
from torch_tricks.doctor.registry import StaticRule, static_rule


@static_rule
class ParametersPassedTwice(StaticRule):
    id = "TT137"
    name = "parameters-passed-twice"
    severity = "error"
    source = "X (the optimizer's parameters); T14; seeds/003 Pytorch 使用陷阱 4 (what goes to the Optimizer)"
    message = ("the optimizer gets the same parameters twice (a module and its submodule, or two models sharing "
               "one): each step updates them twice")
    explanation = ("torch.optim.X(list(a.parameters()) + list(b.parameters())) holds every tensor of both. When b is "
                   "a submodule of a (a.head), or a and b were both built around one module (Gen(encoder) and "
                   "Rec(encoder)), the shared tensors are in the list twice: each step applies their update twice "
                   "(twice the learning rate, Adam's moments updated twice); torch only warns 'optimizer contains "
                   "a parameter group with duplicate parameters'. Fix: pass each module once (the parent alone, "
                   "or the shared module's parameters once: list({id(p): p for p in params}.values())).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            if not _is_optimizer(f, call) or not call.args:
                continue
            owners = _parameter_owners(call.args[0])
            pair = _overlap(f, owners)
            if pair is not None:
                yield call, (f"`{pair[0]}` and `{pair[1]}` both go to this optimizer, and {pair[2]}: those "
                             f"parameters are in it twice, so each step updates them twice; pass them once")


def _is_optimizer(f: FileAnalysis, call: ast.Call) -> bool:
    q = f.qualname(call.func) or ""
    last = q.rsplit(".", 1)[-1]
    return q.startswith("torch.optim.") and q.count(".") == 2 and last[:1].isupper()


def _parameter_owners(expr: ast.AST) -> list[ast.AST]:
    """The ``X`` of each ``X.parameters()`` in the optimizer's first argument (a sum of lists, a chain, a list
    display with starred items)."""
    return [n.func.value for n in ast.walk(expr) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "parameters" and not n.args and not n.keywords]


def _overlap(f: FileAnalysis, owners: list[ast.AST]) -> tuple[str, str, str] | None:
    """(a, b, why) for two owners whose parameters overlap: b is an attribute path under a, or both were built by
    calls that take the same module variable."""
    names = [dotted(o) for o in owners]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i == j or a is None or b is None:
                continue
            if b.startswith(a + "."):
                return a, b, f"`{b}` is part of `{a}`"
            shared = _shared_argument(f, owners[i], owners[j]) if i < j else None
            if shared:
                return a, b, f"both were built around `{shared}`"
    return None


def _shared_argument(f: FileAnalysis, a: ast.AST, b: ast.AST) -> str | None:
    """A variable both ``a`` and ``b`` were built with (``a = Gen(enc)``, ``b = Rec(enc)``) that is a module."""
    args_a, args_b = _built_with(f, a), _built_with(f, b)
    for name in sorted(args_a & args_b):
        k = _kind_of_name(f, name)
        if k is not None and (k.cat == "module" or f.is_module_kind(k)):
            return name
    return None


def _built_with(f: FileAnalysis, owner: ast.AST) -> set[str]:
    """The variable names passed to the call ``owner`` was assigned from."""
    value = f.binding_value(owner) if isinstance(owner, ast.Name) else None
    if not isinstance(value, ast.Call):
        return set()
    args = list(value.args) + [kw.value for kw in value.keywords]
    return {a.id for a in args if isinstance(a, ast.Name)}


def _kind_of_name(f: FileAnalysis, name: str):
    """The kind of the module-level or function variable ``name``, from any of its assignments."""
    for node in f.nodes[ast.Assign]:
        if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            k = f.kind(node.value)
            if k is not None:
                return k
    return None
