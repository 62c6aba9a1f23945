"""Correct wall-clock timing of PyTorch code (catalogue item P4).

GPU kernels run asynchronously, so a timer read without a device synchronisation measures
only the kernel *launch*. The first calls pay for lazy initialisation, cuDNN autotuning and
allocator growth, so they are warm-up, not signal. Single samples are noisy and skewed by
outliers (GC, other processes), so we report the median and the inter-quartile range.

``torch.utils.benchmark.Timer`` does much of this too, but it times blocks of calls rather
than each call, and has no round-robin mode for comparisons made side by side (where
machine drift must hit every candidate alike); :func:`benchmark` and :func:`compare` are
small enough to own, and keep every raw sample for the caller.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch

from torch_tricks._format import table
from torch_tricks.device import parse as parse_device
from torch_tricks.device import synchronize
from torch_tricks.errors import UserError

__all__ = ["Timing", "benchmark", "compare", "synchronize", "format_seconds", "timings_table"]


@dataclass
class Timing:
    """Summary statistics of repeated timings, in seconds, plus the raw samples."""

    median_s: float
    iqr_s: float
    min_s: float
    max_s: float
    mean_s: float
    std_s: float
    repeats: int
    warmup: int
    times_s: list[float] = field(default_factory=list, repr=False)

    @classmethod
    def from_times(cls, times_s: list[float], warmup: int = 0) -> Timing:
        """Summarise raw samples; IQR and std are 0 for a single sample."""
        if not times_s:
            raise ValueError("Timing needs at least one sample")
        times = [float(t) for t in times_s]
        if len(times) >= 2:
            q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
            iqr, std = q3 - q1, statistics.stdev(times)
        else:
            iqr, std = 0.0, 0.0
        return cls(
            median_s=statistics.median(times),
            iqr_s=iqr,
            min_s=min(times),
            max_s=max(times),
            mean_s=statistics.fmean(times),
            std_s=std,
            repeats=len(times),
            warmup=warmup,
            times_s=times,
        )

    def ratio_to(self, baseline: Timing) -> float:
        """``self.median / baseline.median``: below 1 means faster than ``baseline``."""
        if baseline.median_s <= 0:
            return math.inf if self.median_s > 0 else 1.0
        return self.median_s / baseline.median_s

    def to_dict(self, *, include_times: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not include_times:
            d.pop("times_s")
        return d

    def __str__(self) -> str:
        scale, unit = _unit_for(self.median_s)
        return (
            f"{self.median_s * scale:.3g} {unit} ± {self.iqr_s / 2 * scale:.2g} "
            f"(median ± IQR/2, n={self.repeats})"
        )


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 3,
    repeats: int = 10,
    min_time_s: float = 0.0,
    device: torch.device | str | int | None = None,
    sync: bool = True,
    **kwargs: Any,
) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then at least ``repeats`` timed ones.

    Timed calls continue past ``repeats`` until their summed time reaches ``min_time_s``.
    Each call is bracketed by :func:`synchronize` (unless ``sync=False``) so queued GPU work
    is counted. ``fn``'s own keyword arguments must not be named like ours; wrap it in a
    lambda or ``functools.partial`` if they are.
    """
    if not callable(fn):
        raise UserError(f"benchmark needs a callable, got {type(fn).__name__}: pass the function itself")
    warmup, repeats, min_time_s = _check_counts(warmup, repeats, min_time_s)
    _check_device(device)

    def call() -> None:
        fn(*args, **kwargs)

    for _ in range(warmup):
        call()
    if sync:
        synchronize(device)
    times: list[float] = []
    total = 0.0
    while len(times) < repeats or total < min_time_s:
        t = _timed(call, device, sync)
        times.append(t)
        total += t
    return Timing.from_times(times, warmup)


def compare(
    fns: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 3,
    repeats: int = 10,
    min_time_s: float = 0.0,
    device: torch.device | str | int | None = None,
    sync: bool = True,
) -> dict[str, Timing]:
    """Time several zero-argument callables side by side, interleaved round-robin.

    Each round calls every candidate once, starting one place further along each round, so
    slow drift (thermal throttling, other load) and "who runs after whom" cache effects hit
    all candidates alike. Rounds continue until ``repeats`` rounds are done and the summed
    time of all candidates reaches ``min_time_s``. Returns timings in the order of ``fns``.
    """
    _check_candidates(fns)
    warmup, repeats, min_time_s = _check_counts(warmup, repeats, min_time_s)
    _check_device(device)

    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    if sync:
        synchronize(device)
    times = _round_robin(fns, repeats, min_time_s, device, sync)
    return {name: Timing.from_times(times[name], warmup) for name in names}


def timings_table(results: Mapping[str, Timing], batch: int | None = None, *, title: str | None = None) -> str:
    """The table ``torch-tricks time`` prints: one row per named :class:`Timing` (median and IQR in
    ms; with ``batch``, samples/s). ``title`` heads it, followed by how the median was taken (the
    first timing's repeats and warm-up), so a reader knows what the numbers are."""
    headers = ["workload", "median ms", "IQR ms"] + (["samples/s"] if batch is not None else [])
    rows = [[name, f"{t.median_s * 1e3:.2f}", f"{t.iqr_s * 1e3:.2f}"]
            + ([f"{batch / t.median_s:.1f}"] if batch is not None else [])
            for name, t in results.items()]
    text = table(headers, rows)
    if title is None:
        return text
    first = next(iter(results.values()), None)
    how = f" (median of {first.repeats} after {first.warmup} warm-up)" if first is not None else ""
    return f"{title}{how}:\n{text}"


def format_seconds(seconds: float) -> str:
    """``0.0123`` -> ``'12.3 ms'``: three significant digits in a readable unit."""
    scale, unit = _unit_for(seconds)
    return f"{seconds * scale:.3g} {unit}"


# --- helpers ---------------------------------------------------------------------------


def _check_candidates(fns: Any) -> None:
    if not isinstance(fns, Mapping) or not fns:
        raise UserError("compare needs a non-empty dict of name -> zero-argument callable")
    for name, fn in fns.items():
        if not callable(fn):
            raise UserError(f"compare: candidate {name!r} is a {type(fn).__name__}, not a callable")


def _check_device(device: torch.device | str | int | None) -> None:
    """Validate ``device`` early, before any call."""
    if device is not None:
        parse_device(device)


def _round_robin(
    fns: Mapping[str, Callable[[], Any]], repeats: int, min_time_s: float, device: Any, sync: bool
) -> dict[str, list[float]]:
    """The timed rounds of :func:`compare`, each starting one candidate further along."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    total = 0.0
    rounds = 0
    while rounds < repeats or total < min_time_s:
        k = rounds % len(names)
        for name in names[k:] + names[:k]:
            t = _timed(fns[name], device, sync)
            times[name].append(t)
            total += t
        rounds += 1
    return times


def _timed(call: Callable[[], Any], device: Any, sync: bool) -> float:
    if sync:
        synchronize(device)
    t0 = time.perf_counter()
    call()
    if sync:
        synchronize(device)
    return time.perf_counter() - t0


def _check_counts(warmup: Any, repeats: Any, min_time_s: Any) -> tuple[int, int, float]:
    _check_count("warmup", warmup, 0)
    _check_count("repeats", repeats, 1)
    try:
        min_time = float(min_time_s)
    except (TypeError, ValueError):
        raise UserError(f"min_time_s must be a number of seconds >= 0, got {min_time_s!r}") from None
    if not math.isfinite(min_time) or min_time < 0:
        raise UserError(f"min_time_s must be a finite number of seconds >= 0, got {min_time_s!r}")
    return warmup, repeats, min_time


def _check_count(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{name} must be an integer >= {low}, got {value!r}")


def _unit_for(seconds: float) -> tuple[float, str]:
    a = abs(seconds)
    if a >= 1 or a == 0:
        return 1.0, "s"
    if a >= 1e-3:
        return 1e3, "ms"
    if a >= 1e-6:
        return 1e6, "us"
    return 1e9, "ns"
