"""Whether a node runs with autograd off: :class:`GradMode`, a mixin of :class:`FileAnalysis`.

``with torch.no_grad()`` / ``inference_mode`` / ``set_grad_enabled(False)`` around it in its
function, a decorator of its function (torch's, or a project's wrapper named so), or an earlier
``torch.set_grad_enabled(False)`` statement. The rules about evaluation, backward and
accumulated losses ask :meth:`GradMode.no_grad`.

A mixin: it reads FileAnalysis's ``tree`` and calls its :meth:`ancestors` and :meth:`qualname`.
"""

from __future__ import annotations

import ast

from torch_tricks.doctor.analysis.syntax import dotted, kwarg, pos, walk_local
from torch_tricks.doctor.analysis.vocab import NO_GRAD


class GradMode:
    """Autograd's mode where a node runs."""

    def no_grad(self, node: ast.AST) -> bool:
        """``node`` runs with autograd off: inside ``with torch.no_grad()`` (or
        inference_mode / set_grad_enabled(False)) in its function, under a decorated
        function, or after a ``torch.set_grad_enabled(False)`` statement."""
        inside = True
        child = node
        for anc in self.ancestors(node):
            mode = self._with_grad_mode(anc, child) if inside else None
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mode = self._function_grad_mode(anc, node, inside)
                inside = False
            if mode is not None:
                return mode == "off"
            child = anc
        return inside and self._grad_disabled_before(self.tree, node)

    def _grad_mode(self, expr: ast.AST) -> str | None:
        """'off' if ``with expr:`` / ``@expr`` disables autograd, 'on' if it enables it."""
        call = expr if isinstance(expr, ast.Call) else None
        func = call.func if call is not None else expr
        q = self.qualname(func)
        if q is not None and q.startswith("torch."):
            return _torch_grad_mode(q, call)
        return _wrapper_grad_mode(func)

    def _first_grad_mode(self, exprs: list[ast.AST]) -> str | None:
        """The grad mode set by the first of ``exprs`` (``with`` items, decorators) that sets one."""
        for expr in exprs:
            mode = self._grad_mode(expr)
            if mode is not None:
                return mode
        return None

    def _function_grad_mode(self, func: ast.AST, node: ast.AST, inside: bool) -> str | None:
        """The grad mode ``func`` sets for ``node`` in it: by a decorator, or, when ``node`` runs
        in ``func``'s own frame (``inside``), 'off' after a ``torch.set_grad_enabled(False)``."""
        mode = self._first_grad_mode(func.decorator_list)
        if mode is None and inside and self._grad_disabled_before(func, node):
            return "off"
        return mode

    def _with_grad_mode(self, anc: ast.AST, child: ast.AST) -> str | None:
        """The grad mode ``anc`` sets for ``child`` when it is a ``with`` whose body holds it."""
        if isinstance(anc, (ast.With, ast.AsyncWith)) and child in anc.body:
            return self._first_grad_mode([item.context_expr for item in anc.items])
        return None

    def _grad_disabled_before(self, scope: ast.AST, node: ast.AST) -> bool:
        state = None
        for stmt in walk_local(scope):
            if self._is_set_grad_statement(stmt) and pos(stmt) < pos(node):
                state = self._grad_mode(stmt.value)
        return state == "off"

    def _is_set_grad_statement(self, stmt: ast.AST) -> bool:
        """A statement ``torch.set_grad_enabled(...)`` (not a ``with``): the mode holds from there on."""
        return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and self.qualname(stmt.value.func) == "torch.set_grad_enabled")


_GRAD_MODE = {True: "on", False: "off"}


def _torch_grad_mode(q: str, call: ast.Call | None) -> str | None:
    """What ``torch.no_grad`` / ``inference_mode`` / ``enable_grad`` / ``set_grad_enabled(flag)`` (``q``,
    called as ``call`` if it is a call) does to autograd: 'off', 'on', or None when not shown."""
    if q in NO_GRAD:
        flag = _mode_flag(call) if q == "torch.inference_mode" else None
        return "on" if flag is False else "off"
    if q == "torch.enable_grad":
        return "on"
    if q == "torch.set_grad_enabled":
        return _GRAD_MODE.get(_mode_flag(call))
    return None


def _mode_flag(call: ast.Call | None) -> bool | None:
    """The literal ``mode`` a call such as ``inference_mode(False)`` passes; None when not a literal bool."""
    return _bool_value(kwarg(call, "mode", 0)) if call is not None else None


def _bool_value(node: ast.AST | None) -> bool | None:
    """The value of a ``True``/``False`` literal; None for anything else."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, bool) else None


def _wrapper_grad_mode(func: ast.AST) -> str | None:
    """A project's own wrapper (YOLOv5's @smart_inference_mode(), a no_grad_if_eval helper) says
    what it does in its name; the rules would otherwise see a training forward."""
    spelled = dotted(func)
    last = spelled.rsplit(".", 1)[-1].lower() if spelled else ""
    return "off" if "inference_mode" in last or "no_grad" in last else None
