"""Why: every row's decision, its reason and what would change it, from the figures in the report.

The words of a verdict follow its numbers (a speed-up and its interval against the margin): see
:meth:`Explain.explain`. Mixed into :class:`~torch_tricks.tuning.report.TuneReport`, whose fields it reads.
"""

from __future__ import annotations

import math
from typing import Any

from torch_tricks.tuning.race import margin
from torch_tricks.tuning.report_format import _bound_text, _bytes, _measured, _speedup, _toml_value
from torch_tricks.tuning.result import Result


class Explain:
    """The decision, reason and advice of each row (TuneReport's part that explains its verdicts)."""

    def explain(self) -> list[dict[str, Any]]:
        """Give every row its reason, from the figures in the report; returns :meth:`verdicts`.

        Sets each result's ``decision`` (recommended, part of the recommendation, not
        recommended, reference, skipped, failed ...), ``why`` (for a faster candidate that is
        not recommended: inside the noise of what it extends or of the best, compile time not
        paid back within the run, memory over the limit, drift; for a trick not measured: why)
        and ``advice`` (what to change to get it measured or chosen; '' when nothing would).
        Taken again by every view, so a report read back or put together by hand explains itself.
        """
        for r in self.results + self.combos:
            r.decision, r.why, r.advice = self._explain(r)
            pb = self._compile_payback(r)
            r.break_even_steps = pb["steps"] if pb else None
            target = self._on_top_target(r)
            if target is not None:
                r.verdict = self._on_top_verdict(target) or r.verdict
        if self.baseline is not None:
            b = self.baseline
            b.decision, b.why, b.advice = self._explain(b)
        return self.verdicts()

    def verdicts(self, compact: bool = False) -> list[dict[str, Any]]:
        """One entry per row of the table: name, verdict, decision, reason and advice (see :meth:`explain`).

        ``compact``: data and deploy tricks skipped for the same reason share one entry."""
        out = []
        if self.baseline is not None:
            out.append(_verdict(self.baseline))
            if not math.isnan(self.aa_ratio):
                out.append(_verdict_entry("plain again (A/A)", "the noise", "noise", "a second, identical plain "
                                          f"step: its disagreement with the first is the noise ({_noise(self.noise)})",
                                          ""))
        out += [_verdict(r) for r in self.results + self.combos]
        return out + [self._skipped_verdict(*row) for row in self._skipped_rows(compact)]

    def _skipped_verdict(self, folded: bool, kind: str, status: str, reason: str, items: list[Any]) -> dict[str, Any]:
        advice = self._skip_advice(items[0].name, kind, reason, status)
        if folded:
            names = ", ".join(s.name for s in items)
            return _verdict_entry(f"{len(items)} {kind} tricks ({names})", status, status, reason, advice)
        return _verdict_entry(items[0].name, status, status, reason, advice)

    def _skipped_rows(self, compact: bool) -> list[tuple[bool, str, str, str, list[Any]]]:
        """(folded, kind, status, reason, items) per row of skipped tricks: one each, except that under
        ``compact`` the skipped data and deploy tricks of one reason fold into one row."""
        rows: list[tuple[bool, str, str, str, list[Any]]] = []
        groups: dict[tuple[str, str], list[Any]] = {}
        for s in self.skipped:
            status = getattr(s, "status", "skipped")
            if compact and s.kind in ("data", "deploy") and status == "skipped":
                groups.setdefault((s.kind, s.reason), []).append(s)
            else:
                rows.append((False, s.kind, status, s.reason, [s]))
        return rows + [(True, kind, "skipped", reason, items) for (kind, reason), items in groups.items()]

    def _extended(self, r: Result) -> Result | None:
        """The configuration ``r`` extends: the row named by its ``vs_current_name``, else the plain step."""
        return self._by_name(r.vs_current_name) if r.vs_current_name else self.baseline

    def _by_name(self, name: str | None) -> Result | None:
        rows = ([self.baseline] if self.baseline else []) + self.results + self.combos
        return next((r for r in rows if r.name == name), None)

    def _a_trick(self, r: Result | None) -> bool:
        """``r`` is a configuration other than the plain step (a chosen trick or combination)."""
        return r is not None and r is not self.baseline

    def _margin(self, half: float | None) -> float:
        return margin(self.noise, half, self.min_effect)

    def _over_limit(self, r: Result) -> bool:
        """Its memory was measured, and its peak is over the limit."""
        return r.peak_bytes is not None and r.peak_bytes > self.memory_limit

    def _plain_fits(self) -> bool:
        """The plain step is under the memory limit (or its memory was not measured: nothing says otherwise)."""
        return self.baseline is None or not self._over_limit(self.baseline)

    def _any_measured(self) -> bool:
        """Any single trick was measured (timed, probed or for its memory)."""
        return any(r.status.startswith("measured") for r in self.results)

    def _drift_ok(self, r: Result) -> bool:
        tol = self.drift_tolerance.get("loss")
        return r.loss_drift is None or tol is None or r.loss_drift <= tol

    def _the_margin(self, half: float | None) -> str:
        return (f"a change must exceed ±{self._margin(half):.1%}, the larger of the noise ({_noise(self.noise)}), "
                f"its own interval and {self.min_effect:.0%}")

    def _open_advice(self, r: Result) -> str:
        """More rounds where its race was still open (it did not leave with its question answered)."""
        if r.left_round is None and not self.stop_reason.startswith("cap"):
            return "more rounds narrow its interval: raise --budget-seconds"
        return ""

    def _explain(self, r: Result) -> tuple[str, str, str]:
        """(decision, why, advice) of one row: the first question that settles it, in order: what
        the row is (skipped, the baseline, the best, part of it, over a limit, a memory or cost
        trick), then its speed against plain and what it extends, then against the best."""
        return self._explain_kind(r) or self._explain_speed(r)

    def _explain_kind(self, r: Result) -> tuple[str, str, str] | None:
        """The verdict settled by what the row is, before its speed is looked at; None otherwise."""
        if r.status in ("skipped", "failed"):
            return r.status, r.reason or r.status, self._skip_advice(r.name, "train", r.reason, r.status)
        if r is self.baseline:
            return self._explain_baseline()
        return (self._explain_compile_row(r) or self._explain_chosen(r) or self._explain_ruled_out(r)
                or self._explain_memory_only(r) or self._explain_goal(r))

    def _explain_compile_row(self, r: Result) -> tuple[str, str, str] | None:
        """The compile row: its figures are the +compile one's, so is its verdict."""
        target = self._on_top_target(r)
        if target is None:
            return None
        decision, why, advice = self._explain(target)
        if decision == "recommended":
            return "part of the recommendation", f"switched on in {target.name}, the recommendation", ""
        return decision, f"{r.reason}: {why}", advice

    def _on_top_target(self, r: Result) -> Result | None:
        """The row a compile row points at ("measured on top of X: see X+compile"); None for any other row."""
        if not r.reason.startswith("measured on top of"):
            return None
        target = self._by_name(r.reason.rsplit("see ", 1)[-1])
        return None if target is None or target is r else target

    def _on_top_verdict(self, target: Result) -> str | None:
        """The compile row's word: what compile did on top of the configuration it was measured on
        (``target``'s ratio to it), not the speed of that configuration against plain."""
        ratio, ref = target.vs_current, target.vs_current_name
        if target.status != "measured" or not ref or not _measured(ratio):
            return None
        if not self._drift_ok(target):
            return "drifts"
        m = self._margin(target.vs_current_half_ci)
        if ratio < 1 - m:
            return f"faster than {ref}"
        return f"slower than {ref}" if ratio > 1 + m else f"no measurable change on top of {ref}"

    def _explain_chosen(self, r: Result) -> tuple[str, str, str] | None:
        """The recommendation, or a trick it switches on."""
        best = self.best_throughput
        if r is best:
            return "recommended", self._why_best(r), ""
        if self._a_trick(best) and r.changes and r.changes.items() <= best.changes.items():
            return "part of the recommendation", f"switched on as part of {best.name}, the recommendation", ""
        return None

    def _explain_ruled_out(self, r: Result) -> tuple[str, str, str] | None:
        """Out before its speed counts: far slower in a probe, a loss that drifts, or over the memory limit."""
        if r.status == "measured (probe)":
            return "not recommended", r.reason or "far slower than the plain step in a probe", self._native_advice(r)
        if not self._drift_ok(r):
            tolerance = f"{self.drift_tolerance.get('loss', 0):.0%}"
            return "not recommended", f"{self._drift_text(r)}, beyond the {tolerance} tolerance", ""
        if self._over_limit(r):
            return ("not recommended", f"its peak {_bytes(r.peak_bytes)} is over the memory limit "
                    f"{_bytes(self.memory_limit)} ({self.memory_limit_source})",
                    "a smaller --batch, or a larger --memory-limit")
        return None

    def _drift_text(self, r: Result) -> str:
        """How far its loss drifts from fp32's (or that it is not finite)."""
        n = len(self.baseline.losses) if self.baseline else 0
        if not math.isfinite(r.loss_drift):
            return "its loss is not finite"
        return f"its loss drifts {r.loss_drift:.1%} from fp32's over {n} steps (relative to the first fp32 loss)"

    def _explain_memory_only(self, r: Result) -> tuple[str, str, str] | None:
        """A row measured for memory only: the largest-batch configuration, or not timed."""
        if r.status != "measured (memory)":
            return None
        if r is self.best_batch:
            return ("largest batch", f"the configuration that fits the most samples under the memory limit "
                    f"({r.max_batch}, a step run at that batch{_bound_text(r)}): tricks-largest-batch.toml; memory "
                    "only, not timed", "")
        return "not recommended", r.verdict or "memory only: not timed", ""

    def _explain_goal(self, r: Result) -> tuple[str, str, str] | None:
        """A cost or memory trick while the plain step fits: not a throughput choice, whatever its speed."""
        if not self._plain_fits():
            return None
        if r.goal == "cost":
            return _explain_cost_trick(r)
        if r.goal == "memory":
            return self._explain_memory_trick(r)
        return None

    def _explain_memory_trick(self, r: Result) -> tuple[str, str, str]:
        bb = self.best_batch
        in_bb = self._a_trick(bb) and r.changes.items() <= bb.changes.items()
        where = ("; it is in the largest-batch configuration (tricks-largest-batch.toml)" if in_bb else "")
        return ("not recommended", "a memory trick: not a throughput choice while the plain step fits under the "
                f"memory limit{where}", "" if in_bb else
                "it is chosen where the plain step does not fit: a larger --batch or a lower --memory-limit")

    def _explain_speed(self, r: Result) -> tuple[str, str, str]:
        """The verdict of a timed candidate that is not the recommendation: against plain, against what
        it extends, the price of compile, then against the best (:meth:`_explain_against_best`)."""
        if not _measured(r.ratio):
            return ("not recommended", r.left_reason or "not timed: its race ran no round with it",
                    "raise --budget-seconds")
        pb = self._compile_payback(r)
        cost = self._compile_cost(pb)
        return (self._explain_against_plain(r, cost) or self._explain_against_extended(r, cost)
                or self._explain_compile_price(r, pb) or self._explain_extension(r) or self._explain_against_best(r))

    def _compile_cost(self, pb: dict[str, Any] | None) -> str:
        """'; what compilation costs and when it pays back' where it costs anything, else ''."""
        return f"; {self._payback_text(pb)}" if pb and pb["steps"] != 0 else ""

    def _explain_against_plain(self, r: Result, cost: str) -> tuple[str, str, str] | None:
        """Every candidate's first question: not faster than plain (slower, or inside its noise)."""
        m = self._margin(r.ratio_half_ci)
        if r.ratio < 1 - m:
            return None
        if r.ratio > 1 + m:
            return "not recommended", f"slower than plain: {_speed_of(r.ratio, r.ratio_half_ci, 'plain')}", ""
        return ("not recommended", f"inside the noise of plain: {_speed_of(r.ratio, r.ratio_half_ci, 'plain')}; "
                f"{self._the_margin(r.ratio_half_ci)}{cost}", self._open_advice(r))

    def _explain_against_extended(self, r: Result, cost: str) -> tuple[str, str, str] | None:
        """Faster than plain, but not beyond the noise of what it extends (a combination, compile on top)."""
        ref, ratio, half = r.vs_current_name, r.vs_current, r.vs_current_half_ci
        if not ref:
            return None
        if not _measured(ratio):
            return "not recommended", f"not compared with {ref}, which it extends", ""
        m = self._margin(half)
        if ratio < 1 - m:
            return None
        if ratio > 1 + m:
            return "not recommended", f"slower than {ref}, which it extends: {_speed_of(ratio, half, ref)}{cost}", ""
        reaches = _measured(half) and ratio - half <= 1 <= ratio + half
        overlap = " (its interval reaches 1.00x: the two overlap)" if reaches else ""
        return ("not recommended", f"inside the noise of {ref}, which it extends: {_speed_of(ratio, half, ref)}"
                f"{overlap}; {self._the_margin(half)}{cost}", self._open_advice(r))

    def _explain_compile_price(self, r: Result, pb: dict[str, Any] | None) -> tuple[str, str, str] | None:
        """Compile, faster, but a bet under a tight memory limit or not paid back within the run."""
        if r.changes.get("compile") and not self._plain_fits():
            return ("not recommended", "its memory is not measured under compile and the plain step does not fit "
                    "the memory limit: no bet under a tight limit", "a larger --memory-limit, or a smaller --batch")
        if pb is None or self.amortised(r) is not False:
            return None
        n = pb["steps"]
        advice = (f"a run of at least {n:,} steps, said to the tune (--steps {n} or more; tune(steps=...)); "
                  "shorter runs: keep compile off" if n is not None else "")
        return ("not recommended", f"compile not amortised within {self._run_text()}: {self._payback_text(pb)}",
                advice)

    def _explain_extension(self, r: Result) -> tuple[str, str, str] | None:
        """A faster combination (or compile on top) that the recommendation is not."""
        if not (r.vs_current_name or _among(r, self.combos)):
            return None
        best, ref = self.best_throughput, r.vs_current_name or "plain"
        speed = (_speed_of(r.vs_current, r.vs_current_half_ci, ref) if r.vs_current_name
                 else _speed_of(r.ratio, r.ratio_half_ci, ref))
        if r.race == "joint" and best is not None:
            return "not recommended", self._joint_loser(r, best, ref, speed), ""
        if best is not None and best.name != ref:
            return ("not recommended", f"faster than {ref}, which it extends: {speed}, but the recommendation (after "
                    f"more rounds) is {best.name}, on top of which it was not measured",
                    "raise --budget-seconds (a longer tune settles the best first)")
        return "not recommended", f"faster than {ref}: {speed}, but {best.name if best else 'plain'} was kept", ""

    def _joint_loser(self, r: Result, best: Result, ref: str, speed: str) -> str:
        """A combination of the joint race, faster than what it extends, that is not the pick: why."""
        if r.changes.items() < best.changes.items():
            extra = ", ".join(sorted(set(best.changes) - set(r.changes)))
            return (f"faster than {ref}, which it extends: {speed}; {best.name} adds {extra} and is faster still, "
                    "beyond the margin, in the same race")
        return (f"faster than {ref}, which it extends: {speed}, but {best.name} was faster in the same race (the "
                "combinations raced jointly; the pick is the fastest, made simpler while a part of it is as fast)")

    def _explain_against_best(self, r: Result) -> tuple[str, str, str]:
        """A single trick, faster than plain but not the fastest: why the best was kept instead."""
        best = self.best_throughput
        if not self._a_trick(best):
            return ("not recommended", "faster than plain, but the plain step is kept: "
                    + ("see the notes" if self._plain_fits()
                       else "it does not fit the memory limit, and no configuration tried does"), "")
        than = _than_best(r, best)
        shared = sorted(set(r.changes) & set(best.changes))
        if shared:
            return "not recommended", f"{than}; the two cannot be combined (both set {', '.join(shared)})", ""
        pair = self._combination_on_top(r)
        if pair is not None:
            _, why, advice = self._explain(pair)
            return "not recommended", f"{than}; on top of {pair.vs_current_name} ({pair.name}): {why}", advice
        if self._noted(f"with {r.name} not tried: over --budget-seconds"):
            return ("not recommended", f"{than}; its combination with {best.name} was not tried: over --budget-seconds",
                    "raise --budget-seconds")
        return "not recommended", f"{than}; its combination with {best.name} was not measured", ""

    def _combination_on_top(self, r: Result) -> Result | None:
        """A combination that measured ``r``'s changes on top of what it extends (with compile only if ``r`` has it)."""
        return next((c for c in self.combos if c is not r and c.vs_current_name
                     and r.changes.items() <= c.changes.items()
                     and (not c.changes.get("compile") or r.changes.get("compile"))), None)

    def _noted(self, text: str) -> bool:
        return any(text in n for n in self.notes)

    def _why_best(self, r: Result) -> str:
        b = self.baseline
        if not self._plain_fits():
            why = (f"the fastest configuration tried that fits the memory limit: peak {_bytes(r.peak_bytes)} of "
                   f"{_bytes(self.memory_limit)}, where the plain step needs {_bytes(b.peak_bytes)}")
            if _measured(r.ratio):
                why += f"; {_speed_of(r.ratio, r.ratio_half_ci, 'plain')}"
        elif r.vs_current_name:
            why = (f"faster than {r.vs_current_name}, which it extends, beyond the margin: "
                   f"{_speed_of(r.vs_current, r.vs_current_half_ci, r.vs_current_name)}")
        else:
            why = (f"the fastest, faster than plain beyond the margin: {_speed_of(r.ratio, r.ratio_half_ci, 'plain')}"
                   f" ({self._the_margin(r.ratio_half_ci)})")
        pb = self._compile_payback(r)
        if pb is not None:
            why += f"; {self._payback_text(pb)}" + (f", within {self._run_text()}" if self.amortised(r) else "")
        return why

    def _explain_baseline(self) -> tuple[str, str, str]:
        b, best = self.baseline, self.best_throughput
        if not self._a_trick(best):
            return self._explain_plain_kept()
        if self._over_limit(b):
            return ("reference", f"its peak {_bytes(b.peak_bytes)} is over the memory limit "
                    f"{_bytes(self.memory_limit)}; {self.fits_with or best.name} fits", "")
        return ("reference", f"the step every speed-up is measured against; {best.name} is faster: "
                f"{_speedup(best)}", "")

    def _explain_plain_kept(self) -> tuple[str, str, str]:
        """The plain step as the recommendation: why nothing beat it."""
        b = self.baseline
        if self._over_limit(b):
            return ("recommended", f"nothing tried fits the memory limit {_bytes(self.memory_limit)}: the plain "
                    f"step (peak {_bytes(b.peak_bytes)}) is written, and it does not fit either",
                    "a smaller --batch, or a larger --memory-limit")
        if not self._any_measured():
            if any("--budget-seconds" in r.reason for r in self.results):
                return "recommended", "no trick was measured: over --budget-seconds", "raise --budget-seconds"
            return "recommended", "no trick was measured (each row says why)", ""
        return ("recommended", f"no trick is faster beyond the margin here (±{self._margin(None):.1%}: the "
                f"noise {_noise(self.noise)} or {self.min_effect:.0%}): keep the plain step", "")

    def _native_advice(self, r: Result) -> str:
        p = r.changes.get("precision")
        if p and self.device.startswith("cpu"):
            return (f"a device with native {p}: a CUDA GPU" + (", or a CPU with AVX512-BF16 or AMX" if p == "bf16"
                                                               else ""))
        return ""

    def _skip_advice(self, name: str, kind: str, reason: str, status: str) -> str:
        """What would get a skipped (or failed) trick measured; '' when nothing in the tune would."""
        trick = name.split(":")[0]
        if "left out by the caller" in reason:
            return f"drop --skip {trick} (skip=...) to measure it"
        if status == "failed":
            return f"what raised is the reason: fix it in the model, or leave the trick out (--skip {trick})"
        if "--budget-seconds" in reason:
            return "raise --budget-seconds"
        missing = self._missing_part(trick, kind, reason)
        if missing is not None:
            return "" if missing[0] else missing[1]
        if "cuda" in reason.lower() and not self.device.startswith("cuda"):
            return "tune on a CUDA GPU (--device cuda)"
        return _advice_in(reason)

    def _missing_part(self, trick: str, kind: str, reason: str) -> tuple[Any, str] | None:
        """(what this tune measured of the part the trick belongs to, the option that measures it) for a trick
        skipped because a part of the tune did not run (data, deploy, distributed); None for any other trick."""
        if kind == "data" and "--data" in reason:
            return self.data, "pass --data PATH to measure it"
        if kind == "deploy" and "--deploy" in reason:
            return self.deploy, "pass --deploy to measure it"
        if trick in ("ddp", "zero1", "fsdp"):
            return self.distributed, "tune with --processes N (or under torchrun) to measure it"
        return None


def _verdict(r: Result) -> dict[str, Any]:
    return _verdict_entry(r.name, r.verdict or r.status, r.decision, r.why, r.advice)


def _verdict_entry(name: str, verdict: str, decision: str, reason: str, advice: str) -> dict[str, Any]:
    return {"name": name, "verdict": verdict, "decision": decision, "reason": reason, "advice": advice}


def _explain_cost_trick(r: Result) -> tuple[str, str, str]:
    cost = f" (its step: {_speedup(r)} the plain one)" if r.speedup else ""
    keys = ", ".join(f"{k} = {_toml_value(v)}" for k, v in r.changes.items())
    return ("not recommended", f"a cost trick, switched on for what it gives, not for speed{cost}",
            f"switch it on yourself if you want it ({keys} in tricks.toml)")


def _than_best(r: Result, best: Result) -> str:
    """Why ``best`` was kept rather than ``r``, as far as their speed-ups say."""
    if best.speedup is None:
        return f"{best.name} was chosen"
    if _overlap(r, best):
        return (f"inside the noise of {best.name}, the best: {_speedup(r)} against {_speedup(best)} the plain step "
                "(overlapping intervals); the tune keeps the faster median")
    return f"{best.name} is faster: {_speedup(best)} against {_speedup(r)} the plain step"


def _overlap(a: Result, b: Result) -> bool:
    """Whether the speed-up intervals of ``a`` and ``b`` (each against plain) overlap."""
    if a.speedup is None or b.speedup is None:
        return False
    return abs(a.speedup - b.speedup) <= (a.speedup_half_ci or 0.0) + (b.speedup_half_ci or 0.0)


def _speed_of(ratio: float | None, half: float | None, ref: str) -> str:
    """A time ratio and its half-interval as a speed against ``ref`` with its ~95% interval:
    (0.8, 0.05, 'plain') -> '1.25x the speed of plain (95% interval 1.18-1.33x)'."""
    if not _measured(ratio) or not ratio > 0:
        return "n/a"
    if not _measured(half):
        return f"{1 / ratio:.2f}x the speed of {ref}"
    hi = f"{1 / (ratio - half):.2f}x" if ratio > half else "inf"
    return f"{1 / ratio:.2f}x the speed of {ref} (95% interval {1 / (ratio + half):.2f}-{hi})"


def _noise(noise: float) -> str:
    return "n/a" if noise is None or math.isnan(noise) else f"±{noise:.1%}"


def _among(r: Result, rows: list[Result]) -> bool:
    return any(x is r for x in rows)


def _advice_in(reason: str) -> str:
    """The clause of a reason that says what to do ("...: install one (...)"), or ''."""
    for clause in reason.split(": ")[1:]:
        if clause.startswith(("install ", "pip install", "export ", "use ")):
            return clause
    return ""

