"""Plain :mod:`ast` helpers: positions, dotted names, arguments, literals, local walks.

Each answers a question about a node alone, without the file around it (that is
:class:`~torch_tricks.doctor.analysis.file.FileAnalysis`'s job), so the analysis and the rules
share one reading of ``x.backward()``, ``kwarg(call, "device", 0)`` or ``a.b.c``. It imports
nothing of the package.
"""

from __future__ import annotations

import ast
from typing import Iterator


FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
SCOPES = (ast.Module, ast.ClassDef) + FUNCS + COMPS
LOOPS = (ast.For, ast.AsyncFor, ast.While)
NOWHERE = (10**9, 0)


def pos(node: ast.AST) -> tuple[int, int]:
    return (node.lineno, node.col_offset)


def end(node: ast.AST) -> tuple[int, int]:
    return (node.end_lineno, node.end_col_offset)


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def kwarg(call: ast.Call, name: str, index: int | None = None) -> ast.AST | None:
    """The argument ``name`` of ``call`` (by keyword, or at positional ``index``)."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return _positional(call, index) if index is not None else None


def has_star_args(call: ast.Call) -> bool:
    return any(kw.arg is None for kw in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)


def number(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    return None


def called_method(node: ast.AST) -> str | None:
    """``name`` for a method call ``x.name(...)``; None for any other node."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def is_name(node: ast.AST | None, name: str) -> bool:
    """``node`` is the bare name ``name``."""
    return isinstance(node, ast.Name) and node.id == name


def is_false(node: ast.AST | None) -> bool:
    """``node`` is the literal ``False``."""
    return isinstance(node, ast.Constant) and node.value is False


def is_backward(node: ast.AST) -> bool:
    """``x.backward(...)``: a call of a method named backward (a loss's, a tensor's)."""
    return called_method(node) == "backward"


def walk_local(root: ast.AST, into_loops: bool = True) -> Iterator[ast.AST]:
    """Nodes under ``root`` without entering nested functions and classes (their code runs
    elsewhere), nor nested loops if ``into_loops`` is False."""
    stack = list(ast.iter_child_nodes(root))[::-1]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, FUNCS + (ast.ClassDef,)) or (not into_loops and isinstance(node, LOOPS)):
            continue
        stack.extend(list(ast.iter_child_nodes(node))[::-1])


def _positional(call: ast.Call, index: int) -> ast.AST | None:
    """The argument at position ``index``, when no ``*args`` comes before it."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[:index + 1]):
        return call.args[index]
    return None


def _put_last(node: ast.AST, name: str) -> ast.AST | None:
    """The element ``node`` puts last into the list ``name``: ``name.append(x)``, ``name += [.., x]``,
    ``name = [.., x]``; None for any other node."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
            and is_name(node.func.value, name) and len(node.args) == 1):
        return node.args[0]
    target = node.target if isinstance(node, ast.AugAssign) else (
        node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
    value = node.value if isinstance(node, (ast.AugAssign, ast.Assign)) else None
    if is_name(target, name) and isinstance(value, ast.List) and value.elts:
        return value.elts[-1]
    return None


def _constant_index(node: ast.AST) -> int | None:
    """``i`` of ``x[i]`` for a non-negative integer constant ``i``."""
    v = node.value if isinstance(node, ast.Constant) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _called_function(node: ast.AST) -> str | None:
    """``name`` for a call of a bare name ``name(...)``; None for any other node."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _is_called(func: ast.AST, parent: ast.AST | None) -> bool:
    """``parent`` (the parent node of ``func``) is the call of ``func``."""
    return isinstance(parent, ast.Call) and parent.func is func
