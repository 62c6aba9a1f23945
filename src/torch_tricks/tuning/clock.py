"""The tune's clock: its budget and how it is paced. The time left to the training phases' end, each phase's
wall seconds, what a race or a combination needs, what is kept back from the race, and the stop after the
plain step when the budget cannot hold even one trick's measurement.

:class:`Clock` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`): ``deadline``,
``train_end`` (the deadline less the fixed shares of the distributed rows, data and deploy), ``t0``,
``phase_s``, and the reserves (compile's, the memory tricks', the MFU figures').
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

from torch_tricks.tuning.candidates import Candidate
from torch_tricks.tuning.decide import _compatible
from torch_tricks.tuning.measure import Runner
from torch_tricks.tuning.race import Lane
from torch_tricks.tuning.racing import _MIN_ROUNDS, _SIDE_SETTLE_ROUNDS, _median
from torch_tricks.tuning.result import Result
from torch_tricks.tuning.search_memory import _MEMORY_RUN_MARGIN, _cuts_bytes_per_sample


# --fit seq: memory runs kept back for the longest sequence (two rows, three runs each, at about twice the length)
_SEQ_RUNS_KEPT = 12


class Clock:
    """The time left, the phases' seconds, and the pacing rules (what fits in the time left)."""

    def left(self, until: float | None = None) -> float:
        return (self.train_end if until is None else until) - time.perf_counter()

    def phase(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=True)

    def _timed_phase(self, label: str, key: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``measure()`` as the phase ``label``, its wall seconds under ``key`` of the report's phase_s."""
        t = time.perf_counter()
        self.phase(label)
        out = measure()
        self.phase_s[key] = time.perf_counter() - t
        self.bar.update(1)
        return out

    def _race_need(self, lanes: int, rounds: int) -> float:
        """Seconds for ``rounds`` rounds (and a warm-up) of ``lanes`` plain-sized steps."""
        return (rounds + 1) * lanes * self.step_s

    def _combo_need(self) -> float:
        """Seconds one combination takes at least: its build, then a short race with plain and its two parts."""
        return 1.2 * self.build_s + self._race_need(4, _SIDE_SETTLE_ROUNDS)

    def _kept_from_the_race(self, lanes: list[Lane]) -> float:
        """Seconds kept back from the race of the single tricks: compile's, one combination's where two
        contenders could make one, and the memory tricks' together (one memory run: the largest batch's
        configuration) where two of them cut the bytes per sample; with ``--fit seq``, the longest sequence's
        runs too (the answer asked for: a race of two near-equal lanes ran a 40 s tune to its end and left the
        search no time)."""
        contenders = sum(1 for lane in lanes[2:] if lane.contender)
        base = self.report.baseline
        cutters = [r for r in self.singles_res if base.bytes_per_sample and _cuts_bytes_per_sample(r, base)]
        self.memory_reserve = _MEMORY_RUN_MARGIN * self.memory_s if len(_compatible(cutters)[0]) >= 2 else 0.0
        if self.fit is not None and self.fit.search_seq:
            self.memory_reserve += min(_SEQ_RUNS_KEPT * self.memory_s, 0.3 * self.report.budget_s)
        return (self.compile_reserve + (self._combo_need() if contenders >= 2 else 0.0)) + self.memory_reserve

    def _too_slow_for_the_budget(self, base: Runner, build_s: float, base_res: Result, cands: list[Candidate]) -> bool:
        """Stop after the plain step when the budget cannot hold even one trick's measurement.

        What the least tune costs is known once the plain step is built: the A/A twin and
        the memory measurement (about one build each), one trick's build, and the least race
        of three lanes. A step of seconds (BERT-base at batch 32 on two cores: 8 s) would
        otherwise run the set-up for minutes past the budget and measure nothing; this says
        at once what budget or batch would do, with the plain step's time measured. Only a
        budget under half the estimate stops it: the estimate comes from the first steps.
        """
        step_s = max(_median(base.step_times) if base.step_times else build_s, 1e-4)
        need = 3.0 * build_s + (_MIN_ROUNDS + 1) * 3 * step_s
        spent = time.perf_counter() - self.t0
        if self.left() >= need / 2:  # the first steps can take twice the steady ones (warm-up, a busy machine)
            return False
        report = self.report
        base_res.step_s = step_s
        report.baseline = report.best_throughput = base_res  # the recommendation: the plain step
        suggest = math.ceil((spent + need) / 10.0) * 10
        smaller = max(1, int(report.batch * self.left() / need)) if report.batch > 1 else 1
        why = (f"one plain step takes {step_s:.1f} s here: measuring even one trick needs about {need:.0f} s more "
               f"(the A/A twin, memory, one trick's set-up, {_MIN_ROUNDS} rounds); raise --budget-seconds to about "
               f"{suggest}" + (f" or lower --batch (to about {smaller})" if smaller < report.batch else ""))
        report.results = [Result(c.name, c.goal, c.changes, c.ids, note=c.note, status="skipped", verdict="skipped",
                                 reason="over --budget-seconds before it could be measured: " + why.split(": ", 1)[1])
                          for c in cands]
        report.stop_reason = "budget: " + why
        report.notes.append("only the plain step was measured: " + why)
        self.phase_s["set-up"] = time.perf_counter() - self.t0
        self.base = None
        return True

