"""The distributed rows' decision: the fastest lane that fits the per-rank memory limit and trains what one
process trains; a mode only where it beats one process beyond the margin, and of modes within that margin
of the fastest, the one with the smallest per-rank peak. Each row gets its ``fits`` and ``verdict``.

It reads the result of :func:`torch_tricks.tuning.distributed.measure_modes` (rank 0's figures), in the tune's
process, once the ranks are done.
"""

from __future__ import annotations

import math
from typing import Any

from torch_tricks._format import human_bytes

__all__ = ["MODES", "ONE_PROCESS", "ONE_RANK", "recommend"]

MODES = ("ddp", "zero1", "fsdp")
ONE_PROCESS, ONE_RANK = "one process", "one rank"


def recommend(result: dict[str, Any], limit: int, *, local_ranks: int, min_effect: float = 0.02,
              drift_tolerance: float = 0.05) -> tuple[str | None, str]:
    """``(the recommended lane, why)``: the fastest that fits and does not drift; a mode only where it
    beats one process beyond the margin (``min_effect`` or the interval); of modes within that margin
    of the fastest, the smallest per-rank peak. Each row gets its ``fits`` and ``verdict``.

    The per-rank limit: ``limit`` on a device of its own (CUDA), ``limit / local_ranks`` where
    the ranks share the host's memory (CPU).
    """
    rows = result.get("rows") or []
    per_rank_limit = limit if result.get("device") == "cuda" else limit // max(local_ranks, 1)
    result["memory_limit_per_rank"] = per_rank_limit
    _mark_rows(rows, limit, per_rank_limit, drift_tolerance, min_effect)
    ok = [r for r in rows if _usable_mode(r, drift_tolerance)]
    one_fits = _timed_and_fits(_row_named(rows, ONE_PROCESS))
    if not ok:
        if one_fits:
            return ONE_PROCESS, "no distributed mode was measured that fits and trains the same: keep one process"
        return None, "nothing measured fits the memory limit: lower the batch or raise --memory-limit"
    return _pick_mode(ok, one_fits, min_effect)


def _mark_rows(rows: list[dict[str, Any]], limit: int, per_rank_limit: int, drift_tolerance: float,
               min_effect: float) -> None:
    """Each row's ``fits`` (one process and one rank against ``limit``, a mode against the per-rank limit)
    and ``verdict``."""
    for r in rows:
        r["fits"] = _fits(r, limit if r["name"] in (ONE_PROCESS, ONE_RANK) else per_rank_limit)
    for r in rows:
        if r["name"] in MODES:
            r["verdict"] = _verdict(r, drift_tolerance, min_effect)
    _mark_reference(_row_named(rows, ONE_PROCESS), "reference: the global batch in one process")
    _mark_reference(_row_named(rows, ONE_RANK), "reference: a rank's share of the batch, alone")


def _row_named(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["name"] == name), None)


def _fits(r: dict[str, Any], limit: int) -> bool | None:
    """Its peak is under ``limit`` (None: its memory was not measured)."""
    return None if r.get("peak_bytes") is None else r["peak_bytes"] <= limit


def _mark_reference(r: dict[str, Any] | None, verdict: str) -> None:
    """A reference row's verdict: what it is, where it was timed, else its status."""
    if r is not None:
        r["verdict"] = verdict if r.get("step_s") else r["status"]


def _usable_mode(r: dict[str, Any], drift_tolerance: float) -> bool:
    """A mode that was timed, fits the per-rank limit and trains the same as one process."""
    return bool(r["name"] in MODES and r.get("step_s") and r.get("fits") and _drift(r) <= drift_tolerance)


def _timed_and_fits(r: dict[str, Any] | None) -> bool:
    """A row that was timed and is not known to be over its memory limit."""
    return r is not None and bool(r.get("step_s")) and r.get("fits") is not False


def _drift(r: dict[str, Any]) -> float:
    return r.get("loss_drift") or 0.0


def _pick_mode(ok: list[dict[str, Any]], one_fits: bool, min_effect: float) -> tuple[str, str]:
    """Of the modes that fit and train the same (``ok``), the fastest, or the leanest within the margin of
    it; one process where none beats it beyond the margin (and it fits)."""
    fastest = min(ok, key=_time_key)
    margin = max(min_effect, fastest.get("vs_one_process_half_ci") or 0.0)
    pick = min(_within(ok, fastest, margin) or [fastest], key=_peak_key)
    lean = f" (within the margin of {fastest['name']}, the smallest per-rank peak)" if pick is not fastest else ""
    ratio = pick.get("vs_one_process")
    if one_fits and ratio is not None and ratio >= 1 - margin:
        return ONE_PROCESS, (f"no mode is faster than one process beyond the margin here; the fastest, "
                             f"{fastest['name']}, gives {_times(fastest)} the throughput of one process: keep one "
                             "process")
    if not one_fits:
        return pick["name"], (f"one process does not fit the memory limit; {pick['name']} fits "
                              f"({_mib(pick.get('peak_bytes'))} per rank) and is the fastest that does{lean}")
    return pick["name"], (f"{_times(pick)} the throughput of one process, {_mib(pick.get('peak_bytes'))} peak per "
                          f"rank{lean}")


def _time_key(r: dict[str, Any]) -> float:
    """Its step time against one process's where measured, else its step time."""
    return r["vs_one_process"] if r.get("vs_one_process") else r["step_s"]


def _peak_key(r: dict[str, Any]) -> float:
    return r.get("peak_bytes") or math.inf


def _within(ok: list[dict[str, Any]], fastest: dict[str, Any], margin: float) -> list[dict[str, Any]]:
    """The rows of ``ok`` whose time against one process is within ``margin`` of the fastest's."""
    if not fastest.get("vs_one_process"):
        return []
    limit = fastest["vs_one_process"] * (1 + margin)
    return [r for r in ok if r.get("vs_one_process") and r["vs_one_process"] <= limit]


def _times(r: dict[str, Any]) -> str:
    x, h = r.get("throughput_vs_one_process"), r.get("throughput_vs_one_process_half_ci")
    if x is None:
        return "n/a"
    return f"{x:.2f}x" + (f" (±{h:.2f})" if h is not None and math.isfinite(h) else "")


def _verdict(r: dict[str, Any], tol: float, min_effect: float) -> str:
    if r["status"] != "measured":
        return f"{r['status']}: {r.get('reason', '')}"
    if not r.get("step_s"):
        return "not timed"
    if _drift(r) > tol:
        return f"trains something else: its loss differs from one process's by {r['loss_drift']:.1%} (> {tol:.0%})"
    speed = _speed_word(r.get("vs_one_process"), max(min_effect, r.get("vs_one_process_half_ci") or 0.0))
    return speed + ("" if r.get("fits") is not False else ", over the per-rank memory limit")


def _speed_word(ratio: float | None, margin: float) -> str:
    """A step-time ratio against one process, in words, given the margin a change must exceed."""
    if not ratio:
        return "n/a"
    if ratio < 1 - margin:
        return "faster than one process"
    if ratio > 1 + margin:
        return "slower than one process"
    return "no measurable change against one process"


def _mib(n: float | None) -> str:
    return human_bytes(n) if n is not None else "n/a"

