"""Measuring one candidate configuration of the training step: time, memory, drift.

Every candidate runs the step ``fit`` would run (:class:`~torch_tricks.train.loop.TrainStep`)
on its own copy of the same initial weights:

* **drift**: the first gradients, and the losses of the first few steps on fixed
  batches, against the plain fp32 run from the same seed;
* **memory**: the peak of live tensor bytes from building the copy through two steps
  (weights, gradients, optimizer state, EMA copy, activations): CUDA's
  ``max_memory_allocated``, elsewhere the inspector's :class:`LiveTensors` (the CPU
  allocator has no counter; process RSS cannot separate one step from the next);
  the forward/backward peak measured at the batch and at half of it gives bytes per
  sample, and so the largest batch under a memory limit (a straight-line estimate,
  stated as such);
* **time**: steps timed round-robin against the baseline (see :func:`time_interleaved`),
  so drift of the machine hits all alike; compile time is the first call, apart.
"""

from __future__ import annotations

import copy
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_tricks.inspect.timing import synchronize
from torch_tricks.train.loop import TrainStep

__all__ = ["Runner", "Memory", "build_runner", "measure_memory", "time_interleaved", "paired_ratio", "relative_diff"]


@dataclass
class Runner:
    """A candidate's live training step, and what was measured of it so far."""

    name: str
    step: TrainStep
    batches: list[Any]
    first_call_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None
    times: list[float] = field(default_factory=list)
    _i: int = 0

    def __call__(self) -> torch.Tensor:
        batch = self.batches[self._i % len(self.batches)]
        self._i += 1
        return self.step(batch)


def build_runner(
    name: str,
    model: nn.Module,
    config: dict[str, Any],
    batches: list[Any],
    *,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None,
    drift_steps: int = 3,
) -> Runner:
    """A runner on a copy of ``model`` under ``config``, with its drift figures measured.

    The first call (which includes ``torch.compile``'s compilation when on) is timed
    apart as ``first_call_s``: gradients of the first batch, then ``drift_steps`` steps.
    """
    step = TrainStep(copy.deepcopy(model), loss_fn=loss_fn, optimizer=optimizer_fn, config=config)
    r = Runner(name, step, batches)
    dev = step.device
    t0 = time.perf_counter()
    r.grads = step.gradients(batches[0])
    synchronize(dev)
    r.first_call_s = time.perf_counter() - t0
    for i in range(drift_steps):
        r.losses.append(float(step(batches[i % len(batches)])))
    return r


@dataclass
class Memory:
    """Peak tensor bytes of one configuration, and its bytes per sample."""

    peak_bytes: int  # build + one step + one more forward/backward, at the batch
    fb_peak_bytes: int  # the forward/backward part of that, with the optimizer state resident
    bytes_per_sample: float | None  # slope of the forward/backward peak between the batch and half of it


def measure_memory(
    model: nn.Module,
    config: dict[str, Any],
    batch: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None,
    per_sample: bool = True,
) -> Memory:
    """Peak tensor bytes of building a copy of ``model`` under ``config`` and training on ``batch``.

    Inside one measurement: the copy, the optimizer, a first step (which creates the
    optimizer state and runs its update), then a forward/backward with everything
    resident. With ``per_sample``, forward/backward peaks at the batch and at half of
    it give bytes per sample (the straight line the largest-batch estimate uses). The
    batch's own bytes are included.
    """
    gc.collect()
    dev = _device_of(config)
    extra = _nbytes(batch)
    half = _slice(batch, _batch_len(batch) // 2) if per_sample and _batch_len(batch) >= 2 else None
    with _Peak(dev) as whole:
        step = TrainStep(copy.deepcopy(model), loss_fn=loss_fn, optimizer=optimizer_fn, config=config)
        step(batch)
        whole.mark()
        step.gradients(batch)
        fb_peak = whole.since_mark()
    slope = None
    if half is not None and config.get("accumulate", 1) <= _batch_len(half):
        with _Peak(dev) as full_rel:
            step.gradients(batch)
        with _Peak(dev) as half_rel:
            step.gradients(half)
        n, h = _batch_len(batch), _batch_len(half)
        slope = max((full_rel.peak - half_rel.peak) / (n - h), 1.0)
    del step
    return Memory(whole.peak + extra, fb_peak + extra, slope)


class _Peak:
    """Peak of newly allocated bytes in a region: CUDA's counters, else :class:`LiveTensors`."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.peak = 0
        self._mark_peak = 0

    def __enter__(self) -> "_Peak":
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
            self._base = torch.cuda.memory_allocated(self.dev)
        else:
            from torch_tricks.inspect.memory import LiveTensors

            self._live = LiveTensors()
            self._live.__enter__()
        return self

    def mark(self) -> None:
        """Start a sub-region: :meth:`since_mark` gives the peak (of everything live) from here on."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            self._mark_peak = torch.cuda.max_memory_allocated(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
        else:
            self._mark_peak = self._live.peak_bytes
            self._live.peak_bytes = self._live.live_bytes

    def since_mark(self) -> int:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            return torch.cuda.max_memory_allocated(self.dev) - self._base
        return self._live.peak_bytes

    def __exit__(self, *exc: Any) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            self.peak = max(torch.cuda.max_memory_allocated(self.dev), self._mark_peak) - self._base
        else:
            self._live.__exit__(*exc)
            self.peak = max(self._live.peak_bytes, self._mark_peak)


def time_interleaved(runners: list[Runner], rounds: int, *, warmup: int = 1,
                     deadline: float = math.inf) -> int:
    """Time one step of every runner per round, rotating the order each round; returns rounds run.

    Appends to each runner's ``times``. Stops early (after at least 3 rounds) at
    ``deadline`` (a ``time.perf_counter()`` value).
    """
    for _ in range(warmup):
        for r in runners:
            r()
    done = 0
    for k in range(rounds):
        if done >= 3 and time.perf_counter() > deadline:
            break
        order = runners[k % len(runners):] + runners[: k % len(runners)]
        for r in order:
            dev = r.step.device
            synchronize(dev)
            t0 = time.perf_counter()
            r()
            synchronize(dev)
            r.times.append(time.perf_counter() - t0)
        done += 1
    return done


def paired_ratio(times: list[float], base: list[float]) -> tuple[float, float]:
    """Median of per-round time ratios to the baseline, and half their inter-quartile range.

    Pairing by round cancels slow drift of the machine that hits both alike.
    """
    n = min(len(times), len(base))
    ratios = [t / b for t, b in zip(times[-n:], base[-n:]) if b > 0]
    if not ratios:
        return math.nan, math.nan
    if len(ratios) < 4:
        return statistics.median(ratios), (max(ratios) - min(ratios)) / 2
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(ratios), (q3 - q1) / 2


def relative_diff(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> float | None:
    """``||a - b|| / ||b||`` over all tensors; ``None`` if the parameter lists do not line up."""
    if a is None or b is None or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    num = math.sqrt(sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(a, b)))
    den = math.sqrt(sum(float(y.float().pow(2).sum()) for y in b))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


def _batch_len(batch: Any) -> int:
    y = batch[1]
    return int(y.shape[0]) if isinstance(y, torch.Tensor) else len(y)


def _slice(batch: Any, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(b, n) for b in batch)
    return batch


def _device_of(config: dict[str, Any]) -> torch.device:
    dev = config.get("device", "cpu")
    if dev == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(dev)
