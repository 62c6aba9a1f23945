"""The race: runners timed side by side, round after round, until the answer is settled or the time is up.

Every round times one call of each runner still in the race, in a new random order
(a rotation would put each runner always after the same neighbour, and a neighbour that
leaves the CPU slower, a heavy emulated step lowering the clock for a while, would bias
the one after it every round), so drift of the machine hits all alike; a candidate's speed is the median of its per-round
time ratios to its reference (:func:`~torch_tricks.tuning.measure.paired_ratio`),
with the ~95% interval of that median, which narrows as the rounds grow. More rounds
among fewer runners is what buys certainty, so the race drops the runners whose
question is answered and gives the rounds to the others:

* a candidate whose interval rules out being ``min_effect`` faster than its reference
  (its optimistic end, ``ratio - half``, is at or above ``1 - min_effect``) leaves: it
  cannot be recommended for speed, whatever more rounds would show;
* a candidate that is faster beyond the margin (``ratio < 1 - max(noise, half,
  min_effect)``, the verdict the tuner calls *faster*) but slower than the best
  candidate beyond the interval of their paired ratio leaves: it is settled as faster,
  and it is not the best. One that is slower than the best but not yet settled as
  faster than its reference stays: whether it is faster decides whether the tuner
  tries it in a combination with the best;
* once its interval and the A/A noise's are narrower than ``min_effect / 2`` (after at
  least ``settle_rounds``), a candidate is *resolved*: one that is not faster beyond the
  margin leaves (its gain, if any, is too close to the line to call, and more rounds
  would not change that by anything that matters), and so does one that is faster and
  as fast as the best within that resolution (a tie);
* a runner that is not a contender (a memory trick while the plain step fits, a trick
  whose numbers drift) leaves after ``min_rounds``: it is timed for its cost only;
* a runner whose call raises leaves with its error (the race goes on without it).

The baseline, the A/A twin (an identical copy of the baseline: their disagreement is
the noise) and any reference runner get every round. The race is **settled** when no
candidate is left, or one is left and it is faster beyond the margin (after at least
``settle_rounds``), and, with ``noise_resolution``, the A/A ratio's half-interval is
within it (the stated noise is itself known that well); otherwise it runs until ``until`` (state ``budget``) or
``max_rounds`` (state ``cap``). A race can be resumed (:meth:`Race.run` again) with
more time. The decisions are checked after ``min_rounds`` and then whenever the rounds
have grown by a fifth, not after every round, so a difference that is not there is
not found by looking too often.

A runner is any callable (``sync``, if given, is called around each timed call, e.g.
to wait for a GPU), so the race can be tested with fake runners that sleep.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch_tricks.errors import one_line
from torch_tricks.tuning.measure import paired_ratio

__all__ = ["Lane", "Race", "margin", "race"]


@dataclass
class Lane:
    """One runner in a race, and what the race measured and decided of it."""

    name: str
    runner: Callable[[], Any]
    role: str = "candidate"  # baseline | twin | ref | candidate
    ref: int | None = None  # candidates: the index of the lane they are judged against (None: the baseline)
    contender: bool = True  # False: timed for its cost only, leaves after min_rounds
    why_not: str = ""  # why it is not a contender (the reason it leaves with)
    times: list[float] = field(default_factory=list)  # one per round it was in, from the race's first round on
    left_round: int | None = None  # the rounds it had when it left; None: in the race to the end
    left_reason: str = ""
    error: str | None = None  # its call raised: it is out

    @property
    def live(self) -> bool:
        return self.left_round is None and self.error is None


class Race:
    """Runners timed round-robin until settled, the deadline, or the cap on rounds (see the module doc)."""

    def __init__(
        self,
        lanes: Sequence[Lane],
        *,
        noise: float | Callable[[], float] | None = None,
        min_effect: float = 0.02,
        min_rounds: int = 5,
        settle_rounds: int = 12,
        max_rounds: int = 100,
        noise_resolution: float | None = None,
        seed: int = 0,
        sync: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.lanes = list(lanes)
        roles = [lane.role for lane in self.lanes]
        if roles.count("baseline") != 1:
            raise ValueError("a race needs exactly one baseline lane")
        self.base = roles.index("baseline")
        self.twin = roles.index("twin") if "twin" in roles else None
        self._noise = noise
        self.min_effect, self.min_rounds = min_effect, max(int(min_rounds), 1)
        self.settle_rounds, self.max_rounds = max(int(settle_rounds), self.min_rounds), max(int(max_rounds), 1)
        self.noise_resolution = noise_resolution
        self._rng = random.Random(seed)
        self._sync = sync
        self._clock = clock
        self.rounds = 0
        self.state = "new"  # new | settled | budget | cap | failed
        self.elapsed_s = 0.0
        self._next_check = self.min_rounds
        self._last_round_s = 0.0
        self._settled = False

    # -- figures -------------------------------------------------------------------------------
    def ratio(self, i: int, j: int | None = None) -> tuple[float, float]:
        """Median per-round time ratio of lane ``i`` to lane ``j`` (its reference by default), and its half-interval."""
        j = self._ref(i) if j is None else j
        return paired_ratio(self.lanes[i].times, self.lanes[j].times)

    def noise(self) -> float:
        """The A/A disagreement ``max(|ratio - 1|, half-interval)`` of the twin, else the noise given (NaN: none)."""
        if self.twin is not None:
            aa, half = self._aa()
            return math.nan if math.isnan(aa) else max(abs(aa - 1.0), half)
        if callable(self._noise):
            return float(self._noise())
        return math.nan if self._noise is None else float(self._noise)

    def _ref(self, i: int) -> int:
        ref = self.lanes[i].ref
        return self.base if ref is None else ref

    def candidates(self, live: bool = True) -> list[int]:
        return [i for i, lane in enumerate(self.lanes) if lane.role == "candidate" and (lane.live or not live)]

    def faster(self, i: int, noise: float | None = None) -> bool:
        """Lane ``i`` is faster than its reference beyond the margin: ``max(noise, its half-interval, min_effect)``."""
        noise = self.noise() if noise is None else noise
        r, h = self.ratio(i)
        if math.isnan(r):
            return False
        return r < 1 - margin(noise, h, self.min_effect)

    @property
    def settled(self) -> bool:
        return self._settled

    @property
    def last_round_s(self) -> float:
        """Seconds the last round took (what the next one will take, about)."""
        return self._last_round_s

    def noise_half(self) -> float:
        """The half-interval of the A/A ratio (NaN without a twin): how well the noise itself is known."""
        return math.nan if self.twin is None else self._aa()[1]

    def _aa(self) -> tuple[float, float]:
        return paired_ratio(self.lanes[self.twin].times, self.lanes[self.base].times)

    def noise_resolved(self) -> bool:
        """The A/A half-interval is within ``noise_resolution`` (always, without a twin or a resolution asked)."""
        if self.twin is None or self.noise_resolution is None:
            return True
        half = self.noise_half()
        return not math.isnan(half) and half <= self.noise_resolution

    def open_lanes(self) -> list[str]:
        """What is still open: the candidates still in the race, each with its speed against its reference
        (one that is faster beyond the margin is still racing for the best), and the noise if it is not
        yet resolved."""
        out = []
        noise = self.noise()
        live = self.candidates()
        for i in live:
            faster = self.faster(i, noise)
            if faster and len(live) == 1 and self.rounds >= self.settle_rounds:
                continue  # the winner: settled
            out.append(self._lane_text(i) + (" (faster; racing for the best)" if faster else ""))
        if not self.noise_resolved():
            out.append(f"the noise, known to ±{self.noise_half():.1%} so far (it settles within "
                       f"±{self.noise_resolution:.1%})")
        return out

    def _lane_text(self, i: int) -> str:
        """Lane ``i``'s name and its speed against its reference (where it has one)."""
        r, h = self.ratio(i)
        if math.isnan(r):
            return self.lanes[i].name
        return f"{self.lanes[i].name} {_span(r, h, self.lanes[self._ref(i)].name)}"

    # -- running -------------------------------------------------------------------------------
    def run(self, until: float) -> str:
        """Rounds until settled, ``until`` (a clock value; at least ``min_rounds`` are run), or the cap.

        Returns (and sets) the state: ``settled``, ``budget``, ``cap``, or ``failed`` (the
        baseline or a reference raised). Can be called again to go on with more time.
        """
        if self.state in ("failed", "cap") or (self.state == "settled" and self._settled):
            return self.state
        t_start = self._clock()
        self._warmup()
        while True:
            stop = self._stop(until)
            if stop is not None:
                self.state = stop
                break
            self._round()
            if self.rounds >= self._next_check:
                self._judge()
                self._next_check = max(self.rounds + 1, math.ceil(self.rounds * 1.2))
        self.elapsed_s += self._clock() - t_start
        return self.state

    def _stop(self, until: float) -> str | None:
        """The state the race stops in before another round (None: it goes on); ``min_rounds`` come first."""
        if self._fatal():
            return "failed"
        if self.rounds < self.min_rounds:
            return None
        if self._settled:
            return "settled"
        if self.rounds >= self.max_rounds:
            return "cap"
        if self._clock() + self._last_round_s > until:
            return "budget"
        return None

    def _fatal(self) -> bool:
        return any(lane.error is not None for lane in self.lanes if lane.role in ("baseline", "ref"))

    def _call(self, i: int) -> float | None:
        lane = self.lanes[i]
        if self._sync is not None:
            self._sync()
        t0 = self._clock()
        try:
            lane.runner()
        except Exception as exc:  # a runner that breaks mid-race is reported, not fatal to the others
            lane.error = one_line(exc, with_type=True)
            if hasattr(lane.runner, "error"):
                lane.runner.error = lane.error
            if lane.left_round is None:
                lane.left_round, lane.left_reason = len(lane.times), f"raised: {lane.error}"
            return None
        if self._sync is not None:
            self._sync()
        return self._clock() - t0

    def _warmup(self) -> None:
        """One untimed call of every runner in the race (caches, allocator), at each start or resumption."""
        t0 = self._clock()
        for i, lane in enumerate(self.lanes):
            if lane.live:
                self._call(i)
        if not self._last_round_s:
            self._last_round_s = self._clock() - t0

    def _round(self) -> None:
        order = [i for i, lane in enumerate(self.lanes) if lane.live]
        self._rng.shuffle(order)
        t0 = self._clock()
        for i in order:
            dt = self._call(i)
            if dt is not None:
                self.lanes[i].times.append(dt)
        self.rounds += 1
        self._last_round_s = self._clock() - t0

    def _leave(self, i: int, reason: str) -> None:
        lane = self.lanes[i]
        lane.left_round, lane.left_reason = len(lane.times), reason

    def _judge(self) -> None:
        """Drop the candidates whose question is answered; decide whether the race is settled."""
        noise = self.noise()
        self._drop_the_answered()
        self._drop_the_resolved(noise)
        live = self.candidates()
        self._settled = (not live or (len(live) == 1 and self.rounds >= self.settle_rounds
                                      and self.faster(live[0], noise))) and self.noise_resolved()

    def _drop_the_answered(self) -> None:
        """After the least rounds: who is timed for its cost only, and who cannot be ``min_effect`` faster."""
        for i in self.candidates():
            lane = self.lanes[i]
            if len(lane.times) < self.min_rounds:
                continue
            if not lane.contender:
                self._leave(i, lane.why_not or "not a contender: timed for its cost only")
                continue
            r, h = self.ratio(i)
            if math.isnan(r):
                continue
            if r - h >= 1 - self.min_effect:
                ref = self.lanes[self._ref(i)].name
                self._leave(i, f"cannot be {self.min_effect:.0%} faster than {ref}: {_span(r, h, ref)} "
                               f"after {len(lane.times)} rounds")

    def _drop_the_resolved(self, noise: float) -> None:
        """Resolution: once the intervals (and the A/A noise's) are narrower than half the least effect that
        counts, more rounds cannot move a decision by anything that matters. A contender not faster than its
        reference leaves then; a faster one that is not the best leaves when behind it (:meth:`_leave_if_behind`)."""
        fine = self.min_effect / 2
        noise_fine = self.twin is None or self.noise_half() <= fine
        live = [i for i in self.candidates() if self.lanes[i].contender]
        best = self._fastest(live)
        for i in live:
            if not self.faster(i, noise):
                if noise_fine:
                    self._leave_if_resolved(i, noise, fine)
            elif i != best:
                self._leave_if_behind(i, best, fine)

    def _fastest(self, lanes: list[int]) -> int | None:
        """Of ``lanes``, the one with the smallest time ratio to its reference (None: no lane)."""
        return min(lanes, key=lambda i: self.ratio(i)[0]) if lanes else None

    def _leave_if_resolved(self, i: int, noise: float, fine: float) -> None:
        """A candidate not faster than its reference leaves once its interval is within ``fine``."""
        r, h = self.ratio(i)
        n = len(self.lanes[i].times)
        if h <= fine and n >= self.settle_rounds:
            ref = self.lanes[self._ref(i)].name
            beyond = f"the noise (±{noise:.1%}) and " if not math.isnan(noise) else ""
            self._leave(i, f"resolved to ±{h:.1%} after {n} rounds: {_span(r, h, ref)}, not faster beyond "
                           f"{beyond}{self.min_effect:.0%}")

    def _leave_if_behind(self, i: int, best: int, fine: float) -> None:
        """A faster candidate leaves when slower than the best beyond the interval, or as fast within ``fine``."""
        rb, hb = self.ratio(i, best)
        n = len(self.lanes[i].times)
        ref, other = self.lanes[self._ref(i)].name, self.lanes[best].name
        if rb - hb > 1:
            self._leave(i, f"faster than {ref}, and slower than {other} beyond the interval: "
                           f"{_span(rb, hb, other)} after {n} rounds")
        elif hb <= fine and n >= self.settle_rounds:
            self._leave(i, f"faster than {ref}, and as fast as {other} within ±{hb:.1%}: "
                           f"{_span(rb, hb, other)} after {n} rounds")


def margin(noise: float | None, half: float | None, min_effect: float) -> float:
    """How far from 1 a time ratio must be to count as faster or slower: the larger of the
    A/A noise, the ratio's own half-interval and ``min_effect`` (a NaN or missing term: 0)."""
    terms = [x for x in (noise, half) if x is not None and not math.isnan(x)]
    return max([*terms, min_effect])


def race(lanes: Sequence[Lane], until: float, **kw: Any) -> Race:
    """Build a :class:`Race` over ``lanes`` (keywords as :class:`Race`), run it until ``until``; return it."""
    r = Race(lanes, **kw)
    r.run(until)
    return r


def _span(ratio: float, half: float, ref: str) -> str:
    """A time ratio and its half-interval as a speed with its ~95% interval:
    (0.8, 0.05, 'plain') -> '1.25x the speed of plain (95% interval 1.18-1.33x)'."""
    if not ratio > 0:
        return "n/a"
    hi = f"{1 / (ratio - half):.2f}x" if ratio > half else "inf"
    return f"{1 / ratio:.2f}x the speed of {ref} (95% interval {1 / (ratio + half):.2f}-{hi})"
