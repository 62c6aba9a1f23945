"""Learning rate for large batches: scale it with the batch, and warm it up (catalogue T21).

A k-times larger batch makes k-times fewer updates per epoch, so Goyal et al. ("Accurate,
Large Minibatch SGD: Training ImageNet in 1 Hour", 2017) scale the learning rate by k
(:func:`scale_lr`, ``rule="linear"``); adaptive optimizers are often better served by
``sqrt(k)`` (Krizhevsky 2014; Hoffer et al. 2017). A large lr applied to random initial
weights can diverge in the first steps, hence a warm-up that ramps the lr from small to
full over the first steps (:func:`warmup_schedule`), then the usual decay.

Why one ``LambdaLR`` and not ``SequentialLR(LinearLR, CosineAnnealingLR)``: ``LinearLR``
cannot start from 0 (its ``start_factor`` must be > 0), ``CosineAnnealingLR``'s
step-by-step (chainable) form drifts from the closed form over long runs, and
``SequentialLR`` resets sub-schedulers at the milestone. A closed-form factor of the step
is exact at every step, and because the factor is a small callable object, not a lambda,
``LambdaLR.state_dict()`` saves its settings, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["scale_lr", "warmup_schedule", "WarmupFactor", "SCHEDULE_KINDS"]

SCHEDULE_KINDS = ("cosine", "linear", "constant")
_LR_RULES = {"linear": float, "sqrt": math.sqrt}  # scale_lr's rule -> the lr factor, of batch_size / base_batch


def scale_lr(base_lr: float, batch_size: int, base_batch: int = 256, rule: str = "linear") -> float:
    """The lr for ``batch_size``, given ``base_lr`` tuned at ``base_batch``.

    ``rule="linear"``: ``base_lr * batch_size / base_batch`` (Goyal et al.; for SGD);
    ``"sqrt"``: ``base_lr * sqrt(batch_size / base_batch)`` (often better for Adam-type
    optimizers, and a safer guess when linear scaling diverges). Pair a scaled-up lr with
    :func:`warmup_schedule`.
    """
    if not _is_real(base_lr) or not math.isfinite(base_lr) or base_lr < 0:
        raise UserError(f"base_lr must be a finite number >= 0, got {base_lr!r}")
    _check_counts(1, batch_size=batch_size, base_batch=base_batch)
    k = batch_size / base_batch
    scale = _LR_RULES.get(rule)
    if scale is None:
        raise UserError(f"unknown lr scaling rule {rule!r}: use 'linear' or 'sqrt'")
    return float(base_lr) * scale(k)


@dataclass
class WarmupFactor:
    """The lr multiplier at optimizer step ``step``: linear warm-up, then ``kind`` decay.

    ``[0, warmup_steps]``: from ``warmup_start_ratio`` up to 1, reaching 1 at
    ``warmup_steps``. ``[warmup_steps, total_steps]``: cosine or linear from 1 down to
    ``min_lr_ratio`` (reached at ``total_steps``), or 1 throughout for ``"constant"``.
    After ``total_steps`` it stays at the final value. A dataclass, so ``LambdaLR`` saves
    and restores its fields with the scheduler's state dict.
    """

    warmup_steps: int
    total_steps: int
    kind: str = "cosine"
    min_lr_ratio: float = 0.0
    warmup_start_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        w = self.warmup_steps
        if step < w:
            return self.warmup_start_ratio + (1.0 - self.warmup_start_ratio) * step / w
        if self.kind == "constant":
            return 1.0
        span = self.total_steps - w
        t = 1.0 if span <= 0 else min(1.0, (step - w) / span)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * t))
        else:  # linear
            shape = 1.0 - t
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@register_trick(
    "lr_warmup",
    ids=("T21",),
    kind="train",
    trades="a few slow-lr steps at the start for stability at large batch / large lr",
    needs="an optimizer; the step count of the run",
    config_key="warmup_steps",
)
def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    *,
    kind: str = "cosine",
    min_lr_ratio: float = 0.0,
    warmup_start_ratio: float = 0.0,
) -> LRScheduler:
    """A ``LambdaLR`` over :class:`WarmupFactor`: call ``scheduler.step()`` after every ``optimizer.step()``.

    Every param group's lr is its lr at construction times the factor. With
    ``warmup_start_ratio=0`` the very first step has lr 0 (as in Hugging Face's
    schedules); Goyal et al.'s recipe starts at the un-scaled lr, i.e.
    ``warmup_start_ratio = base_batch / batch_size``. ``total_steps`` counts warm-up steps
    too; ``kind="constant"`` ignores it beyond validation.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"warmup_schedule needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_counts(0, warmup_steps=warmup_steps, total_steps=total_steps)
    if total_steps < warmup_steps:
        raise UserError(
            f"total_steps ({total_steps}) is less than warmup_steps ({warmup_steps}): total_steps counts the warm-up too"
        )
    if kind not in SCHEDULE_KINDS:
        raise UserError(f"unknown schedule kind {kind!r}: use one of {', '.join(SCHEDULE_KINDS)}")
    _check_ratios(min_lr_ratio=min_lr_ratio, warmup_start_ratio=warmup_start_ratio)
    factor = WarmupFactor(warmup_steps, total_steps, kind, float(min_lr_ratio), float(warmup_start_ratio))
    return LambdaLR(optimizer, lr_lambda=factor)


def _is_real(value: Any) -> bool:
    """An int or float, not a bool (True is an int to Python, never a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_counts(minimum: int, **counts: Any) -> None:
    """Each of ``counts`` (label=value) is an int (not a bool) of at least ``minimum``."""
    for label, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"{label} must be an integer >= {minimum}, got {value!r}")


def _check_ratios(**ratios: Any) -> None:
    """Each of ``ratios`` (label=value) is a number (not a bool) in [0, 1]."""
    for label, value in ratios.items():
        if not _is_real(value) or not 0.0 <= value <= 1.0:
            raise UserError(f"{label} must be a number in [0, 1], got {value!r}")
