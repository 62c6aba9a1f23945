"""TT113 ``x.cuda()`` / ``x.to(...)`` ... as a bare one-line statement: ``x = x.cuda()``, when the
receiver is a name or a plain attribute chain (``self.x``). A name must already be local to the
function (else the assignment would make it local, an UnboundLocalError); not in a class body;
not an attribute the file makes an ``nn.Parameter`` (a module refuses a plain tensor there), nor
a tensor's own ``.data`` / ``.grad`` (whose assignment torch checks).
"""

from __future__ import annotations

import ast
import copy

from torch_tricks.doctor import Finding
from torch_tricks.doctor.analysis import dotted
from torch_tricks.doctor.fix.base import _Fix, _NotFixable
from torch_tricks.doctor.fix.doc import _Doc
from torch_tricks.doctor.fix.scopes import _SCOPES, _binds


_MOVES = frozenset("cuda cpu to half float double bfloat16 long int short byte char bool pin_memory type".split())


_TENSOR_ATTRS = frozenset("data grad real imag T mT H mH".split())


def _fix_discarded_move(doc: _Doc, f: Finding) -> _Fix:
    call = _bare_move(doc, f)
    stmt = doc.parent_of(call)
    recv = call.func.value
    if stmt.lineno != stmt.end_lineno:
        raise _NotFixable("the statement spans several lines")
    if dotted(recv) is None:
        raise _NotFixable("the receiver is not a name or a plain attribute chain")
    scope = next((a for a in doc.ancestors(stmt) if isinstance(a, _SCOPES + (ast.Module,))), None)
    if isinstance(scope, ast.ClassDef):
        raise _NotFixable("in a class body")
    _check_assignable(doc, scope, recv)
    target = doc.text(recv)

    def mutate(m: dict) -> None:
        new_stmt, body = m[id(stmt)], []
        parent = m[id(doc.parent_of(stmt))]
        tgt = copy.deepcopy(m[id(recv)])
        tgt.ctx = ast.Store()
        assign = ast.Assign(targets=[tgt], value=m[id(call)], type_comment=None)
        for name, value in ast.iter_fields(parent):
            if isinstance(value, list) and any(v is new_stmt for v in value):
                body = value
        body[[i for i, v in enumerate(body) if v is new_stmt][0]] = assign
    s = doc.start(stmt)
    return _Fix(("TT113",), f.line, f"`{target}.{call.func.attr}(...)` -> `{target} = {target}.{call.func.attr}(...)`",
                [(s, s, f"{target} = ")], mutate)


def _bare_move(doc: _Doc, f: Finding) -> ast.Call:
    """The ``x.cuda()`` / ``x.to(...)`` ... call reported at ``f``, a statement of its own."""
    calls = [c for c in doc.nodes_at(f, ast.Call) if isinstance(doc.parent_of(c), ast.Expr)
             and isinstance(c.func, ast.Attribute) and c.func.attr in _MOVES]
    if len(calls) != 1:
        raise _NotFixable("not a bare `x.cuda()` statement")
    return calls[0]


def _check_assignable(doc: _Doc, scope: ast.AST | None, recv: ast.Name | ast.Attribute) -> None:
    """Not fixable when ``recv = ...`` in ``scope`` would change what the code means or fail."""
    if isinstance(recv, ast.Name):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _binds(scope, recv.id):
            raise _NotFixable(f"`{recv.id}` is not local to the function: assigning it would make it local")
    elif recv.attr in _TENSOR_ATTRS:
        raise _NotFixable(f"assigning `.{recv.attr}` of a tensor is checked by torch (device, shape): "
                          f"rewrite it by hand")
    elif _is_parameter_attr(doc, recv.attr):
        raise _NotFixable(f"`.{recv.attr}` holds an nn.Parameter, which a module does not let a tensor replace")


def _is_parameter_attr(doc: _Doc, attr: str) -> bool:
    """The file makes ``.attr`` an ``nn.Parameter``: assigns it one, or registers one under that name."""
    return any(_assigns_parameter(node, attr) or _registers_parameter(node, attr) for node in ast.walk(doc.tree))


def _assigns_parameter(node: ast.AST, attr: str) -> bool:
    """``node`` is ``x.attr = ...Parameter(...)`` (or an annotated assignment)."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return False
    return any(isinstance(t, ast.Attribute) and t.attr == attr for t in _targets(node)) \
        and _makes_parameter(node.value)


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _makes_parameter(value: ast.AST) -> bool:
    """``value`` calls something named ``...Parameter``."""
    return any(isinstance(c, ast.Call) and _callee(c).endswith("Parameter") for c in ast.walk(value))


def _registers_parameter(node: ast.AST, attr: str) -> bool:
    """``node`` is ``x.register_parameter("attr", ...)``."""
    return isinstance(node, ast.Call) and _callee(node).endswith("register_parameter") and bool(node.args) \
        and isinstance(node.args[0], ast.Constant) and node.args[0].value == attr


def _callee(call: ast.Call) -> str:
    """The dotted name ``call`` calls, "" when it is not one."""
    return dotted(call.func) or ""
