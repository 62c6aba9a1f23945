"""The speed tricks that beat plain, combined jointly: every compatible combination of them raced at once.

Greedy pairs (the fastest trick, then the next on top while the pair wins) stop at the first pair that does
not settle in its share of the time, and never see a pair that only wins together: on ResNet-18 it left
bf16 + fused AdamW (1.47x) for bf16 alone (1.33x). Here the faster tricks (at most ``_POOL``, fastest first)
and every compatible combination of them, built in the order their single speeds predict, are raced in one
round-robin race with plain: a racing search (an F-race, successive halving's sequential cousin), in which a
configuration that is slower than the best beyond the interval leaves and the rounds go to the others.

The pick is the fastest configuration measured faster than plain beyond the margin, made simpler while a
measured subset of it is as fast within the margin: every trick in the pick was shown to add speed on top of
the others, and a trick left out was shown (by a combination measured here) to add none. What the budget did
not let it build is said, with the seconds it would need.

:class:`Combining` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

from torch_tricks.errors import one_line
from torch_tricks.tuning.builds import _drift_into
from torch_tricks.tuning.decide import MIN_EFFECT, _drift_ok, _valid_together
from torch_tricks.tuning.measure import build_runner
from torch_tricks.tuning.race import Lane, Race
from torch_tricks.tuning.racing import _MAX_SIDE_ROUNDS, _MIN_ROUNDS, _SIDE_SETTLE_ROUNDS, _median
from torch_tricks.tuning.result import Result
from torch_tricks.tuning.search_memory import _MEMORY_RUN_MARGIN

# The faster tricks combined (the fastest first): 4 give at most 11 combinations.
_POOL = 4


class Combining:
    """The joint race (``joint``: its race; ``joint_rows``: its rows in lane order after plain) and the pick."""

    joint: Race | None = None
    joint_tried = False  # once: decided again after more rounds, no joint race is started that late
    joint_rows: list[Result]
    joint_not_built: list[str]

    def _joint_best(self, good: list[Result], end: float) -> Result:
        """The recommendation for throughput among ``good`` (the speed tricks faster than plain, fastest first)
        and their combinations, raced jointly (once; read again after more rounds)."""
        first, self.joint_tried = not self.joint_tried, True
        if len(good) < 2:
            return good[0] if good else self.report.baseline
        # decided again after more rounds, no joint race starts that late
        if self.joint is None and (not first or not self._run_joint(good[:_POOL], end)):
            self.choice_notes += [f"combination of {good[0].name} with {r.name} not tried: over --budget-seconds"
                                  for r in good[1:]]
            if self.joint_not_built:
                self.choice_notes.append(self._not_combined_text())
            return good[0]
        if self.joint_not_built:
            self.choice_notes.append(self._not_combined_text())
        self._read_joint()
        pick = self._joint_pick()
        return good[0] if pick is self.report.baseline else pick  # the joint race's fewer rounds do not undo a win

    # -- the race -----------------------------------------------------------------------------
    def _run_joint(self, pool: list[Result], end: float) -> bool:
        """Build the combinations the time allows, then race them with plain and the single tricks; False (and a
        note naming them) when the time left holds none of them."""
        self.joint_rows = list(pool)
        self.joint_not_built = []
        keep = _MEMORY_RUN_MARGIN * self.memory_s  # the pick's memory run, after the race
        for changes, names in _combination_sets(pool):
            if self.left(end) < keep + self._joint_need(len(self.joint_rows) + 1):
                self.joint_not_built.append(names)
                continue
            row = self._build_combination(changes, names)
            if row is not None:
                self.joint_rows.append(row)
        if len(self.joint_rows) == len(pool):
            return False
        lanes = [Lane("plain", self.base, role="baseline")]
        lanes += [Lane(r.name, r.runner, contender=_drift_ok(r),
                       why_not="its loss drifts from fp32 beyond the tolerance: timed for its cost only")
                  for r in self.joint_rows]
        self.joint = Race(lanes, noise=self._noise, min_effect=MIN_EFFECT, min_rounds=_MIN_ROUNDS,
                          settle_rounds=_SIDE_SETTLE_ROUNDS, max_rounds=_MAX_SIDE_ROUNDS,
                          seed=int(self.base_cfg.get("seed", 0)), sync=self._sync)
        floor = self._race_need(len(lanes), _MIN_ROUNDS)
        self.joint.run(max(end - keep, time.perf_counter() + floor))
        return True

    def _joint_need(self, rows: int) -> float:
        """Seconds the joint race needs with ``rows`` configurations: one build each (the singles are built)
        and the least race, plain included."""
        return 1.2 * self.build_s + self._race_need(rows + 1, _MIN_ROUNDS)

    def _build_combination(self, changes: dict[str, Any], names: str) -> Result | None:
        """One combination's runner and drift (its memory only if it is picked); a failure is its row's reason."""
        res = Result(names, "speed", changes, _ids_of(self.report.results, changes), race="joint")
        self.report.combos.append(res)
        try:
            r = build_runner(names, self.model, {**self.base_cfg, **changes}, self.batches, **self.kw)
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)
            return None
        _drift_into(res, r, self.base)
        res.runner, res.status = r, "measured"
        return res

    def _not_combined_text(self) -> str:
        """The combinations the budget left out, and about what they would need."""
        n = len(self.joint_not_built)
        need = n * 1.2 * self.build_s + self._race_need(len(self.joint_rows) + n + 1, _SIDE_SETTLE_ROUNDS)
        return (f"not combined for the budget: {', '.join(self.joint_not_built)} (about {math.ceil(need)} s more "
                "--budget-seconds would measure them)")

    # -- the figures and the pick -----------------------------------------------------------------
    def _read_joint(self) -> None:
        """Each combination's figures from the joint race: against plain, and against its fastest measured
        part (what it extends). The single tricks keep their figures from the race of the single tricks."""
        race = self.joint
        for i, res in enumerate(self.joint_rows, start=1):
            lane = race.lanes[i]
            if not any(res is c for c in self.report.combos) or res.status == "failed":
                continue
            if lane.error:
                res.status, res.verdict, res.reason = "failed", "failed", f"raised while timed: {lane.error}"
                continue
            res.step_s = _median(lane.times)
            res.ratio, res.ratio_half_ci = race.ratio(i)
            res.rounds, res.left_round, res.left_reason = len(lane.times), lane.left_round, lane.left_reason
            res.race_rounds = race.rounds
            part = self._fastest_part(i)
            if part is not None:
                res.vs_current, res.vs_current_half_ci = race.ratio(i, part)
                res.vs_current_name = self.joint_rows[part - 1].name
                res.vs_current_step_s = _median(race.lanes[part].times)
            res.verdict = self._verdict(res)

    def _fastest_part(self, i: int) -> int | None:
        """The lane of the fastest measured configuration whose switches are a proper part of lane ``i``'s."""
        parts = self._parts(i)
        return min(parts, key=lambda j: self.joint.ratio(j)[0]) if parts else None

    def _parts(self, i: int) -> list[int]:
        """The lanes (of the joint race) whose switches are a proper subset of lane ``i``'s, timed."""
        whole = self.joint_rows[i - 1].changes.items()
        return [j for j, r in enumerate(self.joint_rows, start=1)
                if j != i and r.changes.items() < whole and self.joint.lanes[j].times]

    def _joint_pick(self) -> Result:
        """The fastest configuration faster than plain beyond the margin (that fits), made simpler while one of
        its measured parts is as fast within the margin."""
        race = self.joint
        noise = self.report.noise
        ok = [i for i in range(1, len(race.lanes)) if self._joint_candidate(i, noise)]
        if not ok:
            return self.report.baseline
        pick = min(ok, key=lambda i: race.ratio(i)[0])
        while True:
            tied = [j for j in self._parts(pick) if j in ok and not self._beats(pick, j)]
            if not tied:
                return self._with_memory(self.joint_rows[pick - 1], ok)
            pick = min(tied, key=lambda j: race.ratio(j)[0])

    def _joint_candidate(self, i: int, noise: float) -> bool:
        """Lane ``i`` may be the pick: timed without error, within the drift tolerance, faster than plain
        beyond the margin in the joint race, and not measured over the memory limit."""
        res, lane = self.joint_rows[i - 1], self.joint.lanes[i]
        if lane.error or res.status == "failed" or not _drift_ok(res) or not lane.times:
            return False
        return self.joint.faster(i, noise) and (res.peak_bytes is None or self._fits(res))

    def _beats(self, i: int, j: int) -> bool:
        """Lane ``i`` is faster than lane ``j`` beyond the margin, in the joint race."""
        r, h = self.joint.ratio(i, j)
        return not math.isnan(r) and r < 1 - self._margin(h)

    def _with_memory(self, res: Result, ok: list[int]) -> Result:
        """The pick with its memory measured (a combination's is measured only now); over the limit, the next
        pick without it."""
        if res.peak_bytes is not None or time.perf_counter() + _MEMORY_RUN_MARGIN * self.memory_s > self.train_end:
            return res
        try:
            self._memory_into(res, {**self.base_cfg, **res.changes})
        except Exception as exc:
            res.note = f"its memory run raised: {one_line(exc)}"
            return res
        if self._fits(res):
            return res
        self.choice_notes.append(f"{res.name}: over the memory limit, not picked")
        return self._joint_pick()


def _combination_sets(pool: list[Result]) -> list[tuple[dict[str, Any], str]]:
    """Every combination of two or more of ``pool`` whose switches do not overlap and are valid together, as
    (changes, name), the one their single speeds predict fastest first."""
    out = []
    for k in range(2, len(pool) + 1):
        for group in itertools.combinations(pool, k):
            keys = [key for r in group for key in r.changes]
            changes = {key: v for r in group for key, v in r.changes.items()}
            if len(keys) == len(set(keys)) and _valid_together(changes):
                out.append((math.prod(r.ratio for r in group), changes, "+".join(sorted(r.name for r in group))))
    return [(changes, name) for _, changes, name in sorted(out, key=lambda t: t[0])]


def _ids_of(results: list[Result], changes: dict[str, Any]) -> tuple[str, ...]:
    """The catalogue ids of the single tricks whose switches make up ``changes``."""
    return tuple(sorted({i for r in results if r.changes and r.changes.items() <= changes.items() for i in r.ids}))

