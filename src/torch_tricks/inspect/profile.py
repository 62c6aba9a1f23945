"""Where does a training step spend its time? (catalogue item P5).

One call runs the step under two profilers, one after the other so neither one's overhead
pollutes the other: ``cProfile`` finds Python hot spots (data loading, logging, a slow
loss written as a loop), ``torch.profiler`` finds the operators (``aten::addmm``,
convolutions, copies) and, on a GPU, their device time. The tables come from the
profilers' own ``pstats`` / ``key_averages()``; we only pick the top rows into data classes.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from torch_tricks._format import table
from torch_tricks._io import atomic_path
from torch_tricks.errors import UserError
from torch_tricks.inspect.timing import synchronize

__all__ = ["ProfileReport", "PythonHotSpot", "OpHotSpot", "profile_step"]


@dataclass
class PythonHotSpot:
    """One function from cProfile; times are totals over all profiled steps."""

    function: str  # pstats' "file:line(name)" form
    ncalls: int
    tottime_ms: float  # in the function itself
    cumtime_ms: float  # including callees


@dataclass
class OpHotSpot:
    """One operator (or ``record_function`` range) from torch.profiler, totals over all steps."""

    name: str
    count: int
    self_cpu_ms: float
    cpu_total_ms: float
    self_device_ms: float | None = None  # CUDA (or other accelerator) time; None on CPU-only runs
    device_total_ms: float | None = None
    input_shapes: str | None = None  # only with record_shapes=True


@dataclass
class ProfileReport:
    """Top hot spots of ``steps`` calls of a step function."""

    steps: int
    warmup: int
    python: list[PythonHotSpot] = field(default_factory=list)
    ops: list[OpHotSpot] = field(default_factory=list)
    cprofile_table: str | None = None  # pstats' own text, for printing
    torch_table: str | None = None  # key_averages().table(), for printing
    trace_path: str | None = None  # Chrome trace (open in chrome://tracing or Perfetto)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self, model_name: str = "model", batch: int | None = None) -> str:
        """What ``torch-tricks profile`` prints: both top-k tables, compact (the profilers' own
        tables, ``torch_table`` and ``cprofile_table``, are wider). ``model_name`` and ``batch``
        name the step in the first line, as the report does not know them."""
        head = f"{model_name}, batch {batch}" if batch is not None else model_name
        text = [f"{head}: hot spots of one training step"]
        if self.ops:
            text += ["", f"torch.profiler operators (by self CPU time, {self.steps} steps):", self._ops_table()]
        if self.python:
            text += ["", "cProfile functions (by cumulative time):", self._python_table()]
        if self.trace_path:
            text += ["", f"Chrome trace written to {self.trace_path}"]
        return "\n".join(text)

    def _ops_table(self) -> str:
        return table(["operator", "calls", "self ms", "total ms"],
                     [[o.name, o.count, f"{o.self_cpu_ms:.2f}", f"{o.cpu_total_ms:.2f}"] for o in self.ops])

    def _python_table(self) -> str:
        return table(["function", "calls", "cumulative ms", "own ms"],
                     [[f.function[-70:], f.ncalls, f"{f.cumtime_ms:.2f}", f"{f.tottime_ms:.2f}"]
                      for f in self.python], "lrrr")


def profile_step(
    step_fn: Callable[[], Any],
    *,
    warmup: int = 1,
    steps: int = 3,
    top_k: int = 15,
    use_torch_profiler: bool = True,
    use_cprofile: bool = True,
    record_shapes: bool = False,
    trace_path: str | os.PathLike[str] | None = None,
) -> ProfileReport:
    """Run ``step_fn()`` ``warmup`` times, then ``steps`` times under each enabled profiler.

    Python functions are ranked by cumulative time (so the step itself comes first, then
    what it spends its time in); operators by self CPU time. ``trace_path`` (``.json`` or
    ``.json.gz``) saves the torch.profiler run as a Chrome trace, written atomically.
    """
    if not callable(step_fn):
        raise UserError(f"profile_step needs a callable step function, got {type(step_fn).__name__}")
    _check_counts(warmup, steps, top_k)
    _check_profilers(use_torch_profiler, use_cprofile, trace_path)

    for _ in range(warmup):
        step_fn()
    synchronize()

    report = ProfileReport(steps=steps, warmup=warmup)
    if use_cprofile:
        report.python, report.cprofile_table = _run_cprofile(step_fn, steps, top_k)
    if use_torch_profiler:
        report.ops, report.torch_table, trace = _run_torch_profiler(
            step_fn, steps, top_k, record_shapes, trace_path
        )
        report.trace_path = str(trace) if trace is not None else None
    return report


# --- helpers ---------------------------------------------------------------------------


def _check_counts(warmup: Any, steps: Any, top_k: Any) -> None:
    for name, value, low in (("warmup", warmup, 0), ("steps", steps, 1), ("top_k", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_profilers(use_torch_profiler: bool, use_cprofile: bool, trace_path: Any) -> None:
    if not (use_cprofile or use_torch_profiler):
        raise UserError("both profilers are disabled: enable use_cprofile or use_torch_profiler")
    if trace_path is not None and not use_torch_profiler:
        raise UserError("trace_path needs the torch profiler: drop use_torch_profiler=False")


def _run_cprofile(step_fn: Callable[[], Any], steps: int, top_k: int) -> tuple[list[PythonHotSpot], str]:
    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(steps):
            step_fn()
        synchronize()
    finally:
        prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    _drop_profiler_calls(stats)
    stats.sort_stats(pstats.SortKey.CUMULATIVE)
    stats.print_stats(top_k)
    rows = []
    for key in stats.fcn_list[:top_k]:  # type: ignore[attr-defined]  # set by sort_stats
        _cc, nc, tt, ct, _callers = stats.stats[key]  # type: ignore[attr-defined]
        rows.append(PythonHotSpot(pstats.func_std_string(key), int(nc), tt * 1e3, ct * 1e3))
    return rows, buf.getvalue()


def _drop_profiler_calls(stats: pstats.Stats) -> None:
    """Drop the profiler's own bookkeeping call so it cannot take a top-k slot."""
    for key in [k for k in stats.stats if k[2] == "<method 'disable' of '_lsprof.Profiler' objects>"]:
        del stats.stats[key]


def _run_torch_profiler(
    step_fn: Callable[[], Any],
    steps: int,
    top_k: int,
    record_shapes: bool,
    trace_path: str | os.PathLike[str] | None,
) -> tuple[list[OpHotSpot], str, Path | None]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            step_fn()
        synchronize()  # so the last step's kernels are inside the profiled window

    averages = prof.key_averages(group_by_input_shape=record_shapes)
    table = averages.table(sort_by="self_cpu_time_total", row_limit=top_k)
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top_k]
    rows = [_op_hot_spot(e, on_cuda, record_shapes) for e in events]
    trace = _export_trace(prof, trace_path) if trace_path is not None else None
    return rows, table, trace


def _op_hot_spot(e: Any, on_cuda: bool, record_shapes: bool) -> OpHotSpot:
    """One ``key_averages()`` event; the profiler reports microseconds."""
    dev_self, dev_total = _device_times(e)
    has_dev = on_cuda and (dev_total or dev_self)
    return OpHotSpot(
        name=e.key,
        count=int(e.count),
        self_cpu_ms=e.self_cpu_time_total / 1e3,
        cpu_total_ms=e.cpu_time_total / 1e3,
        self_device_ms=dev_self / 1e3 if has_dev else None,
        device_total_ms=dev_total / 1e3 if has_dev else None,
        input_shapes=str(e.input_shapes) if record_shapes and e.input_shapes else None,
    )


def _device_times(e: Any) -> tuple[float, float]:
    """(self, total) device microseconds; torch < 2.4 names them self_cuda_time_total / cuda_time_total."""
    dev_self = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    dev_total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    return dev_self, dev_total


def _export_trace(prof: Any, trace_path: str | os.PathLike[str]) -> Path:
    """Write the Chrome trace to a temporary file beside ``trace_path``, then rename it."""
    target = Path(trace_path)
    if target.is_dir():
        raise UserError(f"trace path {str(target)!r} is a directory: give a file name such as trace.json")
    # Keep the suffix: export_chrome_trace gzips when the name ends in .gz.
    with atomic_path(target, suffix=target.suffix or ".json") as tmp:
        prof.export_chrome_trace(str(tmp))
    return target
