"""TT108 ``F.binary_cross_entropy(torch.sigmoid(z), y)`` (or ``z.sigmoid()``) in one expression:
``F.binary_cross_entropy_with_logits(z, y)``. Not when the sigmoid output is a variable, or the
loss is a ``BCELoss`` object.
"""

from __future__ import annotations

import ast

from torch_tricks.doctor import Finding
from torch_tricks.doctor.analysis import called_method
from torch_tricks.doctor.fix.base import _Fix, _NotFixable
from torch_tricks.doctor.fix.doc import _Doc
from torch_tricks.doctor.fix.edits import _kw, _multiline, _starred


_SIGMOIDS = frozenset({"torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit"})


def _fix_sigmoid_bce(doc: _Doc, f: Finding) -> _Fix:
    call = doc.call_at(f)
    if call is None or not _is_functional_bce(doc, call):
        raise _NotFixable("not a call of F.binary_cross_entropy (a BCELoss object needs its constructor changed)")
    if _starred(call):
        raise _NotFixable("*args / **kwargs")
    slot = _input_argument(call)
    inner = _sigmoid_input(doc, slot)
    if inner is None or isinstance(inner, ast.GeneratorExp):
        raise _NotFixable("the sigmoid is not applied in the loss call itself (its output is a variable)")
    end = doc.end(call.func)
    new = "binary_cross_entropy_with_logits"
    edits = [(end - len(call.func.attr), end, new), (doc.start(slot), doc.end(slot), doc.text(inner))]
    if _multiline(doc.text(inner)):
        raise _NotFixable("the logits expression spans several lines")

    def mutate(m: dict) -> None:
        c = m[id(call)]
        c.func.attr = new
        if call.args and call.args[0] is slot:
            c.args[0] = m[id(inner)]
        else:
            next(k for k in c.keywords if k.arg == "input").value = m[id(inner)]
    prefix = doc.text(call.func.value)
    return _Fix(("TT108",), f.line, f"{prefix}.binary_cross_entropy(sigmoid(x), ...) -> {prefix}.{new}(x, ...)",
                edits, mutate)


def _input_argument(call: ast.Call) -> ast.AST | None:
    """The ``input`` argument of a loss call: the first positional one, or ``input=``."""
    return call.args[0] if call.args else getattr(_kw(call, "input"), "value", None)


def _is_functional_bce(doc: _Doc, call: ast.Call) -> bool:
    """``call`` is ``F.binary_cross_entropy(...)``, ``F`` an import of ``torch.nn.functional``."""
    return called_method(call) == "binary_cross_entropy" and doc.resolve(call.func.value) == "torch.nn.functional"


def _sigmoid_input(doc: _Doc, slot: ast.AST | None) -> ast.AST | None:
    """``x`` when ``slot`` is ``torch.sigmoid(x)`` (or an alias of it) or ``x.sigmoid()``, else None."""
    if not isinstance(slot, ast.Call) or slot.keywords or _starred(slot):
        return None
    if len(slot.args) == 1 and doc.resolve(slot.func) in _SIGMOIDS:
        return slot.args[0]
    if _is_sigmoid_method(doc, slot):
        return slot.func.value
    return None


def _is_sigmoid_method(doc: _Doc, call: ast.Call) -> bool:
    """``call`` is ``x.sigmoid()``, ``x`` not an import (``torch.sigmoid()`` needs an argument)."""
    return not call.args and called_method(call) == "sigmoid" and doc.resolve(call.func.value) is None
