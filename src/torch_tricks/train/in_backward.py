"""T30: the optimizer step fused into backward, so no gradient outlives its step.

A plain step holds every gradient at once: after backward and until ``optimizer.step()``,
as many bytes as the trainable parameters. PyTorch's recipe ("How to save memory by fusing
the optimizer step into the backward pass") steps each parameter as soon as its gradient is
accumulated (``Tensor.register_post_accumulate_grad_hook``) and frees that gradient at once,
so at most the gradients backward is still producing are alive. :func:`optimizer_in_backward`
turns a built optimizer into one per parameter (the same class) behind an
:class:`InBackwardOptimizer`: a ``torch.optim.Optimizer`` with the built one's parameter groups
(the same groups, settings and extra keys, so an lr scheduler sized to those groups runs on it)
and the per-parameter optimizers' shared ``state``. Each per-parameter optimizer takes its
group's settings (lr, betas, momentum, weight decay) just before its step, so what a scheduler
writes into the groups reaches them; the built optimizer's state, where it has stepped or loaded
one already, carries over (the same tensors, not copies: step the new optimizer only). Its
``state_dict`` saves and restores them; its ``step`` and ``zero_grad`` have nothing left to do.
``Tricks`` does it under ``optimizer_in_backward = true``, to your own optimizer too (an lr
scheduler you pass ``prepare`` is moved onto it).

It cannot be right where the whole gradient is needed before any step: accumulation over
micro-batches (each backward would step), global-norm clipping (the norm needs every
gradient), the fp16 grad scaler (it unscales and checks all gradients first), DDP / ZeRO /
FSDP (their gradients are reduced across ranks after the local accumulation the hook sees):
``Tricks`` refuses each with one line. The NaN guard still stops the run on a non-finite
loss, but after the step it could not wait for.

Written here rather than with ``torch.distributed.optim._apply_optimizer_in_backward``
(private, and its optimizers are not reachable by a scheduler or a state dict).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick
from torch_tricks.train.config import why_not_in_backward

__all__ = ["InBackwardOptimizer", "optimizer_in_backward", "paused", "why_not_in_backward"]


@register_trick(
    "optimizer_in_backward",
    ids=("T30",),
    kind="train",
    trades="each parameter stepped as soon as its gradient is ready, the gradient freed at once: the gradients "
           "never all exist, for one optimizer call per parameter",
    needs="no accumulation, no global-norm clipping, no fp16 scaler, one process (no DDP/ZeRO/FSDP)",
    config_key="optimizer_in_backward",
    measured_in="benchmarks/memory.py",
)
def optimizer_in_backward(optimizer: torch.optim.Optimizer) -> "InBackwardOptimizer":
    """Step ``optimizer``'s parameters inside backward, one optimizer per parameter (see the module doc)."""
    if isinstance(optimizer, InBackwardOptimizer):
        return optimizer
    return InBackwardOptimizer(optimizer)


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, stepped from its gradient hook; this object holds the groups they take their
    settings from, and their state."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        self.inner_class = cls.__name__
        self.optimizers: list[torch.optim.Optimizer] = []
        self._group_of: list[int] = []  # per optimizer: the index of the group it takes its settings from
        for i, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self.optimizers.append(cls([{"params": [p], **_settings(group)}]))
                    self._group_of.append(i)
        if not self.optimizers:
            raise UserError("optimizer_in_backward: the optimizer has no trainable parameter")
        super().__init__([dict(g, params=list(g["params"])) for g in optimizer.param_groups], {})
        self._link()
        for p, state in optimizer.state.items():  # a stepped (or loaded) optimizer goes on from where it was
            if state:
                self.state[p] = state
        self._paused = False
        self._handles = [opt.param_groups[0]["params"][0].register_post_accumulate_grad_hook(
            functools.partial(self._step_and_free, opt, i)) for opt, i in zip(self.optimizers, self._group_of)]

    def _step_and_free(self, opt: torch.optim.Optimizer, i: int, p: torch.Tensor) -> None:
        if self._paused:
            return
        opt.param_groups[0].update(_settings(self.param_groups[i]))  # what a scheduler wrote since the last step
        opt.step()
        opt.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Backward inside keeps its gradients and steps nothing: for reading the gradients themselves
        (the tune's drift check, a probe step), which would otherwise be freed and stepped with."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def _link(self) -> None:
        """The per-parameter optimizers keep their state in this object's (one shared state)."""
        for opt in self.optimizers:
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Nothing left to do: each parameter was stepped in backward (a closure is called for its loss)."""
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients were freed as they were used; any left (a parameter no backward reached) too."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()  # the load made a new state: hand it to the optimizers
        restore = getattr(self.optimizers[0], "restore_state_dtypes", None)
        if restore is not None:  # a state kept in another dtype than the parameters' (bf16 moments)
            restore()

    def remove(self) -> None:
        """Take the hooks off (the parameters are then stepped by no one)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def paused(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
    """:meth:`InBackwardOptimizer.paused` for an optimizer stepped in backward; nothing for any other."""
    return optimizer.paused() if isinstance(optimizer, InBackwardOptimizer) else contextlib.nullcontext()


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A group's settings: all but its parameters (and their names)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
