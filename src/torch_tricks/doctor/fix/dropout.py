"""TT102 ``F.dropout`` (and its variants) without ``training=``: add
``training=<first parameter>.training`` when the call is in a method (not a static or class
method) of the class, or in a function nested in one, and that name is not rebound on the way.
"""

from __future__ import annotations

import ast
import copy

from torch_tricks.doctor import Finding
from torch_tricks.doctor.analysis import dotted
from torch_tricks.doctor.fix.base import _Fix, _NotFixable
from torch_tricks.doctor.fix.doc import _call_at, _Doc
from torch_tricks.doctor.fix.edits import _insertion, _kw, _starred, _value
from torch_tricks.doctor.fix.scopes import _SCOPES, _binds


def _fix_dropout(doc: _Doc, f: Finding) -> _Fix:
    call = _call_at(doc, f)
    if _kw(call, "training") or _starred(call) or len(call.args) > 2:
        raise _NotFixable("training may already be passed")
    method, inner = _enclosing_method(doc, call)
    if method is None:
        raise _NotFixable("not inside a method, so there is no self.training to pass")
    me = _instance_parameter(method)
    if _rebound(method, inner, me):
        raise _NotFixable(f"`{me}` is rebound before the call")
    text = f"training={me}.training"

    def mutate(m: dict) -> None:
        m[id(call)].keywords.append(ast.keyword(arg="training", value=_value(f"{me}.training")))
    return _Fix(("TT102",), f.line, f"{dotted(call.func)}(...): added {text}", [_insertion(doc, call, text)], mutate)


def _enclosing_method(doc: _Doc, node: ast.AST) -> tuple[ast.AST | None, list[ast.AST]]:
    """The method whose code holds ``node`` (None if not in one), and the scopes between them
    (functions nested in the method, lambdas, comprehensions)."""
    inner = []
    for anc in doc.ancestors(node):
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(doc.parent_of(anc), ast.ClassDef):
            return anc, inner
        if isinstance(anc, (ast.ClassDef, ast.Module)):
            break
        if isinstance(anc, _SCOPES):
            inner.append(anc)
    return None, inner


def _instance_parameter(method: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The name of the method's instance parameter (``self``); not fixable when it has none."""
    if {"staticmethod", "classmethod"} & set(_decorator_names(method)):
        raise _NotFixable("in a static or class method, which has no instance")
    params = method.args.posonlyargs + method.args.args
    if not params:
        raise _NotFixable("the method has no instance parameter")
    return params[0].arg


def _decorator_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The last part of each decorator's name: ``functools.wraps(f)`` -> ``wraps``."""
    return [(dotted(d.func if isinstance(d, ast.Call) else d) or "").rsplit(".", 1)[-1] for d in func.decorator_list]


def _rebound(method: ast.AST, inner: list[ast.AST], me: str) -> bool:
    """The instance parameter ``me`` is bound again in ``method``'s body or in one of the ``inner`` scopes."""
    return _binds_in_body(method, me) or any(_binds(s, me) for s in inner)


def _binds_in_body(func: ast.AST, name: str) -> bool:
    """``name`` is bound in ``func``'s body (its parameters aside)."""
    shell = copy.copy(func)
    shell.args = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
                               defaults=[])
    return _binds(shell, name)
