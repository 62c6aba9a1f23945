"""What a one-off cost (compile's first call) buys back: the break-even step count, against the run's length.

Mixed into :class:`~torch_tricks.tuning.report.TuneReport`: the tuner asks it whether compile pays back
(:meth:`Payback.amortised`), the verdicts and the summary say so with the same figures.
"""

from __future__ import annotations

import math
from typing import Any

from torch_tricks.tuning.report_format import _fmt_s, _measured
from torch_tricks.tuning.result import Result


class Payback:
    """A compiled row's payback, from measured figures only (TuneReport's part for one-off costs)."""

    def payback(self, r: Result) -> dict[str, Any] | None:
        """What a one-off cost (compile's first call) buys back, from measured figures only; None where
        one is missing.

        ``ref``: the configuration ``r`` extends (plain when none); ``extra_s``: ``r``'s first
        call minus ``ref``'s; ``saved_s``: ``ref``'s median step minus ``r``'s, both from ``r``'s
        race; ``steps``: the break-even step count, ``ceil(extra_s / saved_s)`` (0 when the first
        call costs nothing extra, None when the step saves nothing: it never pays back).
        """
        ref = self._extended(r)
        if ref is None or r.first_call_s is None or ref.first_call_s is None or not _measured(r.step_s):
            return None
        ref_step = r.vs_current_step_s if r.vs_current_step_s is not None else ref.step_s
        if not _measured(ref_step):
            return None
        extra, saved = r.first_call_s - ref.first_call_s, ref_step - r.step_s
        steps = _break_even(extra, saved)
        return {"ref": ref.name, "first_call_s": r.first_call_s, "ref_first_call_s": ref.first_call_s,
                "extra_s": extra, "step_s": r.step_s, "ref_step_s": ref_step, "saved_s": saved, "steps": steps}

    def _compile_payback(self, r: Result) -> dict[str, Any] | None:
        """:meth:`payback` of a compiled row; None for the others."""
        return self.payback(r) if r.changes.get("compile") else None

    def amortised(self, r: Result) -> bool | None:
        """Whether ``r``'s one-off cost pays back within the run (:attr:`run_steps`); None: not known."""
        pb = self.payback(r)
        if pb is None or not self.run_steps:
            return None
        return pb["steps"] is not None and pb["steps"] <= self.run_steps

    def _run_text(self) -> str:
        if not self.run_steps:
            return "the run"
        if self.run_steps_source == "given":
            return f"your run of {self.run_steps:,} steps"
        return f"the {self.run_steps:,} steps the tune assumes for a run"

    def _payback_text(self, pb: dict[str, Any]) -> str:
        ref, first = pb["ref"], f"its first call took {pb['first_call_s']:.1f} s"
        if pb["steps"] == 0:
            return f"{first}, no longer than {ref}'s: no compile time to pay back"
        first += f", {pb['extra_s']:.1f} s more than {ref}'s (compilation)"
        if pb["steps"] is None:
            return (f"{first}, and its step is not faster than {ref}'s ({_fmt_s(pb['step_s'])} against "
                    f"{_fmt_s(pb['ref_step_s'])}): it never pays back")
        return (f"{first}, and it saves {pb['saved_s'] * 1e3:.3g} ms a step against {ref} ({_fmt_s(pb['ref_step_s'])} "
                f"-> {_fmt_s(pb['step_s'])}): break-even after {pb['steps']:,} steps")


def _break_even(extra: float, saved: float) -> int | None:
    """Steps until ``extra`` one-off seconds are paid back by ``saved`` seconds a step (None: never)."""
    if extra <= 0:
        return 0
    return math.ceil(extra / saved) if saved > 0 else None

