"""Your optimizer rebuilt by ``Tricks.prepare``: your lr scheduler moved onto the new one, the old one retired.

``optimizer_state`` (T29) and ``optimizer_in_backward`` (T30) cannot be switched on in place:
one keeps the moments in another format (another optimizer class), the other steps one
optimizer per parameter. So ``prepare`` builds a new optimizer on yours, with the same groups
and settings (:func:`~torch_tricks.train.optim_state.low_precision_state`,
:func:`~torch_tricks.train.in_backward.optimizer_in_backward`), and this module hands over the rest:

* :func:`check_scheduler` / :func:`move_scheduler`: the lr scheduler you built on the old optimizer (and the ones inside a
  ``SequentialLR`` / ``ChainedScheduler``) drives the new one. A torch scheduler reads and writes
  nothing but ``scheduler.optimizer.param_groups``, whose ``initial_lr`` and current lr the
  rebuild carries over, so the schedule goes on where it was. It also wraps ``optimizer.step``
  to tell a scheduler stepped before its optimizer (PyTorch's "Detected call of
  lr_scheduler.step() before optimizer.step()" warning); the new optimizer's step is wrapped the
  same way.
* :func:`retire`: the old optimizer's ``step`` raises, naming the one to step: a loop that kept
  the old name would otherwise step the same parameters twice, once on the state it meant to save.

A scheduler of another kind (one that may hold the optimizer elsewhere than in its
``optimizer`` attribute), or one bound to another optimizer than the one rebuilt, is refused in
one line.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from torch_tricks.errors import UserError

__all__ = ["check_scheduler", "move_scheduler", "retire"]


def check_scheduler(scheduler: Any, optimizer: Any, rebuilt_by: str = "") -> None:
    """Refuse a scheduler given to ``prepare`` that cannot drive the optimizer prepare() returns: one bound to another
    optimizer than ``optimizer`` (the one given), or, where ``rebuilt_by`` names the switch that rebuilds that
    optimizer, one :func:`move_scheduler` cannot move."""
    if rebuilt_by and not isinstance(scheduler, LRScheduler):
        raise UserError(f"{rebuilt_by} rebuilds your optimizer, and a {type(scheduler).__name__} cannot be moved onto "
                        "the new one (torch.optim.lr_scheduler's can): build it on the optimizer prepare() returns "
                        "and step it yourself after each tricks.step()")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError("prepare() builds the optimizer here (you gave it none, or a callable), so an lr scheduler "
                        "given to it drives nothing: pass your optimizer itself with it, or no scheduler "
                        "(config.schedule)")
    nested = _nested(scheduler) if isinstance(scheduler, LRScheduler) else [scheduler]
    if any(getattr(s, "optimizer", None) is not optimizer for s in nested):
        raise UserError("the lr scheduler given to prepare() is bound to another optimizer than the one given: build "
                        "it on the optimizer you pass prepare() (or pass no scheduler: config.schedule)")


def move_scheduler(scheduler: LRScheduler, new: torch.optim.Optimizer) -> None:
    """Bind ``scheduler`` (checked by :func:`check_scheduler`) to ``new``, which has the old optimizer's groups in
    the same order and its settings."""
    nested = _nested(scheduler)
    old = scheduler.optimizer
    for s in nested:
        s.optimizer = new
    _track_step(new)
    if getattr(old, "_opt_called", False):  # the old one had stepped: the new one goes on from its state
        new._opt_called = True


def retire(old: torch.optim.Optimizer, why: str) -> None:
    """``old.step()`` raises from now on, naming the optimizer to step (``zero_grad`` still works: same parameters)."""
    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        raise UserError(f"this optimizer was rebuilt by tricks.prepare() ({why}): step the one prepare() returned "
                        "(model, optimizer = tricks.prepare(model, optimizer))")

    old.step = types.MethodType(step, old)  # a method, so that a scheduler built on it later can still wrap it


def _nested(scheduler: LRScheduler) -> list[LRScheduler]:
    """The scheduler and those it drives (a SequentialLR's or ChainedScheduler's), each once."""
    out = [scheduler]
    for s in getattr(scheduler, "_schedulers", None) or []:
        out += [t for t in _nested(s) if all(t is not u for u in out)]
    return out


def _track_step(opt: torch.optim.Optimizer) -> None:
    """Wrap ``opt.step`` as a torch LRScheduler wraps its optimizer's: it records that the optimizer stepped."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    func = opt.step.__func__
    ref = weakref.ref(opt)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        o = ref()
        o._opt_called = True
        return func.__get__(o, o.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper
