"""The tune's races (see :mod:`torch_tricks.tuning.race`): the single tricks with both baselines, each
combination side by side with what it extends, and more rounds at the end for the races still open; the
figures read from them, and why the tune stopped.

:class:`Races` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from torch_tricks.device import synchronize
from torch_tricks.errors import UserError
from torch_tricks.tuning.decide import MIN_EFFECT, _drift_ok
from torch_tricks.tuning.measure import paired_ratio
from torch_tricks.tuning.race import Lane, Race
from torch_tricks.tuning.result import Result

# The race (see torch_tricks.tuning.race): every runner gets at least _MIN_ROUNDS rounds; the race of the
# single tricks is called settled after _SETTLE_ROUNDS at the earliest, and once the stated noise (which
# comes from its rounds) is itself known to ±MIN_EFFECT/4, so that it is never the loose term of a call;
# a side-by-side race after _SIDE_SETTLE_ROUNDS; no race runs more than its cap, a safety net for models
# whose steps take milliseconds.
_MIN_ROUNDS = 5
_SETTLE_ROUNDS = 30
_SIDE_SETTLE_ROUNDS = 12
_MAX_ROUNDS = 150
_MAX_SIDE_ROUNDS = 100


class Races:
    """The race of the single tricks (``singles``, its rows ``singles_res``) and the side-by-side races
    (``side``: id(row) -> its race and what it extends); each row's figures and verdict from them."""

    def _race_singles(self, results: list[Result]) -> None:
        """3. the race: all of them with the two baselines, round-robin; losers leave, contenders get the rounds."""
        report = self.report
        t_race = time.perf_counter()
        self.phase_s["set-up"] = t_race - self.t0
        self.phase("race")
        self.singles_res = [r for r in results if r.runner is not None]
        lanes = self._singles_lanes()
        self.singles = Race(lanes, min_effect=MIN_EFFECT, min_rounds=_MIN_ROUNDS, settle_rounds=_SETTLE_ROUNDS,
                            max_rounds=_MAX_ROUNDS, noise_resolution=MIN_EFFECT / 4, seed=int(self.base_cfg.get("seed", 0)), sync=self._sync)
        left = self.left()
        reserve = self._kept_from_the_race(lanes)
        self.singles.run(time.perf_counter() + max(left - reserve, 0.4 * left))
        if self.singles.lanes[0].error:
            raise UserError(f"{report.model}: the plain fp32 step raised while timed: {self.singles.lanes[0].error}")
        self._read_singles()
        self.phase_s["race"] = time.perf_counter() - t_race
        self.bar.update(1)

    def _singles_lanes(self) -> list[Lane]:
        """The plain step and its A/A twin, then each single trick (a contender unless it cannot win)."""
        plain_fits = self._fits(self.report.baseline)
        lanes = [Lane("plain", self.base, role="baseline"), Lane("plain (A/A)", self.twin, role="twin")]
        for res in self.singles_res:
            why = self._not_a_contender(res, plain_fits)
            lanes.append(Lane(res.name, res.runner, contender=not why, why_not=why))
        return lanes

    def _not_a_contender(self, res: Result, plain_fits: bool) -> str:
        """Why ``res`` cannot be the recommendation for throughput ('' if it can): it is timed for its cost only."""
        if not _drift_ok(res):
            return "its loss drifts from fp32 beyond the tolerance: not recommended, timed for its cost only"
        if plain_fits and res.goal != "speed":
            return f"a {res.goal} trick, not a throughput contender while the plain step fits: timed for its cost only"
        if plain_fits and not self._fits(res):
            return "over the memory limit, where the plain step fits: not recommended, timed for its cost only"
        return ""

    def _read_singles(self) -> None:
        """The noise, and every single trick's figures and verdict, from the race as it stands."""
        report, race = self.report, self.singles
        base_t, twin_t = race.lanes[0].times, race.lanes[1].times
        report.rounds = race.rounds
        aa, aa_half = paired_ratio(twin_t, base_t)
        report.noise = max(abs(aa - 1.0), aa_half) if not math.isnan(aa) else math.nan
        report.aa_ratio, report.aa_half_ci = aa, aa_half
        base_res = report.baseline
        base_res.step_s, base_res.ratio, base_res.rounds = _median(base_t), 1.0, race.rounds
        if base_t:  # what the next phases' time is planned with: the plain step as the race found it (a busy
            self.step_s = max(self.step_s, base_res.step_s)  # machine's steps are slower than at the start)
        self._read_rows(race, self.singles_res, race.lanes[2:])

    def _read_rows(self, race: Race, rows: list[Result], lanes: list[Lane]) -> None:
        """Each of ``rows``' figures against plain (the race's first lane) and verdict, from its lane."""
        base_t = race.lanes[0].times
        for res, lane in zip(rows, lanes):
            if res.status == "failed":
                continue
            if lane.error:
                res.status, res.verdict, res.reason = "failed", "failed", f"raised while timed: {lane.error}"
                res.runner = None
                continue
            res.step_s = _median(lane.times)
            res.ratio, res.ratio_half_ci = paired_ratio(lane.times, base_t)
            res.rounds, res.left_round, res.left_reason = len(lane.times), lane.left_round, lane.left_reason
            res.race_rounds = race.rounds
            res.verdict = self._verdict(res)

    def _race_side_by_side(self, res: Result, current: Result | None, end: float, *, share: float = 0.5,
                           contender: bool = True, why_not: str = "") -> None:
        """Race ``res`` with the plain step (and ``current``, the configuration it extends, to compare directly).

        The question: is ``res`` faster than ``current`` (else plain) beyond the margin? The
        race ends when that is settled, at ``share`` of the time left until ``end``, or at the
        cap on rounds; it can get more rounds at the end (:meth:`_more_rounds`).
        """
        lanes = [Lane("plain", self.base, role="baseline")]
        if current is not None and current.runner is not None:
            lanes.append(Lane(current.name, current.runner, role="ref"))
        else:
            current = None
        lanes.append(Lane(res.name, res.runner, ref=len(lanes) - 1, contender=contender and _drift_ok(res),
                          why_not=why_not or "its loss drifts from fp32 beyond the tolerance: timed for its cost only"))
        race = Race(lanes, noise=self._noise, min_effect=MIN_EFFECT, min_rounds=_MIN_ROUNDS,
                    settle_rounds=_SIDE_SETTLE_ROUNDS, max_rounds=_MAX_SIDE_ROUNDS, seed=int(self.base_cfg.get("seed", 0)),
                    sync=self._sync)
        self.side[id(res)] = (race, current)
        floor = self._race_need(len(lanes), _MIN_ROUNDS)
        race.run(min(end, time.perf_counter() + max(share * self.left(end), floor)))
        self._read_side(res)

    def _read_side(self, res: Result) -> None:
        """``res``'s figures from its side-by-side race, as it stands."""
        race, current = self.side[id(res)]
        lane = race.lanes[-1]
        if res.status == "failed":
            return
        if lane.error:
            res.status, res.verdict, res.reason = "failed", "failed", f"raised while timed: {lane.error}"
            res.runner = None
            res.step_s = res.ratio = res.ratio_half_ci = res.rounds = None
            return
        plain = race.lanes[0].times
        res.step_s = _median(lane.times)
        res.ratio, res.ratio_half_ci = paired_ratio(lane.times, plain)
        res.rounds, res.left_round, res.left_reason = len(lane.times), lane.left_round, lane.left_reason
        res.race_rounds = race.rounds
        res.status = "measured"
        if current is not None:
            res.vs_current, res.vs_current_half_ci = race.ratio(len(race.lanes) - 1, 1)
            res.vs_current_name = current.name
            res.vs_current_step_s = _median(race.lanes[1].times)
        else:
            res.vs_current, res.vs_current_half_ci = res.ratio, res.ratio_half_ci
            res.vs_current_step_s = _median(plain)
        res.verdict = self._verdict(res)

    def _more_rounds_phase(self) -> None:
        """What is left of the budget goes to the races still open; then every decision is taken again."""
        t_more = time.perf_counter()
        self.phase("more rounds")
        if self._more_rounds():
            self._read_singles()
            if self.later is not None:
                self._read_rows(self.later, self.later_res, self.later.lanes[1:])
            for res in self.report.results + self.report.combos:
                if id(res) in self.side:
                    self._read_side(res)
            self._decide()
            self.phase_s["more rounds"] = time.perf_counter() - t_more

    def _more_rounds(self) -> bool:
        """What is left of the training budget goes to the races still open: the singles first, then the
        combinations and compile, each until settled or its share of what is left. True if any ran."""
        races = self._singles_race() + self._joint_race() + [race for race, _ in self.side.values()]
        ran = False
        tried: set[int] = set()
        while True:
            open_ = [r for r in _unsettled(races, "budget") if id(r) not in tried]
            left = self.left()
            if not open_ or left < max(2 * open_[0].last_round_s, 1.0):
                return ran
            r = open_[0]
            if not _ran_a_round(r, time.perf_counter() + left / len(open_)):
                tried.add(id(r))  # no round ran (it cannot go on, or a round would not fit): not tried again
            ran = True

    def _stop_reason(self) -> str:
        """Why the tune stopped: ``settled: ...`` (every race answered its question), ``budget: ...`` (the
        time ran out with questions open: which), or ``cap: ...`` (the most rounds a race gets)."""
        report = self.report
        races = self._races()
        open_, capped = _unsettled(races, "budget"), _unsettled(races, "cap")
        noise = "n/a" if math.isnan(report.noise) else f"±{report.noise:.1%}"
        after = f"after {report.rounds} rounds (noise {noise})"
        tail = self._not_run_text()
        if open_:
            what = "; ".join(", ".join(r.open_lanes()) for r in open_)
            return f"budget: the time ran out {after} with these still open: {what}{tail}"
        if capped:
            what = "; ".join(f"{', '.join(r.open_lanes())} ({r.rounds} rounds)" for r in capped)
            return f"cap: the most rounds a race gets, with these still open: {what}{tail}"
        return (f"settled: {after} every trick had left the race with its question answered, or won it; "
                f"{self._recommendation_text()}{tail}")

    def _recommendation_text(self) -> str:
        best = self.report.best_throughput
        return "keep the plain step" if best is None or best is self.report.baseline else f"recommended: {best.name}"

    def _not_run_text(self) -> str:
        """'; not measured for the budget: ...' naming the tricks the budget left out ('' when none)."""
        not_run = [r.name for r in self.report.results if r.status == "skipped" and "budget" in r.reason]
        return f"; not measured for the budget: {', '.join(not_run)}" if not_run else ""

    def _races(self) -> list[Race]:
        """The race of the single tricks, the joint race, each row's side-by-side race in the rows' order, and the
        memory and cost tricks' race."""
        races = self._singles_race() + self._joint_race()
        races += [self.side[id(res)][0] for res in self.report.results + self.report.combos if id(res) in self.side]
        return races + ([self.later] if self.later is not None else [])

    def _singles_race(self) -> list[Race]:
        """The race of the single tricks, as a list: empty where it did not run."""
        return [self.singles] if self.singles is not None else []

    def _joint_race(self) -> list[Race]:
        """The joint race of the combinations, as a list: empty where it did not run."""
        return [self.joint] if self.joint is not None else []

    def _sync(self) -> None:
        synchronize(self.base.step.device if self.base is not None else torch.device("cpu"))

    def _noise(self) -> float:
        return self.report.noise


def _ran_a_round(race: Race, until: float) -> bool:
    """Run ``race`` on until ``until``; whether it ran a round."""
    before = race.rounds
    race.run(until)
    return race.rounds != before


def _unsettled(races: list[Race], state: str) -> list[Race]:
    """The races that stopped in ``state`` ("budget": the time ran out; "cap": the most rounds) unsettled."""
    return [r for r in races if r.state == state and not r.settled]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan

