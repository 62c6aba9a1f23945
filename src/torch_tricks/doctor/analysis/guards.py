"""Conditions around a node: compatibility guards, exclusive branches, rate limits.

Code under a ``hasattr``/version test or a ``try`` that catches ``AttributeError``/``ImportError``
is compatibility code for old torch versions (:func:`version_guarded`: the deprecation rules
skip it); two nodes in different branches of one ``if``/``try`` never run in the same pass
(:func:`exclusive_branches`: evidence for the step rules, TT126-TT132); a test on ``step % k`` or
a memory flag runs its body now and then (:func:`rate_limited`).
"""

from __future__ import annotations

import ast

from torch_tricks.doctor.analysis.file import FileAnalysis
from torch_tricks.doctor.analysis.syntax import _called_function, dotted


COMPAT_ERRORS = frozenset({"AttributeError", "ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def version_guarded(f: FileAnalysis, node: ast.AST) -> bool:
    """Compatibility code for old torch versions: under a ``hasattr``/``getattr``/version
    test (either branch: the other one holds the new spelling), or in a ``try`` whose
    handler catches the AttributeError/ImportError that the new versions raise."""
    child = node
    for anc in f.ancestors(node):
        if _guards_compat(anc, child):
            return True
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            break
        child = anc
    return False


def catches_compat(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    if caught is None:
        return True
    return any(dotted(e) in COMPAT_ERRORS for e in (caught.elts if isinstance(caught, ast.Tuple) else [caught]))


def exclusive_branches(f: FileAnalysis, a: ast.AST, b: ast.AST) -> bool:
    """``a`` and ``b`` never run in the same pass: they lie in different branches of one ``if``
    (or conditional expression), or in a ``try`` body and one of its handlers (or two handlers)."""
    la, lb = _branch_labels(f, a), _branch_labels(f, b)
    return any(anc in lb and _exclusive(label, lb[anc]) for anc, label in la.items())


def rate_limited(test: ast.AST) -> bool:
    return any(_is_modulo(n) or _names_memory(n) for n in ast.walk(test))


def _guards_compat(anc: ast.AST, child: ast.AST) -> bool:
    """``anc`` makes its part ``child`` compatibility code: a branch of a compat test, the body of a
    ``try`` that catches compat errors, or such a handler."""
    if isinstance(anc, (ast.If, ast.IfExp)):
        return child is not anc.test and _compat_test(anc.test)
    if isinstance(anc, ast.Try):
        return child in anc.body and any(catches_compat(h) for h in anc.handlers)
    return isinstance(anc, ast.ExceptHandler) and catches_compat(anc)  # the fallback after the new spelling failed


def _compat_test(test: ast.AST) -> bool:
    """``test`` asks ``hasattr``/``getattr`` or reads a name about a version."""
    for n in ast.walk(test):
        if _called_function(n) in ("hasattr", "getattr"):
            return True
        if "version" in _identifier(n).lower():
            return True
    return False


def _identifier(node: ast.AST) -> str:
    """The name a Name reads or an Attribute picks; "" for other nodes."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _branch_labels(f: FileAnalysis, node: ast.AST) -> dict:
    """Each ``if``/``try`` around ``node`` -> the branch of it that holds ``node``."""
    out, child = {}, node
    for anc in f.ancestors(node):
        if isinstance(anc, (ast.If, ast.IfExp, ast.Try, getattr(ast, "TryStar", ast.Try))):
            out[anc] = _branch_label(anc, child)
        child = anc
    return out


def _branch_label(anc: ast.AST, child: ast.AST) -> object:
    """Which branch of the ``if``/``try`` ``anc`` holds ``child``: "body", "orelse", a handler;
    "test" or "final" for parts that run whichever branch is taken."""
    if isinstance(anc, (ast.If, ast.IfExp)):
        return _if_branch(anc, child)
    if child in anc.finalbody:
        return "final"
    if child in anc.handlers:
        return anc.handlers.index(child)
    return "body"  # the try body and its else run together


def _if_branch(anc: ast.If | ast.IfExp, child: ast.AST) -> str:
    if child is anc.test:
        return "test"
    if child is anc.body or (isinstance(anc.body, list) and child in anc.body):
        return "body"
    return "orelse"


def _exclusive(a: object, b: object) -> bool:
    """Two branch labels of one ``if``/``try`` that never run in the same pass."""
    return a not in ("test", "final") and b not in ("test", "final") and a != b


def _is_modulo(node: ast.AST) -> bool:
    """``a % b``: every k-th step."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)


def _names_memory(node: ast.AST) -> bool:
    """A name or attribute chain whose last part is about memory (``low_memory``, ``cfg.memory``)."""
    return isinstance(node, (ast.Name, ast.Attribute)) and "memory" in (dotted(node) or "").rsplit(".", 1)[-1]
