"""The arguments of :func:`torch_tricks.doctor.runtime.check_model` checked before anything runs (a
:class:`UserError` that says what to pass), and turned into what the check uses: a loss name or
callable, the device, and the inputs detached onto it."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from torch_tricks.device import module_device
from torch_tricks.device import resolve as resolve_device
from torch_tricks.doctor.runtime.loss import LOSS_KINDS
from torch_tricks.doctor.runtime.util import _optimizer_params, _tensors
from torch_tricks.errors import UserError
from torch_tricks.inspect.inputs import describe_inputs, normalize_inputs


def _check_model_and_steps(model: Any, steps: Any) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"check_model needs an nn.Module, got {type(model).__name__}: pass the model")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserError(f"steps must be an integer >= 1, got {steps!r}")


def _split_loss(loss_fn: Any) -> tuple[str | None, Callable[..., torch.Tensor] | None]:
    """(LOSS_KINDS name, None) for a loss given by name, (None, loss_fn) for a callable or None."""
    if isinstance(loss_fn, str):
        kind = loss_fn.lower().replace("_", "-")
        if kind not in LOSS_KINDS:
            raise UserError(f"unknown loss {loss_fn!r}: choose one of {', '.join(LOSS_KINDS)}")
        return kind, None
    if loss_fn is not None and not callable(loss_fn):
        raise UserError(f"loss_fn must be callable (e.g. nn.CrossEntropyLoss()), got {type(loss_fn).__name__}")
    return None, loss_fn


def _check_optimizer(optimizer: Any, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}: "
            "pass the optimizer instance"
        )
    model_ids = {id(p) for p in model.parameters()}
    if not any(id(p) in model_ids for p in _optimizer_params(optimizer)):
        raise UserError(
            "the optimizer holds none of the model's parameters: pass the optimizer built on this model"
        )


def _resolve_device(device: torch.device | str | None, model: nn.Module) -> torch.device:
    if device is None:
        return module_device(model)
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _prepare_inputs(batch: Any, device: torch.device) -> tuple[Any, ...] | dict[str, Any]:
    """Positional (a tuple) or keyword (a dict) inputs, tensors possibly nested in lists/dicts,
    detached onto ``device``; they are cloned again for every step."""
    inputs = normalize_inputs(batch)
    _check_batch(inputs)
    return tree_map(lambda t: t.detach().to(device) if isinstance(t, torch.Tensor) else t, inputs)


def _check_batch(inputs: tuple[Any, ...] | dict[str, Any]) -> None:
    """The inputs hold a tensor, and every tensor has a batch dimension with a sample."""
    tensors = _tensors(inputs)
    if not tensors:
        raise UserError(f"the batch holds no tensor (got {describe_inputs(inputs) or 'nothing'}): "
                        "pass the input tensor, a tuple of the model's inputs, or a dict of keyword inputs")
    for t in tensors:
        if t.dim() == 0 or t.shape[0] == 0:
            raise UserError(f"the batch has shape {tuple(t.shape)}: give at least one sample, batch dimension first")
