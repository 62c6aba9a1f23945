"""The three workloads every measurement in the inspector times or profiles.

``forward``, ``forward+backward`` and a full training ``step`` (zero grad, forward, loss,
backward, optimizer step) of a model on fixed inputs. Without a ``loss_fn`` the loss
is the sum of the means of the floating-point outputs: it touches every output, so the
backward pass has the same cost as with a real loss, and needs no targets.

Inputs follow :func:`torch_tricks.inspect.inputs.call_model`: a dict is keyword arguments
(a transformers model's ``input_ids``, ``attention_mask``, ``labels``), a tuple positional.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from torch_tricks.errors import UserError
from torch_tricks.inspect.inputs import call_model, normalize_inputs

__all__ = ["OPTIMIZERS", "make_optimizer", "default_loss", "Workloads", "workloads"]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01),
}


def make_optimizer(spec: str | Callable[..., torch.optim.Optimizer], params) -> torch.optim.Optimizer:
    """An optimizer from a name in :data:`OPTIMIZERS` or a callable ``params -> Optimizer``."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise UserError("the model has no trainable parameters: nothing to optimise")
    if callable(spec):
        return spec(params)
    try:
        return OPTIMIZERS[spec.lower()](params)
    except KeyError:
        raise UserError(f"unknown optimizer {spec!r}: choose one of {', '.join(OPTIMIZERS)}") from None


def default_loss(output: Any, *_: Any) -> torch.Tensor:
    """Sum of the means of all floating-point output tensors (see module docstring)."""
    flat, _ = tree_flatten(output)
    terms = [t.float().mean() for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not terms:
        raise UserError("the model returns no floating-point tensor to take a loss of: return the logits "
                        "(from Python: pass loss_fn)")
    return torch.stack(terms).sum()


class Workloads:
    """Callables for forward, forward+backward and a training step on fixed inputs."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        optimizer: str | Callable[..., torch.optim.Optimizer] | torch.optim.Optimizer = "sgd",
        target: Any = None,
    ):
        self.model = model
        self.inputs = normalize_inputs(inputs)
        self.loss_fn = loss_fn or default_loss
        self.target = target
        self._optimizer_spec = optimizer
        self._optimizer: torch.optim.Optimizer | None = (
            optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = make_optimizer(self._optimizer_spec, self.model.parameters())
        return self._optimizer

    def loss(self) -> torch.Tensor:
        out = call_model(self.model, self.inputs)
        loss = self.loss_fn(out, self.target) if self.target is not None else self.loss_fn(out)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"the loss has {what}, not a scalar: return the batch's mean loss")
        return loss

    def forward(self) -> Any:
        with torch.no_grad():
            return call_model(self.model, self.inputs)

    def forward_backward(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        return loss.detach()

    def step(self) -> torch.Tensor:
        opt = self.optimizer
        opt.zero_grad(set_to_none=True)
        loss = self.loss()
        loss.backward()
        opt.step()
        return loss.detach()


def workloads(model: nn.Module, inputs: Any, **kwargs: Any) -> Workloads:
    """Shorthand for :class:`Workloads`."""
    return Workloads(model, inputs, **kwargs)
