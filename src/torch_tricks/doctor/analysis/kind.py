"""What an expression evaluates to: :class:`Kind`, and the rules that need no file to apply.

A :class:`Kind` is the analysis's answer to "what is this value" (a tensor and the activation it
comes from, a batch, a module, a loss function, a loader, an optimizer ...). This module holds the
type, its common values, and the pure derivations: the kind a torch constructor or function
builds from its qualified name (:func:`_nn_object_kind` ...), the kind of an attribute, a method's
result, an element or an item of a value of known kind. Those that need the file (bindings, the
classes it defines) are :class:`~torch_tricks.doctor.analysis.kinds.KindInference`'s.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from torch_tricks.doctor.analysis.syntax import kwarg
from torch_tricks.doctor.analysis.vocab import (ACT_FUNCS, ACT_METHODS, ACTS, DATALOADER, F_LOSSES, NON_TENSOR_METHODS,
                                                TENSOR_FUNCS, VIEW_METHODS, is_torch_nn_class)


@dataclass(frozen=True)
class Kind:
    """What an expression evaluates to, as far as the file shows."""

    # tensor | batch | module | lossfn | loader | device | optimizer | scheduler | params | named_params | self | class
    # | func
    cat: str
    # tensor: log_softmax, softmax, sigmoid, loss, param, batch, expanded; module/lossfn: qualname or "local"
    detail: str | None = None
    ref: object = None  # ClassDef for local modules and self; the constructor Call; a FunctionDef

    def key(self):
        return (self.cat, self.detail, self.ref if isinstance(self.ref, (ast.ClassDef, ast.FunctionDef)) else None)


TENSOR = Kind("tensor")
LOSS = Kind("tensor", "loss")
PARAM = Kind("tensor", "param")
BATCH = Kind("tensor", "batch")

# methods whose result is a tensor of a known detail, whatever the receiver
_TENSOR_RESULTS = {**{m: Kind("tensor", act) for m, act in ACT_METHODS.items()},
                   "expand": Kind("tensor", "expanded"), "expand_as": Kind("tensor", "expanded")}
_PARAMETER_ATTRS = ("weight", "bias", "grad")
_PARAMETER_METHODS = {"parameters": "params", "buffers": "params", "named_parameters": "named_params",
                      "named_buffers": "named_params"}
# category -> (path to the element, its kind): a parameter of .parameters(), the value of a
# .named_parameters() pair, a row of a tensor
_ELEMENTS = {"params": ((), PARAM), "named_params": ((1,), PARAM), "tensor": ((), TENSOR)}


# ---- reading a kind


def _category(k: Kind | None) -> str | None:
    """``k.cat``, or None for an unknown kind."""
    return k.cat if k is not None else None


def _is_local_instance(k: Kind | None) -> bool:
    """``k`` is an instance of a class of this file: ``self``, or a local module."""
    cat = _category(k)
    return cat == "self" or (cat == "module" and k.detail == "local")


def _activation(k: Kind | None) -> str | None:
    """The activation a tensor of kind ``k`` comes from (its detail); None for anything but a tensor."""
    return k.detail if _category(k) == "tensor" else None


def _same_kind(a: Kind | None, b: Kind | None) -> Kind | None:
    """``a`` when ``b`` is the same kind (both branches of a conditional expression agree)."""
    return a if a is not None and b is not None and a.key() == b.key() else None


def _agreed_kind(kinds: list[Kind]) -> Kind | None:
    """The kind all of ``kinds`` share (the same object, or at least the same category and detail)."""
    if all(k.key() == kinds[0].key() for k in kinds):
        return kinds[0]
    if all((k.cat, k.detail) == (kinds[0].cat, kinds[0].detail) for k in kinds):
        return Kind(kinds[0].cat, kinds[0].detail)
    return None


def _sole_activation(acts: set[str | None]) -> str | None:
    """The activation when it is the one every ``return`` of a forward gives."""
    act = next(iter(acts)) if len(acts) == 1 else None
    return act if act in ACTS else None


# ---- the kind of a part of a value of known kind


def _tensor_attribute_kind(rk: Kind | None, attr: str) -> Kind | None:
    """``x.weight``/``.bias``/``.grad`` of a module, a tensor or an unknown ``x`` (of kind ``rk``) is a
    parameter; ``.data``, ``.T``, ``.real`` ... of a tensor a tensor (a parameter's, a parameter)."""
    cat = _category(rk)
    if attr in _PARAMETER_ATTRS:
        return PARAM if cat in (None, "module", "self", "tensor") else None
    if cat == "tensor" and attr in ("data", "T", "mT", "H", "mH", "real", "imag"):
        return PARAM if rk.detail == "param" else TENSOR
    return None


def _tensor_method_kind(rk: Kind, method: str) -> Kind | None:
    """What ``t.method(...)`` gives for a tensor ``t`` of kind ``rk``: a tensor (a view keeps its
    activation), or None for a method returning a number, a shape, a storage."""
    if method in NON_TENSOR_METHODS:
        return None
    if method in VIEW_METHODS:
        return Kind("tensor", rk.detail if rk.detail in ACTS else None)
    return TENSOR


def _item_kind(k: Kind | None) -> Kind | None:
    """The kind of ``x[i]`` for ``x`` of kind ``k``: a batch's item is a tensor of the batch; a
    tensor's keeps its activation (or its being a batch)."""
    cat = _category(k)
    if cat == "batch":
        return BATCH
    if cat == "tensor":
        return Kind("tensor", k.detail if k.detail in ACTS or k.detail == "batch" else None)
    return None


def _element_of(k: Kind, path: tuple) -> Kind | None:
    """The kind of the element at ``path`` of one item of an iterable of kind ``k``."""
    if k.cat == "loader":
        return _batch_element(k, path)
    where, element = _ELEMENTS.get(k.cat, (None, None))
    return element if path == where else None


def _batch_element(loader: Kind, path: tuple) -> Kind:
    """The kind of the element at ``path`` of a batch of the DataLoader of kind ``loader``."""
    if path or (isinstance(loader.ref, ast.Call) and kwarg(loader.ref, "collate_fn", 6) is None):
        return BATCH  # an element of a batch, or a default-collated batch: tensors
    return Kind("batch")  # a whole batch from a custom collate: maybe an object with an in-place .to()


# ---- the kind a torch name builds or returns


def _nn_object_kind(q: str, node: ast.Call) -> Kind | None:
    """The kind of an activation's output, a functional's result, a parameter, or a torch.nn layer or
    loss built by ``q(...)``."""
    last = q.rsplit(".", 1)[-1]
    if q in ACT_FUNCS:
        return Kind("tensor", ACT_FUNCS[q])
    if q.startswith("torch.nn.functional."):
        return LOSS if last in F_LOSSES else TENSOR
    if q in ("torch.nn.Parameter", "torch.nn.UninitializedParameter"):
        return PARAM
    if is_torch_nn_class(q):
        return Kind("lossfn" if last.endswith("Loss") else "module", q, node)
    return None


def _library_object_kind(q: str, node: ast.Call) -> Kind | None:
    """The kind of a data loader, device, optimizer, scheduler or torchvision model built by ``q(...)``."""
    if q == DATALOADER:
        return Kind("loader", q, node)
    if q == "torch.device":
        return Kind("device", None, node)
    if q.startswith("torch.optim."):
        return _optim_object_kind(q, node)
    if q.startswith("torchvision.models.") and q.rsplit(".", 1)[-1][:1].islower():
        return Kind("module", q, node)
    return None


def _optim_object_kind(q: str, node: ast.Call) -> Kind | None:
    """An optimizer (a class of ``torch.optim``) or a scheduler (of ``torch.optim.lr_scheduler``)."""
    if not q.rsplit(".", 1)[-1][:1].isupper():
        return None
    if q.count(".") == 2:
        return Kind("optimizer", q, node)
    return Kind("scheduler", q, node) if q.startswith("torch.optim.lr_scheduler.") else None


def _tensor_function_kind(q: str) -> Kind | None:
    """The kind of what a torch function ``q`` returns when it is a tensor (an expanded one for
    ``broadcast_to``)."""
    if q == "torch.broadcast_to":
        return Kind("tensor", "expanded")
    if _is_torch_tensor_function(q) or q.startswith(("torch.linalg.", "torch.fft.", "torch.special.")):
        return TENSOR
    return None


def _is_module_base(q: str | None) -> bool:
    """A base class ``q`` that makes a subclass an nn.Module: an nn class, a LightningModule."""
    return q is not None and ((is_torch_nn_class(q) and q != "torch.nn.Parameter")
                              or q.rsplit(".", 1)[-1] == "LightningModule")


def _is_nn_module_class(q: str | None) -> bool:
    """``q`` is a torch.nn layer class: not a loss, nor ``nn.Parameter``."""
    return q is not None and is_torch_nn_class(q) and not q.endswith("Loss") and q != "torch.nn.Parameter"


def _takes_tensors(q: str | None) -> bool:
    """``q`` is a torch function on tensors: ``torch.<f>`` of :data:`TENSOR_FUNCS`, or a functional."""
    return q is not None and (_is_torch_tensor_function(q) or q.startswith("torch.nn.functional."))


def _is_torch_tensor_function(q: str) -> bool:
    """``q`` is ``torch.<f>`` for a top-level function that returns a tensor (``torch.zeros``, ``torch.cat``)."""
    return q.startswith("torch.") and q.count(".") == 1 and q.rsplit(".", 1)[-1] in TENSOR_FUNCS
