"""A configuration's measurements: one row of the tune's report (a single trick, a combination, or plain)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Result"]


@dataclass
class Result:
    """One configuration's measurements (a single trick, a combination, or the baseline)."""

    name: str
    goal: str  # speed | memory | cost | baseline
    changes: dict[str, Any]
    ids: tuple[str, ...]
    note: str = ""
    status: str = "pending"  # measured | measured (memory) | skipped | failed
    reason: str = ""
    step_s: float | None = None  # median step time
    ratio: float | None = None  # median of per-round step-time ratios to plain (< 1: faster)
    ratio_half_ci: float | None = None  # half-width of the ~95% interval of that median
    rounds: int | None = None  # timed rounds behind ratio (the rounds it got in its race)
    race_rounds: int | None = None  # the rounds its race ran in all (the baselines got every one)
    left_round: int | None = None  # it left its race after this many rounds (None: in it to the end)
    left_reason: str = ""  # why it left (its question was answered, it raised, or it is timed for its cost only)
    vs_current: float | None = None  # combinations: the same ratio against the configuration it extends
    vs_current_half_ci: float | None = None
    vs_current_name: str | None = None
    vs_current_step_s: float | None = None  # the median step of what it extends (else plain), in the same race
    first_call_s: float | None = None  # first gradient pass: includes compile time when compile is on
    probe_ratio: float | None = None  # too slow to measure: its probe step's time / the plain one's
    peak_bytes: int | None = None  # peak tensor bytes of build + two steps at the batch
    state_bytes: int | None = None  # live between steps: weights, optimizer state, EMA ...
    activation_bytes: int | None = None  # kept by one forward for its backward (one micro-batch)
    bytes_per_sample: float | None = None
    max_batch: int | None = None  # the largest batch a step ran at under the memory limit (measured; None: not searched)
    max_batch_bound: int | None = None  # the smallest batch run that did not fit (None: none did, or none was run)
    max_batch_guess: int | None = None  # a straight line through the batch and half of it: where the search starts
    max_seq: int | None = None  # --fit seq: the longest sequence a step ran at under the limit (None: not searched)
    max_seq_bound: int | None = None  # the shortest sequence run that did not fit (None: none did, or none was run)
    grad_drift: float | None = None  # ||g - g_fp32|| / ||g_fp32|| of the first step (reported, does not decide)
    loss_drift: float | None = None  # max |loss - fp32 loss| over the drift steps / the first fp32 loss
    losses: list[float] = field(default_factory=list)
    verdict: str = ""
    chosen: bool = False
    # why (TuneReport.explain, from the figures above): the decision, its reason, what would change it
    decision: str = ""  # recommended | part of the recommendation | not recommended | reference | skipped | failed ...
    why: str = ""
    advice: str = ""  # what to change to get it measured or chosen ('' when nothing would)
    break_even_steps: int | None = None  # compile: steps until its one-off first call is paid back by faster steps
    race: str = ""  # "joint": a combination timed in the joint race of the faster tricks' combinations
    runner: Any = field(default=None, repr=False, compare=False)

    @property
    def speedup(self) -> float | None:
        return 1.0 / self.ratio if self.ratio and not math.isnan(self.ratio) else None

    @property
    def speedup_half_ci(self) -> float | None:
        r, h = self.ratio, self.ratio_half_ci
        if r is None or h is None or math.isnan(r) or math.isnan(h) or r <= h:
            return None  # an interval that reaches a zero step time bounds no speed-up (few, wild rounds)
        return (1.0 / (r - h) - 1.0 / (r + h)) / 2

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "runner"}
        d["ids"] = list(self.ids)
        d["speedup"] = self.speedup
        d["speedup_half_ci"] = self.speedup_half_ci
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
