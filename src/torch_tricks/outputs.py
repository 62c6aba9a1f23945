"""Whatever a forward returns: "the output" and a loss, decided once for every command.

Models return a tensor, a tuple or list, a dict, a dataclass, or a transformers
``ModelOutput`` (an ordered dict that is also a dataclass, with ``loss`` first when labels
were given and ``logits`` next). Every part of torch-tricks that runs a model (the
training step, validation, the tuner) asks this module, so they all agree:

* :func:`primary_output`: the tensor that *is* the prediction: a tensor itself; a
  mapping's or dataclass's ``logits`` when it is a floating-point tensor; else the first
  floating-point tensor found in order (fields, keys, items; nested containers too).
  ``loss`` is never the prediction.
* :func:`get_loss` / ``--loss``: ``auto`` uses the output's own ``.loss`` when it has one
  (a transformers model given ``labels``), else the primary output against the target:
  integer targets -> cross-entropy, over the last dimension (class logits ``(B, C)`` with
  ``(B,)``, or token logits ``(B, T, V)`` with ``(B, T)``, ``-100`` ignored as transformers
  does); floating targets of the output's shape -> mean squared error. ``ce``, ``nll``,
  ``mse``, ``bce-with-logits`` force one; ``none`` takes the mean of the output (for a
  forward that already returns its loss).

Written by hand because torch has no notion of "the prediction" in a structured output:
``torch.utils._pytree`` flattens it (used here to search), but which leaf is the logits is
a convention of transformers that this module states in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from torch_tricks.errors import UserError

__all__ = ["LOSSES", "primary_output", "output_loss", "get_loss", "describe_output"]

from torch_tricks._losses import LOSSES  # noqa: E402  (one definition, torch-free for the CLI)


def primary_output(out: Any) -> torch.Tensor:
    """The prediction tensor of ``out`` (see the module doc); a :class:`UserError` if there is none."""
    found = _find(out)
    if found is None:
        raise UserError(f"the forward returned {describe_output(out)}: no floating-point tensor to take a loss "
                        "of or compare; return the logits (or a ModelOutput / dict with them), or pass loss_fn")
    return found


def output_loss(out: Any) -> torch.Tensor | None:
    """The output's own loss (``out.loss`` / ``out["loss"]``) if it carries a scalar one, else None."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if _is_float_tensor(loss):
        return _scalar(loss, "the model's own loss")
    return None


def get_loss(kind: str | None = "auto") -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn(output, target)`` for ``kind`` in :data:`LOSSES` (None = ``auto``); a UserError otherwise."""
    kind = (kind or "auto").lower().replace("_", "-")
    if kind not in LOSSES:
        raise UserError(f"unknown loss {kind!r}: choose one of {', '.join(LOSSES)}")
    return _LOSS_FNS[kind]


def describe_output(out: Any) -> str:
    """A short description of what a forward returned, for error lines."""
    if isinstance(out, torch.Tensor):
        return f"a {str(out.dtype).replace('torch.', '')} tensor of shape {tuple(out.shape)}"
    return type(out).__name__


# -- the losses ------------------------------------------------------------------------------------

def _auto(out: Any, target: Any = None) -> torch.Tensor:
    own = output_loss(out)
    if own is not None:
        return own
    pred = primary_output(out)
    if target is None:
        raise UserError(f"no target for the output of shape {tuple(pred.shape)} and the model returns no loss of "
                        "its own: give targets, labels, or --loss none")
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        return _ce(pred, target)
    return _scalar(F.mse_loss(pred.float(), _like(target, pred)), "mse")


def _ce(out: Any, target: Any) -> torch.Tensor:
    pred = primary_output(out)
    if pred.dim() >= 2 and tuple(target.shape) == tuple(pred.shape[:-1]):  # (B, T, V) with (B, T), (B, C) with (B,)
        return F.cross_entropy(pred.reshape(-1, pred.shape[-1]).float(), target.reshape(-1).long(), ignore_index=-100)
    if pred.dim() >= 2 and target.dim() == pred.dim() - 1:
        return F.cross_entropy(pred.float(), target.long(), ignore_index=-100)  # (B, C, H, W) with (B, H, W)
    raise UserError(f"cross-entropy needs class targets of the output's shape without its last dimension: output "
                    f"{tuple(pred.shape)}, target {tuple(target.shape)}")


def _nll(out: Any, target: Any) -> torch.Tensor:
    pred = primary_output(out)
    if pred.dim() >= 2 and tuple(target.shape) == tuple(pred.shape[:-1]):
        return F.nll_loss(pred.reshape(-1, pred.shape[-1]).float(), target.reshape(-1).long(), ignore_index=-100)
    return F.nll_loss(pred.float(), target.long(), ignore_index=-100)


def _mse(out: Any, target: Any) -> torch.Tensor:
    pred = primary_output(out)
    return F.mse_loss(pred.float(), _like(target, pred))


def _bce(out: Any, target: Any) -> torch.Tensor:
    pred = primary_output(out)
    return F.binary_cross_entropy_with_logits(pred.float(), _like(target, pred))


def _none(out: Any, target: Any = None) -> torch.Tensor:
    own = output_loss(out)
    return own if own is not None else primary_output(out).float().mean()


_LOSS_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "auto": _auto, "ce": _ce, "nll": _nll, "mse": _mse, "bce-with-logits": _bce, "none": _none,
}


# -- helpers ---------------------------------------------------------------------------------------

def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _find(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    items = _fields_of(out)
    if items is None:
        return None
    logits = _logits(items)
    if logits is not None:
        return logits
    for k, v in items:
        if k == "loss":
            continue
        t = _find(v)
        if t is not None:
            return t
    return None


def _logits(items: list[tuple[str | None, Any]]) -> torch.Tensor | None:
    """The ``logits`` field, where it is a floating-point tensor."""
    logits = next((v for k, v in items if k == "logits"), None)
    return logits if _is_float_tensor(logits) else None


def _fields_of(out: Any) -> list[tuple[str | None, Any]] | None:
    """(name, value) pairs of a mapping or dataclass, (None, value) of a sequence; None for anything else."""
    if isinstance(out, Mapping):
        return list(out.items())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    if isinstance(out, (tuple, list)):
        return [(None, v) for v in out]
    return None


def _scalar(loss: torch.Tensor, what: str) -> torch.Tensor:
    if loss.numel() != 1:
        raise UserError(f"{what} has shape {tuple(loss.shape)}, not a scalar: return the batch's mean loss")
    return loss.reshape(())


def _like(target: Any, pred: torch.Tensor) -> torch.Tensor:
    if not isinstance(target, torch.Tensor):
        raise UserError(f"the target must be a tensor, got {type(target).__name__}")
    if target.shape != pred.shape:
        raise UserError(f"the target's shape {tuple(target.shape)} differs from the output's {tuple(pred.shape)}")
    return target.to(torch.float32)
