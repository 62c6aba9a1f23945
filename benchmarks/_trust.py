"""Benchmarks that distrust themselves (issue 16): checks of a benchmark's own baselines.

A ratio is only as good as its baseline. A fresh machine once timed eager fp32 ResNet-18 at
2 threads *slower* than at 1 thread (73 ms vs 45 ms) and then called int8 "11.39x, PASS":
a ratio against a broken baseline. So before a benchmark reports a ratio it checks what the
ratio stands on, and a row whose check failed is ``UNRELIABLE`` (with the check that failed
named), never PASS. Three checks, the same for every benchmark that prints PASS/FAIL:

* **threads** (:func:`thread_check`): a baseline run on several threads that is slower than
  the same baseline on one thread (by more than :data:`THREAD_SLACK`). More threads may
  not help a small call, but they cannot make a parallel kernel slower on an idle machine:
  a core was taken away (another process) or the threads spin waiting for each other.
* **A/A** (:func:`aa_check`): the same configuration measured twice, interleaved with the
  others as one more candidate, whose two results differ by more than the benchmark's
  stated noise (:data:`AA_TOLERANCE` unless the benchmark states its own). A ratio closer
  to its target than the method's own noise says nothing either way.
* **foreign load** (:class:`LoadMonitor`, :func:`load_check`): CPU time used during a
  measurement by processes other than this one and its descendants, above
  :data:`FOREIGN_MAX_CORES` cores on average (plus :data:`FOREIGN_SLACK_S` for the 10-ms
  granularity of the kernel's counters; a window shorter than :data:`MIN_WINDOW_S` is held
  open, idle, until it lasts that long). Measured by the product, :mod:`torch_tricks.machine`
  (the tune watches the machine with the same monitor): the busy time of the CPUs this
  process may use, from ``/proc/stat``, less this process tree's CPU time (its threads, its
  reaped children, its live descendants); where ``/proc/stat`` is missing (not Linux), the
  1-minute load average less this tree's cores stands in (coarse; said so).

:func:`verdict` turns a row's own PASS/FAIL and its checks into the status printed:
``UNRELIABLE`` when a check failed, else the row's own PASS/FAIL stands. A row that fails
for a reason no timing can change (an int8 model that missed its agreement target) stays
FAIL (``fail_regardless``), its failed checks still named.

The benchmarks import this module from their own folder (``benchmarks/`` is on
``sys.path`` when a script there runs, and the package is installed);
``tests/test_benchmarks_trust.py`` tests it with synthetic timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

from torch_tricks import machine
from torch_tricks.machine import (
    FOREIGN_MAX_CORES,
    FOREIGN_SLACK_S,
    MIN_WINDOW_S,
    CpuSnapshot,
    ForeignLoad,
    cpu_snapshot,
)

__all__ = [
    "AA_TOLERANCE", "FOREIGN_MAX_CORES", "FOREIGN_SLACK_S", "MIN_WINDOW_S", "THREAD_SLACK", "UNRELIABLE",
    "Check", "CpuSnapshot", "ForeignLoad", "Ledger", "LoadMonitor",
    "aa_check", "cpu_snapshot", "failed", "load_check", "rules_text", "thread_check", "verdict", "why",
]

UNRELIABLE = "UNRELIABLE"
#: A/A: the two measurements of one configuration may differ by this much (max / min - 1)
AA_TOLERANCE = 0.10
#: threads: a multi-thread baseline may be this much slower than its single-thread run (noise)
THREAD_SLACK = 0.05
# foreign load: FOREIGN_MAX_CORES (other processes' average cores allowed), FOREIGN_SLACK_S (CPU seconds
# tolerated on top, for the kernel's 10-ms ticks) and MIN_WINDOW_S (a shorter window is held open) are the
# product's, from torch_tricks.machine: the tune and the benchmarks call a machine shared alike


# --------------------------------------------------------------------------- checks and verdicts


@dataclass(frozen=True)
class Check:
    """One check of a baseline: which (``kind``: "threads", "A/A", "foreign load"), whether it held, and what it saw."""

    kind: str
    ok: bool
    detail: str
    brief: str = ""  # a few words for a row's verdict line (the detail goes in the checks' list)

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"

    def short(self) -> str:
        return f"{self.kind} ({self.brief or self.detail})"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ok": self.ok, "detail": self.detail}


def failed(checks: Iterable[Check]) -> list[Check]:
    """The checks that did not hold, each once (in order)."""
    out: list[Check] = []
    for c in checks:
        if not c.ok and c not in out:
            out.append(c)
    return out


def verdict(ok: bool | None, checks: Iterable[Check] = (), *, fail_regardless: bool = False) -> str:
    """The status of a row: ``UNRELIABLE`` when one of its ``checks`` failed, else its own PASS/FAIL.

    ``ok`` is the row's own result (None: not measured, "SKIP"). ``fail_regardless``: the row
    fails for a reason no timing changes (e.g. a wrong model), so it is FAIL whatever the checks.
    """
    if fail_regardless:
        return "FAIL"
    if failed(checks):
        return UNRELIABLE
    if ok is None:
        return "SKIP"
    return "PASS" if ok else "FAIL"


def why(checks: Iterable[Check], *, brief: bool = False) -> str:
    """The failed checks in one line ('' when every check held); ``brief``: a few words each."""
    return "; ".join(c.short() if brief else str(c) for c in failed(checks))


def thread_check(single_s: float, multi_s: float, threads: int, *, what: str,
                 slack: float = THREAD_SLACK) -> Check:
    """A baseline timed on ``threads`` threads (``multi_s``) against the same on one thread (``single_s``).

    Fails when the multi-thread time is more than ``1 + slack`` times the single-thread time.
    """
    ratio = multi_s / single_s if single_s > 0 else math.inf
    ok = math.isfinite(ratio) and ratio <= 1.0 + slack
    detail = (f"{what} on {threads} threads {_fmt_s(multi_s)} vs 1 thread {_fmt_s(single_s)}: "
              f"{ratio:.2f}x the single-thread time (at most {1.0 + slack:.2f}x)")
    return Check("threads", ok, detail, f"{what}: {threads} threads {ratio:.2f}x slower than 1")


def aa_check(a: float | None, b: float | None, *, what: str, tolerance: float = AA_TOLERANCE,
             fmt: Callable[[float], str] | None = None, ratio: float | None = None) -> Check:
    """The same configuration measured twice, interleaved: ``a`` and ``b`` (times or rates).

    Fails when they differ by more than ``tolerance`` (``max / min - 1``). ``ratio``: the A/A
    ratio when the benchmark computes it otherwise (the median of per-round ratios, or a tune's
    A/A noise, where ``a`` and ``b`` may be None), else ``a / b``.
    """
    fmt = fmt or _fmt_s
    if ratio is not None:
        r = ratio
    else:
        r = a / b if a is not None and b is not None and b > 0 else math.inf
    spread = max(r, 1.0 / r) - 1.0 if r > 0 and math.isfinite(r) else math.inf
    ok = spread <= tolerance
    values = f"{fmt(a)} vs {fmt(b)} " if a is not None and b is not None else ""
    detail = (f"{what} measured twice, interleaved: {values}({r:.3f}x; "
              f"A/A must agree within {tolerance:.0%})")
    return Check("A/A", ok, detail, f"{what}: {r:.2f}x, noise {tolerance:.0%}")


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return str(s)
    if s >= 1.0:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


# --------------------------------------------------------------------------- foreign load


class LoadMonitor(machine.LoadMonitor):
    """``with LoadMonitor() as m: ...`` then ``m.load`` (a :class:`ForeignLoad`) and ``m.check(what)``.

    The product's monitor (:class:`torch_tricks.machine.LoadMonitor`: a window shorter than
    ``min_wall_s`` is held open, idle, until it lasts that long) with the benchmarks' check.
    """

    def check(self, what: str, **kw: Any) -> Check:
        return load_check(self.load, what=what, **kw)


def load_check(loads: ForeignLoad | Iterable[ForeignLoad], *, what: str, max_cores: float = FOREIGN_MAX_CORES,
               slack_s: float = FOREIGN_SLACK_S) -> Check:
    """Fails when any of the windows ``loads`` (of one row's measurements) saw foreign load.

    The detail names the worst window. A window where load is not measurable passes (said so).
    """
    windows = [loads] if isinstance(loads, ForeignLoad) else list(loads)
    measurable = [w for w in windows if w.foreign_s is not None]
    if not measurable:
        return Check("foreign load", True, f"{what}: not measurable here")
    worst = max(measurable, key=lambda w: (w.excessive(max_cores, slack_s), w.foreign_cores or 0.0))
    bad = sum(w.excessive(max_cores, slack_s) for w in measurable)
    ok = bad == 0
    many = f" ({bad} of {len(measurable)} windows)" if len(measurable) > 1 and bad else ""
    detail = f"{what}: {_detail(worst)}{many}; at most {max_cores:g} cores allowed"
    return Check("foreign load", ok, detail, f"{what}: {worst.foreign_cores or 0.0:.2f} cores of other processes")


def _detail(load: ForeignLoad) -> str:
    """A window's load as a benchmark's check states it: both sides' cores, the window, the source."""
    if load.foreign_s is None:
        return f"not measurable here ({load.source})"
    la = f", load average {load.loadavg:.2f}" if load.loadavg is not None else ""
    return (f"other processes used {load.foreign_cores:.2f} cores, this benchmark {load.own_cores:.2f}, "
            f"over {load.wall_s:.2f} s ({load.source}{la})")


# --------------------------------------------------------------------------- bookkeeping


@dataclass
class Ledger:
    """Checks filed under keys (a benchmark's measurement windows: ``(group, threads, batch)`` ...).

    ``for_(*keys)``: the checks a row depends on; ``lines()``: every check, held or not, for the report.
    """

    checks: dict[Hashable, list[Check]] = field(default_factory=dict)

    def add(self, key: Hashable, check: Check) -> Check:
        self.checks.setdefault(key, []).append(check)
        return check

    def for_(self, *keys: Hashable) -> list[Check]:
        out: list[Check] = []
        for k in keys:
            for c in self.checks.get(k, ()):
                if c not in out:
                    out.append(c)
        return out

    def all(self) -> list[Check]:
        return self.for_(*self.checks)

    def lines(self) -> list[str]:
        return [f"{'ok  ' if c.ok else 'FAIL'}  {c}" for c in self.all()]

    def to_dict(self) -> list[dict[str, Any]]:
        return [{"key": str(k), **c.to_dict()} for k, cs in self.checks.items() for c in cs]


def rules_text(aa_tolerance: float = AA_TOLERANCE) -> str:
    """The checks and their thresholds in one paragraph, for a benchmark's report."""
    return (f"baseline checks (issue 16; a row whose check fails is {UNRELIABLE}, never PASS): threads: a "
            f"multi-thread baseline at most {1 + THREAD_SLACK:.2f}x its single-thread time; A/A: the same "
            f"configuration measured twice, interleaved, within {aa_tolerance:.0%}; foreign load: other processes "
            f"at most {FOREIGN_MAX_CORES:g} cores on average during a measurement (+{FOREIGN_SLACK_S:g} CPU s)")
