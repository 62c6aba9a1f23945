"""T36, the batch of the most samples a second: the recommendation timed at larger micro-batches that run under
the memory limit, side by side with the batch tuned, and a larger one recommended only where it gives more
samples a second beyond the margin, with what it does to the effective batch said.

Two cases, because a trainer's result depends on the effective batch (micro-batch x accumulation):

* the recommendation accumulates (``accumulate = k``: the batch tuned is split in k micro-batches): a larger
  micro-batch with fewer accumulation steps keeps the effective batch exactly, so where it is faster it is
  written (``accumulate`` and the loader's ``batch_size``);
* it does not: a larger batch is a larger effective batch, which changes the optimisation (the linear rule, T21:
  the lr scaled with the batch, is the usual correction). It is measured and reported with that rule stated, and
  not written into ``[train]``: the batch is yours to change (tricks.toml says it in a comment).

Each size is run once for its memory (the peak must be under the limit: a batch said to fit was run), then all
are timed interleaved with the batch tuned, in one race, for a share of the time left. A compiled recommendation
is timed without compile (a new batch size compiles again): the row says so.
"""

from __future__ import annotations

import time
from typing import Any

from torch_tricks.errors import one_line
from torch_tricks.tuning import fit as fit_mod
from torch_tricks.tuning.measure import build_runner, paired_ratio
from torch_tricks.tuning.race import Lane, Race
from torch_tricks.tuning.decide import MIN_EFFECT
from torch_tricks.tuning.result import Result

_SIZES = 2  # the larger sizes timed: the two largest of x2, x4 (or the fewer accumulation steps) that fit
_ROUNDS = 12  # the interleaved rounds wanted (at least 5 are run, else the sizes are not timed)
_SHARE = 0.15  # of the time left to the training phases


class ThroughputBatch:
    """``report.throughput_batch``: samples a second at larger micro-batches of the recommendation."""

    def _throughput_batch_phase(self) -> None:
        """7. The recommendation at larger micro-batches under the limit, timed beside the batch tuned (T36)."""
        t = time.perf_counter()
        self.phase("throughput batch")
        try:
            self.report.throughput_batch = self._throughput_batch()
        except Exception as exc:  # measuring more is never worth losing the tune's answer
            self.report.throughput_batch = {"status": "failed", "reason": one_line(exc, with_type=True)}
        self.phase_s["throughput batch"] = time.perf_counter() - t

    def _throughput_batch(self) -> dict[str, Any]:
        ref, note = self._eager_recommendation()
        if ref is None or ref.runner is None:
            return {"status": "skipped", "reason": "the recommendation's step is not built any more"}
        n0 = self.report.batch
        acc = int(ref.changes.get("accumulate", self.base_cfg.get("accumulate", 1)) or 1)
        until = time.perf_counter() + _SHARE * max(self.left(), 0.0)
        sizes = self._sizes_that_fit(ref, n0, acc, until)
        out: dict[str, Any] = {"measured_on": ref.name, "note": note, "batch": n0, "accumulate": acc,
                               "keeps_effective_batch": acc > 1}
        if not sizes:
            return {**out, "status": "skipped", "reason": self._no_size_reason(n0, acc)}
        rows = self._time_sizes(ref, sizes, n0, acc, until)
        if rows is None:
            return {**out, "status": "skipped", "reason": "over --budget-seconds: no time left to time the larger "
                                                         "batches side by side: raise it"}
        return {**out, "status": "measured", "rows": rows, **self._batch_choice(rows, n0, acc)}

    def _eager_recommendation(self) -> tuple[Result | None, str]:
        """The recommendation's row, or with compile the row it extends (its runner is eager), and a note."""
        best = self.report.best_throughput or self.report.baseline
        if best is not None and best.changes.get("compile"):
            base = self.compile_base or self.report.baseline
            return base, "without compile: a new batch size compiles again"
        return best, ""

    def _sizes_that_fit(self, ref: Result, n0: int, acc: int, until: float) -> list[tuple[int, int, int]]:
        """[(micro-batch, accumulate, batch)] larger than the tuned micro-batch, each run under the limit."""
        cfg = {**self.base_cfg, **ref.changes}
        per_sample_s = (self.memory_s or ref.step_s or 0.0) / max(n0 // acc, 1)
        fits: list[tuple[int, int, int]] = []
        for m, k, b in _size_tries(n0, acc):
            if ref.max_batch is not None and m > ref.max_batch and acc == 1:
                break  # the largest-batch search ran it and it did not fit
            if time.perf_counter() + 2 * per_sample_s * m > until:
                break
            ok = self._fits_at({**cfg, "accumulate": k}, fit_mod.tiled(self.batches[0], b))
            if not ok:
                break
            fits.append((m, k, b))
        return fits

    def _no_size_reason(self, n0: int, acc: int) -> str:
        if acc > 1:
            return f"no micro-batch larger than {n0 // acc} with fewer accumulation steps ran under the limit in time"
        return f"batch {2 * n0} did not run under the memory limit, or not within the time left"

    def _time_sizes(self, ref: Result, sizes: list[tuple[int, int, int]], n0: int, acc: int,
                    until: float) -> list[dict[str, Any]] | None:
        """Each size's runner built, then all timed interleaved with ``ref`` at the tuned batch."""
        cfg = {**self.base_cfg, **ref.changes}
        lanes = [Lane(f"batch {n0}", ref.runner, role="baseline")]
        for m, k, b in sizes:
            batches = [fit_mod.tiled(x, b) for x in self.batches]
            r = build_runner(f"{ref.name} at {m} x {k}", self.model, {**cfg, "accumulate": k}, batches, probe=False,
                             drift_steps=1, **self.kw)
            lanes.append(Lane(f"micro-batch {m} x {k}", r, contender=False, why_not="timed for its samples a second"))
        rounds = _ROUNDS
        need = sum(b / n0 for _, _, b in sizes) * self.step_s + self.step_s
        if time.perf_counter() + 5 * need > until:
            return None
        race = Race(lanes, noise=self._noise, min_effect=MIN_EFFECT, min_rounds=rounds, settle_rounds=rounds,
                    max_rounds=rounds, seed=int(self.base_cfg.get("seed", 0)), sync=self._sync)
        race.run(until)
        base = lanes[0].times
        rows = [_row(n0 // acc, acc, n0, base, base)]
        for (m, k, b), lane in zip(sizes, lanes[1:]):
            if lane.error or len(lane.times) < 3:
                rows.append({"micro_batch": m, "accumulate": k, "batch": b, "error": lane.error or "not timed"})
                continue
            rows.append(_row(m, k, b, lane.times, base[:len(lane.times)], n0))
        return rows

    def _batch_choice(self, rows: list[dict[str, Any]], n0: int, acc: int) -> dict[str, Any]:
        """The size with the most samples a second beyond the margin (else the tuned one), and what it means."""
        timed = [r for r in rows[1:] if "samples_vs_tuned" in r]
        wins = [r for r in timed if r["samples_vs_tuned"] > 1 / (1 - self._margin(r["half_ci"]))]
        if not wins:
            return {"choice": None, "reason": f"no larger micro-batch gave more samples a second than {n0 // acc} "
                                              "beyond the margin"}
        best = max(wins, key=lambda r: r["samples_vs_tuned"])
        gain = f"{best['samples_vs_tuned']:.2f}x the samples a second of the batch tuned"
        if acc > 1:
            return {"choice": best, "written": True,
                    "reason": f"micro-batch {best['micro_batch']} x {best['accumulate']} accumulation steps: {gain}, "
                              f"the effective batch {n0} kept"}
        factor = best["batch"] // n0
        return {"choice": best, "written": False,
                "reason": f"batch {best['batch']}: {gain}; it is a {factor}x larger effective batch, which changes "
                          f"the training: scale the lr {factor}x with it (linear rule, T21: scale_lr = true, "
                          f"base_batch = {n0}) or keep {n0}; not written to [train] (the batch is yours to change)"}


def _size_tries(n0: int, acc: int) -> list[tuple[int, int, int]]:
    """[(micro-batch, accumulate, batch)] to try: fewer accumulation steps of the same effective batch where it
    accumulates, else the batch x2 and x4."""
    if acc > 1:
        return [(n0 // k, k, n0) for k in range(acc - 1, 0, -1) if n0 % k == 0][:_SIZES]
    micro = max(n0 // acc, 1)
    return [(micro * f, 1, n0 * f) for f in (2, 4)][:_SIZES]


def _row(m: int, k: int, b: int, times: list[float], base: list[float], n0: int | None = None) -> dict[str, Any]:
    """One size's figures: its median step, samples a second, and samples a second against the tuned batch."""
    step = sorted(times)[len(times) // 2]
    row = {"micro_batch": m, "accumulate": k, "batch": b, "step_s": step, "samples_per_s": b / step,
           "rounds": len(times)}
    if n0 is not None:  # per sample: (t_b / b) / (t_n0 / n0), paired round by round
        ratio, half = paired_ratio(times, base)
        per_sample = ratio * n0 / b
        row["samples_vs_tuned"], row["half_ci"] = 1 / per_sample, half
    return row
