"""The decisions of the tune: what is faster than plain beyond the margin, what fits under the memory limit,
and the recommendation for throughput (the joint race of the faster tricks' combinations where the plain step
fits; else the fastest way under the limit, plus the next trick while the pair beats it).

:class:`Decisions` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`): it reads the
report, the memory limit and the measured rows, and is taken again after more rounds (:meth:`Decisions._decide`).
"""

from __future__ import annotations

import math
from typing import Any

from torch_tricks._format import human_bytes
from torch_tricks.errors import UserError
from torch_tricks.train.config import TrainConfig
from torch_tricks.tuning.race import margin
from torch_tricks.tuning.result import Result

# Drift decides on the losses only: after the drift steps, the largest difference from the fp32
# losses of the same seed, relative to the first fp32 loss. Past this a trick changes the
# numbers too much to recommend it for speed (it catches broken numerics: overflow, a wrong
# accumulation; a non-finite loss always drifts). The first-step gradient difference is
# reported but does not decide: at initialisation a deep net's early-layer gradients are
# chaotic (ResNet-50, random batch: bf16 autocast alone gives a relative difference of 1.3,
# cosine 0.13, while its losses after 3 steps stay within 0.5% of the first fp32 loss).
DRIFT_TOLERANCE = {"loss": 0.05}
# Effects smaller than this are not called faster/slower even when the A/A noise is smaller.
MIN_EFFECT = 0.02


class Decisions:
    """What is faster, each row's verdict, and the greedy combination for throughput (``report.best_throughput``).

    Reads ``report``, ``limit``, ``train_end`` and the reserves; notes its choices in ``choice_notes``; the
    combinations it measured are kept in ``_combos`` (reused when decided again).
    """

    def _best_throughput(self) -> None:
        """Where the plain step fits: the faster speed tricks and their combinations, raced jointly
        (:mod:`~torch_tricks.tuning.combine`). Where it does not: the fastest way under the limit, plus the
        next fastest trick while the pair beats it beyond the noise.

        Taken again after more rounds (see :meth:`_decide`): a combination or a configuration
        measured already is reused, not measured twice.
        """
        report = self.report
        base = report.baseline
        report.best_throughput = base
        plain_fits = self._fits(base)
        good = self._faster_speed_tricks(plain_fits)
        end = self.train_end - self.compile_reserve - self.memory_reserve  # the memory tricks' run comes next
        if not plain_fits:
            self.choice_notes.append(
                f"the plain step needs {_gib(base.peak_bytes)} at batch {report.batch}, over the memory limit "
                f"{_gib(self.limit)}: looking for a configuration that fits")
            current = self._make_it_fit(end)
            if current is None:
                return
            report.fits_with = current.name
            good = [r for r in good if not (set(r.changes) & set(current.changes))]
            report.best_throughput = current
            self._add_while_faster(current, good, end)
        else:  # every compatible combination of the faster tricks, raced jointly (tuning.combine)
            report.best_throughput = self._joint_best(good, end)
        if report.best_throughput is not base:
            report.best_throughput.chosen = True

    def _faster_speed_tricks(self, plain_fits: bool) -> list[Result]:
        """The speed tricks faster than plain, fastest first: those that fit; when plain does not fit, also
        those that do not fit alone (on top of a configuration that fits they may, and every combination's
        memory is measured). Not compile: it comes last, on top (and its memory is not measured)."""
        good = [r for r in self.report.results if r.goal == "speed" and self._faster(r)
                and (self._fits(r) or not plain_fits) and not r.changes.get("compile")]
        good.sort(key=lambda r: r.ratio)
        return good

    def _add_while_faster(self, current: Result, good: list[Result], end: float) -> None:
        """Each next trick on top of ``current``, kept (as the best) where the pair beats it beyond the noise."""
        for k, nxt in enumerate(good):
            if set(nxt.changes) & set(current.changes) or not _valid_together({**current.changes, **nxt.changes}):
                continue
            combo = self._combination(current, nxt, good[k:], end)
            if combo is not None and self._beats_what_it_extends(combo):
                current = combo
                self.report.best_throughput = current

    def _combination(self, current: Result, nxt: Result, rest: list[Result], end: float) -> Result | None:
        """``current`` with ``nxt`` on top, measured once (reused when decided again); None when over budget.
        It gets its share of the time left among ``rest``, the tricks still to try on top of ``current``."""
        key = (_key({**current.changes, **nxt.changes}), current.name)
        combo = self._combos.get(key)
        if combo is not None:
            return combo
        if self.left(end) < self._combo_need():
            self.choice_notes.append(f"combination of {current.name} with {nxt.name} not tried: over --budget-seconds")
            return None
        n = sum(1 for r in rest if not set(r.changes) & set(current.changes))
        combo = self._measure_combo(current, nxt, end, share=1.0 / max(n, 1))
        self._combos[key] = combo
        self.report.combos.append(combo)
        return combo

    def _beats_what_it_extends(self, combo: Result) -> bool:
        return (combo.status == "measured" and self._fits(combo) and combo.vs_current is not None
                and combo.vs_current < 1 - self._margin(combo.vs_current_half_ci) and _drift_ok(combo))

    def _decide(self) -> None:
        """Every decision again, from the races as they stand now (measured combinations are reused)."""
        report = self.report
        for r in report.results + report.combos:
            r.chosen = False
        self.choice_notes = []
        self._best_throughput()
        self._compile_decide()

    def _fits(self, r: Result) -> bool:
        """Measured under the limit; or, not measured yet, a speed trick where the limit is far above the plain
        step (its memory run waits: :mod:`~torch_tricks.tuning.contenders`)."""
        if r.peak_bytes is None:
            return self.memory_later and r.goal == "speed"
        return r.peak_bytes <= self.limit

    def _faster(self, res: Result) -> bool:
        return (res.status == "measured" and res.ratio is not None and not math.isnan(res.ratio) and _drift_ok(res)
                and res.ratio < 1 - self._margin(res.ratio_half_ci))

    def _margin(self, half_ci: float | None) -> float:
        return margin(self.report.noise, half_ci, MIN_EFFECT)

    def _verdict(self, res: Result) -> str:
        speed = self._speed_verdict(res)
        if res.peak_bytes is not None and res.peak_bytes > self.limit:
            return f"{speed}, over the memory limit"
        return speed

    def _speed_verdict(self, res: Result) -> str:
        """Its speed against plain, in a word or two (a drifting loss first: its speed does not count)."""
        if not _drift_ok(res):
            return "drifts"
        if res.ratio is None or math.isnan(res.ratio):
            return "not timed"
        if res.ratio < 1 - self._margin(res.ratio_half_ci):
            return "faster"
        if res.ratio > 1 + self._margin(res.ratio_half_ci):
            return "slower"
        return "no measurable change"


def _drift_ok(res: Result) -> bool:
    return res.loss_drift is None or res.loss_drift <= DRIFT_TOLERANCE["loss"]


def _compatible(rows: list[Result]) -> tuple[list[Result], dict[str, Any]]:
    """Each of ``rows`` in turn that sets no switch an earlier one set, and their changes together."""
    changes: dict[str, Any] = {}
    chosen: list[Result] = []
    for r in rows:
        if not set(r.changes) & set(changes) and _valid_together({**changes, **r.changes}):
            changes.update(r.changes)
            chosen.append(r)
    return chosen, changes


def _valid_together(changes: dict[str, Any]) -> bool:
    """The switches can be on together (``optimizer_in_backward`` with ``accumulate`` cannot, for one)."""
    try:
        TrainConfig().replace(**changes).validate()
    except UserError:
        return False
    return True


def _key(changes: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in changes.items()))


def _gib(n: float | None) -> str:
    return human_bytes(n) if n is not None else "n/a"

