"""Contenders first: the set-up builds what can win the question asked before anything else.

The question is speed unless memory is asked for (the plain step does not fit, a memory limit was given, or
``--fit``). For speed, only the speed tricks can be the answer: they are built, probed and raced first, then
combined and compiled; the memory and cost tricks (timed for their cost only while the plain step fits) follow
in a short race of their own once the speed question is settled, or are named with the seconds they would need.
Where the limit is far above the plain step (a CPU's RAM, no limit given), the speed tricks' memory runs wait
too, until after compile (the recommendation's first): until measured, a speed trick is taken to fit.
On the README's ResNet-18 the memory and cost tricks' set-up was half of the set-up's 63 s, spent before a
single speed trick was combined (and compile was left out for the budget).

:class:`Contenders` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`).
"""

from __future__ import annotations

import math
import time

from torch_tricks._format import human_bytes
from torch_tricks.tuning.candidates import Candidate
from torch_tricks.tuning.decide import MIN_EFFECT
from torch_tricks.tuning.race import Lane, Race
from torch_tricks.tuning.racing import _MAX_SIDE_ROUNDS, _MIN_ROUNDS, _median
from torch_tricks.tuning.result import Result
from torch_tricks.tuning.search_memory import _MEMORY_RUN_MARGIN


# "Far": the limit holds this many plain steps' peaks (on a CPU without --memory-limit: 80% of the RAM).
_FAR = 4


class Contenders:
    """The split of the candidates (``_contenders_first``) and the later race of the others (``later``,
    its rows ``later_res``)."""

    def _contenders_first(self, others: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
        """(what is set up first, what follows the speed question): all first where memory is asked for."""
        report = self.report
        memory_asked = (not self._fits(report.baseline) or report.memory_limit_source == "given"
                        or self.fit is not None)
        if memory_asked:
            return others, []
        # a limit far above the plain step (the host's RAM): a speed trick's memory run waits too
        self.memory_later = report.baseline.peak_bytes * _FAR <= self.limit
        return [c for c in others if c.goal == "speed"], [c for c in others if c.goal != "speed"]

    def _later_phase(self, later: list[Candidate], rows: list[Result]) -> None:
        """The memory and cost tricks after the speed question: each set up while the time left holds it and
        its least timing, then timed for their cost in one short race with plain."""
        t = time.perf_counter()
        self._speed_tricks_memory()
        if not later:
            self.phase_s["memory and cost tricks"] = time.perf_counter() - t
            return
        built: list[Result] = []
        for c, res in zip(later, rows):
            self.phase(c.name)
            self._set_up_in_turn(res, c, self.train_end, len(built))
            if res.runner is not None:
                built.append(res)
            self.bar.update(1)
        self._say_what_later_needs(rows)
        if built:
            self.phase("their race")
            self._race_later(built)
        self.phase_s["memory and cost tricks"] = time.perf_counter() - t

    def _speed_tricks_memory(self) -> None:
        """The speed tricks' memory runs, where they waited (the recommendation's first), while the time holds."""
        if not self.memory_later:
            return
        best = self.report.best_throughput
        rows = [r for r in self.report.results + self.report.combos if r.goal == "speed" and r.peak_bytes is None
                and r.status == "measured" and not r.changes.get("compile")]
        rows.sort(key=lambda r: r is not best)
        for r in rows:
            if time.perf_counter() + _MEMORY_RUN_MARGIN * self.memory_s > self.train_end:
                r.note = _join(r.note, f"memory not measured (over --budget-seconds): the limit is far, the plain "
                                       f"step peaks at {human_bytes(self.report.baseline.peak_bytes)} of "
                                       f"{human_bytes(self.limit)}")
                continue
            self.phase(f"memory: {r.name}")
            self._memory_into(r, {**self.base_cfg, **r.changes})
            r.verdict = self._verdict(r) if r.ratio is not None else r.verdict

    def _race_later(self, built: list[Result]) -> None:
        """``built`` with plain, each timed for its cost only (they leave after the least rounds): as many as
        the least rounds of their own steps (a memory trick's can be twice plain's) fit in the time left; the
        others keep their memory figures, not timed."""
        built = self._fit_later_lanes(built)
        if not built:
            return
        lanes = [Lane("plain", self.base, role="baseline")]
        lanes += [Lane(r.name, r.runner, contender=False, why_not=self._not_a_contender(r, True)) for r in built]
        self.later = Race(lanes, noise=self._noise, min_effect=MIN_EFFECT, min_rounds=_MIN_ROUNDS,
                          settle_rounds=_MIN_ROUNDS, max_rounds=_MAX_SIDE_ROUNDS,
                          seed=int(self.base_cfg.get("seed", 0)), sync=self._sync)
        self.later_res = built
        self.later.run(self.train_end)
        self._read_rows(self.later, built, self.later.lanes[1:])

    def _fit_later_lanes(self, built: list[Result]) -> list[Result]:
        """The rows of ``built`` whose least rounds (and a warm-up) fit in the time left, in order; the others
        are said not timed, for the budget."""
        left = self.left()
        need = (_MIN_ROUNDS + 1) * self.step_s  # plain's lane
        out = []
        for r in built:
            step = _median(r.runner.step_times) if r.runner.step_times else self.step_s
            if need + (_MIN_ROUNDS + 1) * step <= left:
                need += (_MIN_ROUNDS + 1) * step
                out.append(r)
                continue
            r.runner, r.verdict = None, "not timed"
            r.reason = (f"not timed: over --budget-seconds (its {_MIN_ROUNDS} rounds beside plain's did not fit in "
                        f"the {max(left, 0):.0f} s left); its memory is measured")
        return out

    def _say_what_later_needs(self, rows: list[Result]) -> None:
        """A row the budget left out says it came after the speed tricks, and about what budget would do it."""
        left_out = [r for r in rows if r.status == "skipped" and "budget" in r.reason]
        if not left_out:
            return
        need = len(left_out) * 1.2 * self.setup_s + self._race_need(len(left_out) + 1, _MIN_ROUNDS)
        more = math.ceil(need / 10.0) * 10
        for r in left_out:
            r.reason = (f"over --budget-seconds: a {r.goal} trick, measured after the speed tricks, and the time "
                        f"left did not hold its set-up; about {more} s more (--budget-seconds "
                        f"{math.ceil(self.report.budget_s + more)}) would measure it")


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more
