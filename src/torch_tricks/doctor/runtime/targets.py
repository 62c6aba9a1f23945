"""The target of the check's loss when the caller gives none, made from the output: class indices for
class losses (and 2-D logits of the caller's own loss), next-token ids for token logits of integer
ids, 0/1 labels for binary losses, random values of the prediction's shape otherwise; and torch's
"target size different to the input size" warning read back into shapes (TT214), since a target
that broadcasts against the prediction trains on every pair of them."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.doctor.runtime.util import _tensors
from torch_tricks.errors import UserError
from torch_tricks.inspect.inputs import input_tensors
from torch_tricks.outputs import primary_output


def _make_target(fn: Any, out: Any) -> tuple[torch.Tensor, str]:
    """A plausible target for ``fn`` from the output's shape, and how it was made."""
    t = _prediction_of(out)
    kind = _loss_kind(fn) or _shape_kind(t)
    gen = torch.Generator().manual_seed(0)
    if kind == "class" and t.dim() >= 1:
        target, how = _class_indices(t, gen)
    elif kind == "binary":
        target = torch.randint(0, 2, tuple(t.shape), generator=gen).to(t.dtype)
        how = f"generated 0/1 labels {tuple(t.shape)}"
    else:
        target = torch.randn(tuple(t.shape), generator=gen).to(t.dtype)
        how = f"generated random values {tuple(t.shape)}"
    return target.to(t.device), how


_CLASS_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss, nn.MultiMarginLoss, F.cross_entropy, F.nll_loss)


_BINARY_LOSSES = (nn.BCELoss, nn.BCEWithLogitsLoss, nn.MultiLabelSoftMarginLoss,
                  F.binary_cross_entropy, F.binary_cross_entropy_with_logits)


def _loss_kind(fn: Any) -> str | None:
    """'class' or 'binary' for those torch losses, 'regression' for the other torch losses
    (MSE, L1, Huber...: a target shaped like the output), None for the caller's own."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    for kind, known in (("class", _CLASS_LOSSES), ("binary", _BINARY_LOSSES)):
        if any(_is_or_instance(fn, k) for k in known):
            return kind
    return "regression" if _is_torch_loss(fn) else None


def _is_torch_loss(fn: Any) -> bool:
    return isinstance(fn, nn.modules.loss._Loss) or getattr(fn, "__module__", "") == "torch.nn.functional"


def _is_or_instance(fn: Any, known: Any) -> bool:
    """``fn`` is the function ``known``, or an instance of the class ``known``."""
    return fn is known or (isinstance(known, type) and isinstance(fn, known))


def _shape_kind(t: torch.Tensor) -> str:
    """For the caller's own loss: 2-D outputs of several columns are class logits, the rest regression."""
    return "class" if t.dim() == 2 and t.shape[1] > 1 else "regression"


def _prediction_of(out: Any) -> torch.Tensor:
    """The output tensor, or the first floating-point tensor of a structured output."""
    t = out if isinstance(out, torch.Tensor) else next((x for x in _tensors(out) if x.is_floating_point()), None)
    if t is None:
        raise UserError(f"cannot make a target for loss_fn from the output {type(out).__name__}: pass target=")
    return t


def _class_indices(t: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, str]:
    """Random class indices for the logits ``t`` (classes along dim 1, or dim 0 of a single sample)."""
    classes = t.shape[1] if t.dim() >= 2 else t.shape[0]
    shape = (t.shape[0], *t.shape[2:]) if t.dim() >= 2 else ()
    target = torch.randint(0, classes, shape, generator=gen)
    return target, f"generated class indices {tuple(shape)} in [0, {classes})"


# -- token logits ----------------------------------------------------------------------------

def _token_ids(inputs: tuple[Any, ...] | dict[str, Any], out: Any) -> torch.Tensor | None:
    """The integer ids ``(B, T)`` behind token logits ``(B, T, V)``, else None."""
    pred = primary_output(out)
    ids = _ids_input(inputs)
    if ids is None or ids.is_floating_point() or ids.dim() != 2 or pred.dim() != 3:
        return None
    return ids if tuple(ids.shape) == tuple(pred.shape[:2]) else None


def _next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Each position's next id (``-100``, ignored, at the last position)."""
    target = torch.full_like(ids, -100)
    target[:, :-1] = ids[:, 1:]
    return target


def _ids_input(inputs: tuple[Any, ...] | dict[str, Any]) -> torch.Tensor | None:
    """The ``input_ids`` keyword input, else the first input tensor."""
    tensors = input_tensors(inputs)
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    return ids if isinstance(ids, torch.Tensor) else (tensors[0] if tensors else None)


# -- a target that broadcasts (TT214) --------------------------------------------------------

_SIZES = re.compile(r"target size \(torch\.Size\(\[([\d, ]*)\]\)\) that is different to the input size "
                    r"\(torch\.Size\(\[([\d, ]*)\]\)\)")


def _broadcast_shapes(message: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None] | None:
    """(prediction, target, broadcast shape or None) from torch's "Using a target size ... that is
    different to the input size ..." warning of the elementwise losses; None for any other message."""
    m = _SIZES.search(message)
    if m is None:
        return None
    target, prediction = (tuple(int(d) for d in g.split(",") if d.strip()) for g in m.groups())
    try:
        broadcast = tuple(torch.broadcast_shapes(prediction, target))
    except RuntimeError:
        broadcast = None  # not broadcastable: the loss raises, its error says so
    return prediction, target, broadcast


def _widens_prediction(shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]) -> bool:
    """The target of :func:`_broadcast_shapes` broadcasts the prediction to a larger shape."""
    return shapes[2] not in (None, shapes[0])
