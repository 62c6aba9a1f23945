"""The largest batch (and with ``--fit seq`` the longest sequence) under the memory limit, each run: the
memory tricks together, then a search of real steps at growing, then bisected sizes, within a share of the
time left.

:class:`MemorySearch` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from torch_tricks import batches as B
from torch_tricks.device import is_oom
from torch_tricks.errors import one_line
from torch_tricks.tuning import fit as fit_mod
from torch_tricks.tuning.decide import _compatible, _drift_ok
from torch_tricks.tuning.result import Result

_MEMORY_RUN_MARGIN = 1.5  # a combination's memory run, in plain's memory runs (more switches, a little more)
# The search for the largest batch under the memory limit (per configuration searched: the largest-batch one and plain).
_BATCH_PROBES = 6
_BATCH_SEARCH_SHARE = 0.25


class MemorySearch:
    """``report.best_batch`` and each searched row's ``max_batch`` (``max_seq``), from runs under ``limit``."""

    def _largest_batch(self) -> None:
        """All memory tricks that cut bytes per sample (drift within tolerance), together."""
        report = self.report
        base = report.baseline
        if base.bytes_per_sample is None:
            return
        mem = [r for r in report.results if _cuts_bytes_per_sample(r, base)]
        best = max([base] + mem, key=_max_batch)
        chosen, changes = _compatible(sorted(mem, key=lambda r: r.bytes_per_sample))
        if len(chosen) >= 2:
            together = self._memory_tricks_together(chosen, changes)
            if together is not None and _max_batch(together) > _max_batch(best):
                best = together
        report.best_batch = best
        if report.memory_limit_source != "given" and torch.device(self.base_cfg["device"]).type != "cuda":
            report.notes.append("largest batch: not searched (the limit is this host's RAM, not one you gave): give "
                                "--memory-limit to have it run")
            return
        for r in ([best, base] if best is not base else [base]):
            self._search_largest_batch(r)

    def _memory_tricks_together(self, chosen: list[Result], changes: dict[str, Any]) -> Result | None:
        """The memory of ``chosen`` together (``changes``): measured already while looking for a fit, else
        measured now (memory only) if the time left holds it; None when it failed or did not fit the budget."""
        report = self.report
        same = self._measured_for_memory(changes)
        if same is not None:
            return same
        if time.perf_counter() + _MEMORY_RUN_MARGIN * self.memory_s >= self.train_end - self.compile_reserve:
            report.notes.append("memory tricks not combined for the largest batch: over --budget-seconds")
            return None
        combo = Result("+".join(sorted(r.name for r in chosen)), "memory", changes, _all_ids(chosen))
        try:
            self._memory_into(combo, {**self.base_cfg, **changes})
        except Exception as exc:
            combo.status, combo.verdict, combo.reason = "failed", "failed", one_line(exc, with_type=True)
            report.combos.append(combo)
            return None
        combo.status, combo.verdict = "measured (memory)", "memory only: not timed"
        report.combos.append(combo)
        return combo

    def _measured_for_memory(self, changes: dict[str, Any]) -> Result | None:
        """The combination of exactly ``changes`` measured already, with its largest batch (None: none)."""
        return next((r for r in self.report.combos if r.changes == changes and r.max_batch_guess is not None), None)

    def _longest_seq(self) -> None:
        """``--fit seq``: the longest sequence under the limit for plain, for the recommendation and for the
        memory tricks together (the largest-batch configuration: what a long context needs), each run."""
        report = self.report
        rows: list[Result] = []
        for r in (report.baseline, report.best_throughput, report.best_batch):
            if r is not None and all(r is not x for x in rows):
                rows.append(r)
        for i, r in enumerate(rows):  # asked for: together most of the time left, in equal parts
            self._search_longest_seq(r, share=0.6 / (len(rows) - i))
        report.seq_positions = fit_mod.max_positions(self.model)

    def _search_largest_batch(self, res: Result) -> None:
        """``res``'s largest batch under the limit, run (:meth:`_search_largest`, the example batch tiled)."""
        n0 = B.batch_size(self.batches[0])
        res.max_batch, res.max_batch_bound = self._search_largest(
            res, n0, res.max_batch_guess or 2 * n0, lambda b: fit_mod.tiled(self.batches[0], b))

    def _search_longest_seq(self, res: Result, share: float) -> None:
        """``res``'s longest sequence under the limit, run (:meth:`_search_largest`, the ids tiled along the
        sequence), up to the model's positions, within ``share`` of the time left."""
        t0 = fit_mod.sequence_length(self.batches[0])
        res.max_seq, res.max_seq_bound = self._search_largest(
            res, t0, 2 * t0, lambda t: fit_mod.with_sequence_length(self.batches[0], t),
            cap=fit_mod.max_positions(self.model), share=share)

    def _search_largest(self, res: Result, n0: int, guess: int, resize: Callable[[int], Any],
                        cap: int | None = None, share: float = _BATCH_SEARCH_SHARE) -> tuple[int | None, int | None]:
        """(the largest size that ran under the limit, the smallest that did not) for ``res``'s configuration:
        steps at growing, then bisected sizes (``resize(n)`` the example batch at size n; ``n0`` its own size),
        each a fresh copy's build + two steps with its peak measured, until the boundary is known within 5%,
        ``_BATCH_PROBES`` runs were made, ``cap`` was reached, or the next would not end within
        ``share`` of the budget left (a step's time grows with the size): then the largest is "at least" the
        last that fit, and the report says larger was not run."""
        cfg = {**self.base_cfg, **res.changes}
        fits0 = res.peak_bytes is not None and res.peak_bytes <= self.limit
        lo, hi = (n0, None) if fits0 else (0, n0)
        guess = max(guess, n0 + 1) if fits0 else min(max(guess, 1), max(n0 - 1, 1))
        # a run at size b: about b / n0 times plain's memory run (the fixed part makes it an overestimate)
        per_unit_s = (self.memory_s or res.step_s or self.report.baseline.step_s or 0.0) / max(n0, 1)
        until = time.perf_counter() + share * max(self.left(self.train_end - self.compile_reserve), 0)
        for _ in range(_BATCH_PROBES):
            b = _next_size(lo, hi, guess, cap)
            b = min(b, self._affordable_batch(per_unit_s, until)) if b else 0
            if b <= lo or (hi is not None and b >= hi):
                break
            fits = self._fits_at(cfg, resize(b))
            if fits is None:
                break
            lo, hi, guess = (b, hi, 2 * b) if fits else (lo, b, max(b // 2, 1))
        return lo or None, hi

    def _fits_at(self, cfg: dict[str, Any], batch: Any) -> bool | None:
        """Whether a memory run of ``cfg`` on ``batch`` peaks under the limit; an out-of-memory error is a no,
        any other (the model refuses the size) None: the search stops there."""
        try:
            return self._memory_run(cfg, batch, per_sample=False).peak_bytes <= self.limit
        except Exception as exc:
            return False if is_oom(exc) else None

    def _affordable_batch(self, per_sample_s: float, until: float) -> int:
        """The largest batch whose memory run (a build and a few steps) takes at most half the time to ``until``.

        Scaled from plain's memory run, not from the set-up, which carries one-time costs (on an H200 the
        set-up of GPT-2's tune took 24 s, CUDA's and cuBLAS's start in it, and no larger batch was ever run)."""
        left = until - time.perf_counter()
        if per_sample_s <= 0:
            return 1 << 30
        return max(int(left / 2 / per_sample_s), 0)


def _cuts_bytes_per_sample(r: Result, base: Result) -> bool:
    """``r`` was measured, cuts the plain step's bytes per sample by 5% or more, and does not drift."""
    return (r.status == "measured" and r.bytes_per_sample is not None and r.max_batch_guess is not None
            and r.bytes_per_sample < base.bytes_per_sample * 0.95 and _drift_ok(r))


def _max_batch(r: Result) -> int:
    """Its largest batch: run where searched, else the straight line (to choose which to search)."""
    return r.max_batch or r.max_batch_guess or 0


def _all_ids(rows: list[Result]) -> tuple[str, ...]:
    return tuple(sorted({i for r in rows for i in r.ids}))


def _next_size(lo: int, hi: int | None, guess: int, cap: int | None) -> int:
    """The next size a search runs: ``guess`` while no size failed, then bisection; 0 when the boundary is
    known within 5% or ``cap`` was reached."""
    if (hi is not None and hi - lo <= max(1, lo // 20)) or (cap is not None and lo >= cap):
        return 0
    b = guess if hi is None else (lo + hi) // 2 if lo else min(guess, hi - 1)
    return min(b, cap) if cap else b

