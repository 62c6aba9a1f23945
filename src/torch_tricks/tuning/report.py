"""The tune report: what was measured, what to switch on, and the files that say so.

``write(out_dir)`` writes ``report.md``, ``report.json``, ``report.png`` (one bar per
trick: speed-up and memory against plain fp32, the chosen configuration marked) and
``tricks.toml`` — the recommended :class:`~torch_tricks.train.TrainConfig` keys, which
``torch-tricks train --config tricks.toml`` and ``fit(config="tricks.toml")`` take as
they are — plus ``tricks-largest-batch.toml`` for the configuration that fits the most
samples per step. Every figure comes from the run that made the report; a figure that
was not measured is absent (``null``), never filled in.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_tricks._format import human_bytes, table
from torch_tricks._io import atomic_path
from torch_tricks._optional import available, install_hint
from torch_tricks.train.config import TrainConfig
from torch_tricks.tuning.efficiency import Efficiency
from torch_tricks.tuning.race import margin
from torch_tricks.tuning.record import model_table

__all__ = ["Result", "TuneReport"]

# The two ways to use a tune's result, shown in tricks.toml's header and report.md.
# The config keys the tuner decides; tricks.toml states those of the tricks it measured (issue 34: no others).
TUNED_KEYS = ("precision", "channels_last", "checkpointing", "compile", "fused_optimizer", "inplace",
              "memory_efficient_bn", "accumulate", "cudnn_benchmark", "ema", "deterministic", "chunked_lm_loss",
              "optimizer_in_backward", "offload_activations")

HOW_TO_APPLY = """\
use it: torch-tricks train --config tricks.toml     or     fit(model, data, config="tricks.toml")
or keep your own loop:
    tricks = torch_tricks.Tricks("tricks.toml")
    model, optimizer = tricks.prepare(model, optimizer)   # or tricks.prepare(model): the config's optimizer
    for batch in loader:
        batch = tricks.to_device(batch)                    # the config's device (auto: CUDA where there is one)
        with tricks.autocast():
            loss = model(**batch).loss                     # or loss_fn(model(x), y)
        tricks.backward(loss)
        tricks.step()
"""


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


@dataclass
class TuneReport:
    """Everything one tune measured and decided."""

    model: str
    batch: int
    device: str
    optimizer: str
    memory_limit: int
    memory_limit_source: str
    budget_s: float
    inputs: list[list[int]] = field(default_factory=list)
    baseline: Result | None = None
    results: list[Result] = field(default_factory=list)
    combos: list[Result] = field(default_factory=list)
    skipped: list[Any] = field(default_factory=list)
    best_throughput: Result | None = None
    best_batch: Result | None = None
    fits_with: str | None = None  # when the plain step is over the memory limit: what fits
    seq_positions: int | None = None  # --fit seq: the model's positions (the longest sequence searched)
    noise: float = math.nan  # relative: the A/A disagreement of the plain step with itself
    aa_ratio: float = math.nan  # plain (again) / plain, median of per-round ratios
    aa_half_ci: float = math.nan
    aa_grad_drift: float | None = None  # plain vs plain again: the drift floor (run-to-run differences)
    aa_loss_drift: float | None = None
    min_effect: float = 0.02
    rounds: int = 0  # rounds of the race of the single tricks (the baseline and its A/A twin got every one)
    stop_reason: str = ""  # "settled: ..." (every question answered), "budget: ..." (what was still open), "cap: ..."
    phase_s: dict[str, float] = field(default_factory=dict)  # wall seconds per phase (set-up, race, ...)
    drift_tolerance: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] | None = None
    deploy: dict[str, Any] | None = None
    efficiency: dict[str, Any] | None = None  # MFU of plain and the recommendation (status, figures, or why not)
    emit: dict[str, Any] | None = None  # tune --emit: {"target", "title", "lines"} of the trainer it applies to
    elapsed_s: float = 0.0
    own_optimizer: bool = False  # the caller's optimizer_fn: tricks.toml then names no optimizer
    distributed: dict[str, Any] | None = None  # the ddp/zero1/fsdp rows (tune --processes N, or under torchrun)
    run_steps: int | None = None  # the training run's optimizer steps a one-off cost (compile) must pay back within
    run_steps_source: str = ""  # "given" (tune(steps=...)) or "assumed"
    model_record: dict[str, Any] | None = None  # what the tune ran on (tricks.toml's [model]; see tuning.record)

    # -- the recommended configuration ------------------------------------------------------
    def recommended_config(self, which: str = "throughput") -> dict[str, Any]:
        """The TrainConfig keys the tune decided for the chosen configuration, and no others.

        Each switch of the chosen configuration, and of each speed trick it measured (as the
        plain step had it, where not chosen); the optimizer where the tune's was not the default adamw, or a
        decided key needs it; ``batch_size`` where the configuration changes the loader batch
        (accumulation, ranks, the largest batch): the tuned batch divided by ``accumulate``, so
        the effective batch is the one measured. A key not decided is not written, so a trainer
        given the file keeps its own value (issue 34).
        """
        best = self.best_throughput if which == "throughput" else self.best_batch
        chosen = best.changes if best else {}
        plain = _plain_switches()
        cfg = {k: plain[k] for k in TUNED_KEYS if k in self._decided_keys()}
        cfg.update(chosen)
        if not self.own_optimizer and (self.optimizer != TrainConfig.optimizer or cfg.get("optimizer_state")):
            cfg["optimizer"] = self.optimizer
        batch = self._tuned_batch(which, best)
        mode = self.distributed_choice() if which == "throughput" else None
        if mode is not None:  # fit's batch_size is per rank: the ranks together take the tuned global batch
            cfg["distributed"], batch = self._distributed_setting(mode, batch)
        loader_batch = max(batch // int(cfg.get("accumulate", 1)), 1)
        if loader_batch != self.batch:
            cfg["batch_size"] = loader_batch
        return cfg

    def _decided_keys(self) -> set[str]:
        """The keys of the speed tricks measured, chosen or not: the tune's answer to "is it faster here" stands
        either way. A memory or cost trick left off is not a decision about your run (your own checkpointing for a
        larger batch, your EMA, your determinism stay yours): it is written only when chosen."""
        return {k for r in self.results + self.combos if r.goal == "speed" and r.status.startswith("measured")
                for k in r.changes if k in TUNED_KEYS}

    def _tuned_batch(self, which: str, best: Result | None) -> int:
        """The batch measured, or for the largest-batch configuration the largest batch that ran under the limit."""
        if which == "throughput" or not (best and best.max_batch):
            return self.batch
        return best.max_batch

    def _distributed_setting(self, mode: str, batch: int) -> tuple[str, int]:
        """(the config's ``distributed`` value, the per-rank batch) for the recommended distributed ``mode``."""
        if mode == "one process":
            return "off", batch
        return mode, batch // int(self.distributed["processes"])

    def distributed_choice(self) -> str | None:
        """The distributed rows' recommendation: a mode, ``"one process"``, or None (not measured)."""
        d = self.distributed
        if not d or d.get("status") != "measured":
            return None
        return d.get("recommended")

    def recommended_tricks(self, which: str = "throughput") -> list[str]:
        """The switches the recommendation turns on (``key=value`` for non-boolean ones)."""
        cfg = self.recommended_config(which)
        plain = _plain_switches()
        out = [k if cfg[k] is True else f"{k}={cfg[k]}" for k in TUNED_KEYS if cfg.get(k, plain[k]) != plain[k]]
        if cfg.get("distributed") not in (None, "off"):
            out.append(f"distributed={cfg['distributed']}")
        return out

    def tricks_toml(self, which: str = "throughput") -> str:
        self.explain()
        cfg = self.recommended_config(which)
        on = self.recommended_tricks(which)
        head = f"# torch-tricks tune: {self.model}, batch {self.batch}, {self.device}, {self.optimizer}"
        lines = [head, f"# chosen for {self._chosen_for(which)}",
                 f"# switched on: {', '.join(on) if on else 'nothing'}; [train] holds only the keys the tune "
                 "decided (a trainer keeps its own value of any other)",
                 *self._distributed_header(which),
                 *(self._toml_reasons() if which == "throughput" else []),
                 *("# " + line if line else "#" for line in HOW_TO_APPLY.splitlines()),
                 "[train]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in cfg.items()]
        lines += model_table(self.model_record, self.model)  # after [train]: load_config reads [train] only
        return "\n".join(lines) + "\n"

    def _chosen_for(self, which: str) -> str:
        """'what it is chosen for: the configuration' (throughput, or the largest batch), for tricks.toml's header."""
        if which != "throughput":
            return self._chosen_for_batch()
        best = self.best_throughput
        if self._a_trick(best):
            what = best.name + (f" ({best.speedup:.2f}x the plain step)" if best.speedup else "")
        elif self._any_measured():
            what = "the plain fp32 step (no trick was faster beyond the noise)"
        else:
            what = "the plain fp32 step (no trick was measured: over --budget-seconds)"
        return f"throughput under the memory limit: {what}"

    def _chosen_for_batch(self) -> str:
        best = self.best_batch
        return "the largest batch under the memory limit: " + (best.name if best else "plain") + (
            f"; batch_size {best.max_batch} ran a step under the limit{_bound_text(best)}"
            if best and best.max_batch else "")

    def _toml_reasons(self) -> list[str]:
        """Comment lines: every trick's verdict with its reason, and what would change it."""
        out = ["# why each trick is or is not switched on (report.md has the figures):"]
        for v in self.verdicts(compact=True):
            if v["decision"] == "noise":
                continue
            head = v["name"] + (f": {v['decision']}" if v["verdict"] == v["decision"]
                                else f" ({v['verdict']}): {v['decision']}")
            out.append("#   " + _one_line(_with_advice(f"{head}: {v['reason']}", v["advice"])))
        return out

    def _distributed_header(self, which: str) -> list[str]:
        mode = self.distributed_choice() if which == "throughput" else None
        if mode is None:
            return []
        n = int(self.distributed["processes"])
        if mode == "one process":
            return [f"# distributed: one process beat ddp/zero1/fsdp on {n} processes here: distributed = off"]
        return [f"# distributed: {mode} on {n} processes: launch with `torchrun --nproc_per_node {n} ...`; "
                f"batch_size is per rank ({n} x {self.batch // n} = the tuned global batch {self.batch})"]

    DIST_HEADERS = ["mode", "ranks", "batch/rank", "step", "samples/s", "vs one process", "scaling eff.",
                    "peak/rank", "state/rank", "params / grads / optimizer per rank", "loss drift", "verdict"]

    def distributed_rows(self) -> list[list[str]]:
        """Rows of the distributed table: the two references, then each mode."""
        d = self.distributed or {}
        return [_distributed_row(r, d.get("recommended") == r["name"]) for r in d.get("rows", [])]

    def distributed_lines(self) -> list[str]:
        d = self.distributed
        if not d:
            return []
        n = d.get("processes")
        if d.get("status") != "measured":
            return [f"distributed ({n} processes): {d.get('status')}: {d.get('reason', '')}"]
        where = _distributed_where(d)
        on = _changes_text(d.get("changes") or {})
        lines = [f"distributed: {n} processes ({d.get('launched_by', '')}; {where}), global batch "
                 f"{d.get('global_batch')} = {n} x {d.get('per_rank_batch')}, with {on}; {d.get('rounds')} "
                 f"interleaved rounds{' (settled)' if d.get('settled') else ''}; per-rank memory limit {_bytes(d.get('memory_limit_per_rank'))}"]
        if d.get("recommended"):
            lines.append(f"distributed: recommended {d['recommended']}: {d.get('why', '')}")
        lines += [f"note: {x}" for x in d.get("notes", [])]
        return lines

    # -- why: every verdict's reason ---------------------------------------------------------
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
        if best is not None and best.name != ref:
            return ("not recommended", f"faster than {ref}, which it extends: {speed}, but the recommendation (after "
                    f"more rounds) is {best.name}, on top of which it was not measured",
                    "raise --budget-seconds (a longer tune settles the best first)")
        return "not recommended", f"faster than {ref}: {speed}, but {best.name if best else 'plain'} was kept", ""

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

    # -- views --------------------------------------------------------------------------------
    HEADERS = ["trick", "ids", "goal", "speed-up", "rounds", "step", "peak memory", "activations", "max batch",
               "drift grad / loss", "verdict"]

    def rows(self, compact: bool = False) -> list[list[str]]:
        """Table rows: baseline, its A/A twin, each trick, each combination, each skipped trick; the
        verdict column gives each its reason and what would change it (see :meth:`explain`).

        ``compact``: data and deploy tricks skipped for the same reason share one row.
        """
        self.explain()
        out = []
        if self.baseline:
            out.append(self._row(self.baseline))
            if not math.isnan(self.aa_ratio):
                out.append(self._aa_row())
        out += [self._row(r) for r in self.results + self.combos]
        return out + [self._skipped_row(*row) for row in self._skipped_rows(compact)]

    def _aa_row(self) -> list[str]:
        """The plain step against itself: the noise."""
        aa = Result("plain again (A/A)", "noise", {}, (), grad_drift=self.aa_grad_drift, loss_drift=self.aa_loss_drift)
        return ["plain again (A/A)", "", "noise", f"{1 / self.aa_ratio:.2f}x ±{self.aa_half_ci:.2f}",
                str(self.rounds), "", "", "", "", _drift(aa), "the noise: identical steps"]

    def _skipped_row(self, folded: bool, kind: str, status: str, reason: str, items: list[Any]) -> list[str]:
        advice = self._skip_advice(items[0].name, kind, reason, status)
        if folded:
            return [f"{len(items)} {kind} tricks", "", kind, "", "", "", "", "", "", "",
                    _with_advice(f"skipped: {reason}: {', '.join(s.name for s in items)}", advice)]
        return [items[0].name, ",".join(items[0].ids), kind, "", "", "", "", "", "", "",
                _with_advice(f"{status}: {reason}", advice)]

    def _row(self, r: Result) -> list[str]:
        verdict = f"{r.status}: {r.reason}" if r.status in ("skipped", "failed") else _verdict_cell(r)
        return [r.name, ",".join(r.ids), r.goal, _speedup(r), _rounds(r), _fmt_s(r.step_s), _bytes(r.peak_bytes),
                _bytes(r.activation_bytes), _maxb(r), _drift(r), _with_advice(verdict, r.advice)]

    def summary_lines(self) -> list[str]:
        """The lines under the table, in order: the set-up and the race, what to switch on and what it
        costs, memory, notes, the distributed rows, data and deploy, then how to apply it and the time."""
        lines = self._setup_lines() + self._race_lines() + self._baseline_lines() + self._throughput_lines()
        self.explain()
        lines += self._compile_lines() + self._faster_not_recommended_lines() + self._run_length_lines()
        lines += self._efficiency_lines()
        lines += self._memory_lines() + [f"note: {n}" for n in self.notes] + self.distributed_lines()
        lines += self._data_lines() + self._deploy_lines()
        return lines + [self._tricks_toml_line(), self._time_line()]

    def _setup_lines(self) -> list[str]:
        """What was tuned, and the rule a verdict follows."""
        noise = "n/a" if math.isnan(self.noise) else f"±{self.noise:.1%}"
        return [f"{self.model}: batch {self.batch}, input {self.inputs}, {self.device}, {self.optimizer}; "
                f"memory limit {human_bytes(self.memory_limit)} ({self.memory_limit_source})",
                f"{self.rounds} interleaved rounds; noise {noise} (plain vs plain, A/A); a trick is called faster or "
                f"slower only beyond the larger of the noise, its own 95% interval and {self.min_effect:.0%}"]

    def _race_lines(self) -> list[str]:
        """Who left the race early, and why it stopped."""
        lines = [self._race_line()] if self.rounds else []
        if self.stop_reason:
            lines.append(f"stopped: {self.stop_reason}")
        return lines

    def _race_line(self) -> str:
        left = [r for r in self.results if _left_early(r)]
        timed = sum(1 for r in self.results if r.rounds)
        if left:
            return (f"race: {len(left)} of {timed} tricks left it early, once their question was answered "
                    f"(after {_span_rounds(left)} rounds; each row says why); the others and both baselines "
                    f"got all {self.rounds} rounds")
        return f"race: all {timed} tricks and both baselines got all {self.rounds} rounds"

    def _efficiency_lines(self) -> list[str]:
        """MFU of plain and of the recommendation against this machine's peak, or why it was not measured."""
        e = self.efficiency
        if not e:
            return []
        if e.get("status") != "measured":
            return [f"MFU not measured: {e.get('reason', '')}"]
        return _efficiency_view(e)

    def _baseline_lines(self) -> list[str]:
        """The plain fp32 step's time and memory."""
        b = self.baseline
        if not (b and b.step_s):
            return []
        return [f"plain fp32 step: {_fmt_s(b.step_s)}" + (
            f", peak {_bytes(b.peak_bytes)} (state {_bytes(b.state_bytes)}, activations "
            f"{_bytes(b.activation_bytes)})" if b.peak_bytes else " (memory not measured)")]

    def _throughput_lines(self) -> list[str]:
        """The throughput choice, against the plain step."""
        b, bt = self.baseline, self.best_throughput
        if bt is None:
            return []
        if bt is b and not self._any_measured():
            return ["throughput: no trick was measured: keep the plain step until a longer tune says more"]
        if bt is b:
            return ["throughput: no trick is faster beyond the noise here: keep the plain step"]
        return [f"throughput: {bt.name}: {_speedup(bt)} the plain step"
                + (f", peak {_bytes(bt.peak_bytes)}" if bt.peak_bytes else "")]

    def _compile_lines(self) -> list[str]:
        """Each compiled row's first call, and when its compilation pays back."""
        return [f"compile ({r.name}): first call {r.first_call_s:.1f} s (compilation), apart from the "
                f"step times{self._pays_back_text(r)}; its memory is not measured (the eager figures do not apply)"
                for r in self.results + self.combos
                if _timed_compiled(r) and r.first_call_s is not None]

    def _pays_back_text(self, r: Result) -> str:
        """'; against REF it pays back after N steps, within the run' (or never), from :meth:`payback`."""
        pb = self.payback(r)
        if pb is None or pb["steps"] == 0:
            return ""
        if pb["steps"] is None:
            return f"; its step is not faster than {pb['ref']}'s: it never pays back"
        ok = self.amortised(r)
        return (f"; against {pb['ref']} it pays back after {pb['steps']:,} steps"
                + ("" if ok is None else f", {'within' if ok else 'beyond'} {self._run_text()}"))

    def _faster_not_recommended_lines(self) -> list[str]:
        """Each faster row that was not recommended, with its reason (the compile row: see its +compile one)."""
        return [f"faster, not recommended: {r.name}: {r.why}" for r in self.results + self.combos
                if r.verdict.startswith("faster") and r.decision == "not recommended"
                and not r.reason.startswith("measured on top of")]

    def _run_length_lines(self) -> list[str]:
        """The run a compilation must pay back within, where anything was compiled."""
        compiled = any(_timed_compiled(r) for r in self.combos + self.results)
        if not (self.run_steps and compiled):
            return []
        return [f"run length: {self.run_steps:,} steps ({self.run_steps_source or 'assumed'}): compile is "
                "recommended only where its compilation pays back within it"
                + ("" if self.run_steps_source == "given" else "; say yours with --steps N or tune(steps=N)")]

    def _memory_lines(self) -> list[str]:
        """What fits when the plain step does not, and the largest batch under the limit."""
        bb, lines = self.best_batch, []
        if self.fits_with:
            lines.append(f"memory: the plain step does not fit under the limit; it fits with {self.fits_with}")
        if bb is not None and bb.max_batch is not None:
            lines.append(self._largest_batch_line(bb))
        if self.baseline is not None and self.baseline.max_seq is not None:
            lines.append(self._longest_seq_line())
        return lines

    def _longest_seq_line(self) -> str:
        """--fit seq: plain's longest sequence and the recommendation's, both run, and their ratio."""
        b, cap = self.baseline, self.seq_positions
        parts, seen = [f"plain {b.max_seq}{_seq_bound_text(b, cap)}"], [b]
        for r, role in ((self.best_throughput, "recommended"), (self.best_batch, "memory tricks together")):
            if r is not None and r.max_seq is not None and all(r is not x for x in seen):
                seen.append(r)
                ratio = f", {r.max_seq / b.max_seq:.2f}x plain's" if b.max_seq else ""
                parts.append(f"{r.name} ({role}) {r.max_seq}{_seq_bound_text(r, cap)}{ratio}")
        return ("longest sequence under the limit: " + "; ".join(parts)
                + " (each a step run at that length, its peak measured)")

    def _largest_batch_line(self, bb: Result) -> str:
        b = self.baseline
        return (f"largest batch under the limit: {bb.max_batch} with {bb.name}{_bound_text(bb)}"
                + (f" (plain: {b.max_batch}{_bound_text(b)})" if b and b.max_batch is not None and bb is not b else "")
                + " (each a step run at that batch, its peak measured)")

    def _data_lines(self) -> list[str]:
        if not self.data:
            return []
        return ["data: " + (self.data.get("summary") or f"{self.data.get('status')}: {self.data.get('reason', '')}")]

    def _deploy_lines(self) -> list[str]:
        if not self.deploy:
            return []
        return ["deploy " + "+".join(s["steps"]) + ": " + _deploy_line(s) for s in self.deploy.get("steps", [])]

    def _tricks_toml_line(self) -> str:
        """What tricks.toml switches on, and the three ways to apply it."""
        on = self.recommended_tricks("throughput") if self.baseline else []
        return (f"tricks.toml switches on: {', '.join(on) if on else 'nothing (the plain step)'}; apply it with "
                "`torch-tricks train --config tricks.toml`, fit(..., config='tricks.toml'), or in your own "
                "loop with torch_tricks.Tricks('tricks.toml') (six lines: see report.md or tricks.toml)")

    def _time_line(self) -> str:
        spent = ", ".join(f"{k} {v:.0f} s" for k, v in self.phase_s.items())
        return f"tune took {self.elapsed_s:.0f} s (budget {self.budget_s:.0f} s" + (f": {spent})" if spent else ")")

    def to_text(self) -> str:
        parts = [table(self.HEADERS, self.rows(compact=True), "llllrrrrrll"), ""]
        if self._has_distributed_rows():
            parts += [table(self.DIST_HEADERS, self.distributed_rows(), "lrrrrrrrrrrl"), ""]
        return "\n".join(parts + self.summary_lines())

    def _has_distributed_rows(self) -> bool:
        return bool(self.distributed and self.distributed.get("rows"))

    def to_dict(self) -> dict[str, Any]:
        verdicts = self.explain()
        return {
            "model": self.model, "batch": self.batch, "inputs": self.inputs, "device": self.device,
            "optimizer": self.optimizer, "memory_limit": self.memory_limit,
            "memory_limit_source": self.memory_limit_source, "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s, "rounds": self.rounds, "stop_reason": self.stop_reason,
            "phase_s": self.phase_s,
            "noise": _num(self.noise), "aa_ratio": _num(self.aa_ratio), "aa_half_ci": _num(self.aa_half_ci),
            "aa_grad_drift": self.aa_grad_drift, "aa_loss_drift": self.aa_loss_drift,
            "min_effect": self.min_effect, "drift_tolerance": self.drift_tolerance,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "results": [r.to_dict() for r in self.results],
            "combinations": [r.to_dict() for r in self.combos],
            "skipped": [_skipped_dict(s) for s in self.skipped],
            "best_throughput": _name(self.best_throughput), "best_batch": _name(self.best_batch),
            "fits_with": self.fits_with,
            **self._recommendations(),
            "notes": self.notes, "data": self.data, "deploy": self.deploy,
            "efficiency": self.efficiency, "mfu": {k: r["mfu"] for k, r in (self.efficiency or {}).get("rows", {}).items()},
            "distributed": _finite(self.distributed),
            "run_steps": self.run_steps, "run_steps_source": self.run_steps_source,
            "model_record": self.model_record,
            "verdicts": verdicts,
        }

    def _recommendations(self) -> dict[str, Any]:
        """report.json's recommended configurations (None without a baseline: nothing to recommend against)."""
        if not self.baseline:
            return {"recommended": None, "recommended_tricks": None, "recommended_largest_batch": None}
        return {"recommended": self.recommended_config("throughput"),
                "recommended_tricks": self.recommended_tricks("throughput"),
                "recommended_largest_batch": self.recommended_config("batch")}

    def to_markdown(self) -> str:
        head = "| " + " | ".join(self.HEADERS) + " |\n|" + "---|" * len(self.HEADERS) + "\n"
        body = "".join("| " + " | ".join(c.replace("|", "/") for c in row) + " |\n" for row in self.rows())
        n_drift = len(self.baseline.losses) if self.baseline else 0
        return (f"# torch-tricks tune: {self.model}\n\n" + "\n".join(f"- {line}" for line in self.summary_lines())
                + "\n\n![speed-up and memory per trick](report.png)\n\n## Every trick\n\n" + head + body
                + "\n**Speed-up**: plain step time / the trick's, the median of per-round ratios, all steps timed "
                  "round-robin in one run (± half the ~95% interval of that median). The *plain again* row is a "
                  "second, identical plain step: its disagreement with the first is the noise. **Rounds**: the "
                  "rounds a trick was timed in; the race drops a trick once its question is answered (it cannot be "
                  f"{self.min_effect:.0%} faster, or it is faster and not the best) and gives the rounds to the "
                  "others; the verdict says when it left and why. **Peak memory**: "
                  "tensor bytes from building the model copy through two steps (weights, gradients, optimizer "
                  "state, activations, the batch). **Activations**: what one forward keeps alive for backward. "
                  "**Max batch**: the largest batch at which a step ran under the memory limit (searched for the "
                  "largest-batch configuration and plain: a bisection on real steps, bounded by the budget). "
                  f"**Drift**, against fp32 from the same seed and batch: the relative gradient difference of the "
                  f"first step (reported only: a fresh deep net's early gradients are chaotic), and the largest loss "
                  f"difference over {n_drift} steps relative to the first fp32 loss, which decides "
                  f"(tolerance {self.drift_tolerance}).\n\n"
                  + self._reasons_markdown() + self._distributed_markdown() +
                  "## Recommended config (`tricks.toml`)\n\n```toml\n" + self.tricks_toml() + "```\n\n"
                  "## How to apply it\n\n```python\n" + HOW_TO_APPLY + "```\n" + self._emit_markdown())

    def _emit_markdown(self) -> str:
        """The lines for the trainer ``tune --emit`` named (the transformers Trainer, Lightning, Accelerate)."""
        if not self.emit:
            return ""
        return (f"\n### In your {self.emit['title']} script\n\n```python\n" + "\n".join(self.emit["lines"])
                + "\n```\n")

    def _reasons_markdown(self) -> str:
        items = []
        for v in self.verdicts(compact=True):
            if v["decision"] == "noise":
                continue
            what = v["decision"] if v["verdict"] == v["decision"] else f"{v['verdict']}; {v['decision']}"
            items.append(f"- **{v['name']}** ({what}): {_one_line(v['reason'])}"
                         + (f" *What would change it:* {_one_line(v['advice'])}" if v["advice"] else ""))
        return "## Why: every verdict's reason\n\n" + "\n".join(items) + "\n\n" if items else ""

    def _distributed_markdown(self) -> str:
        if not self._has_distributed_rows():
            return ""
        h = self.DIST_HEADERS
        head = "| " + " | ".join(h) + " |\n|" + "---|" * len(h) + "\n"
        body = "".join("| " + " | ".join(c.replace("|", "/") for c in row) + " |\n" for row in self.distributed_rows())
        return ("## Distributed: ddp, zero1, fsdp\n\n![per-rank memory and throughput](report-distributed.png)\n\n"
                + head + body + "\n**vs one process**: the throughput (samples/s of the global batch) against one "
                "process training the whole global batch (± half its ~95% interval), from the median of per-round "
                "step-time ratios, every lane timed "
                "round-robin in one run, each step between two barriers. **Scaling eff.**: a rank's share of the "
                "batch alone on a rank's threads, against the mode (1.00: N ranks give N times one rank's "
                "throughput). **Peak/rank**: tensor bytes from building the lane through three steps, the largest "
                "rank's; **state/rank**: the parameters, gradients and optimizer state that rank holds (local "
                "shards). **Loss drift**: the global loss of the first three steps against one process on the same "
                "batch, relative to the first.\n\n")

    # -- files --------------------------------------------------------------------------------
    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write the report files into ``out_dir`` (each atomically); returns their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {name: out / name for name in ("report.md", "report.json", "tricks.toml", "tricks-largest-batch.toml")}
        png = self.plot(out / "report.png")  # first: a missing matplotlib adds a note the others carry
        if png is not None:
            paths["report.png"] = png
        if self._has_distributed_rows():
            dpng = self.plot_distributed(out / "report-distributed.png")
            if dpng is not None:
                paths["report-distributed.png"] = dpng
        with atomic_path(paths["report.json"]) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        with atomic_path(paths["tricks.toml"]) as tmp:
            tmp.write_text(self.tricks_toml("throughput"))
        with atomic_path(paths["tricks-largest-batch.toml"]) as tmp:
            tmp.write_text(self.tricks_toml("batch"))
        with atomic_path(paths["report.md"]) as tmp:
            tmp.write_text(self.to_markdown())
        return paths

    def plot(self, path: str | Path) -> Path | None:
        """Bars per trick: speed-up (with its interval) and peak / activation memory against plain fp32."""
        if not available("matplotlib"):
            self.notes.append(f"no plot: matplotlib is not installed ({install_hint('plot')})")
            return None
        plt = _pyplot()
        rows, chosen = self._plot_rows(), self.best_throughput
        fig, axes = plt.subplots(1, 2, figsize=(15, 0.5 * len(rows) + 2.2), sharey=True,
                                 gridspec_kw={"width_ratios": [3, 2]})
        colors = [_bar_color(r, chosen) for r in rows]
        self._plot_speed(axes[0], rows, colors)
        self._plot_memory(axes[1], rows, colors)
        _label_rows(axes[0], [r.name for r in rows], [r is chosen for r in rows])
        noise = "" if math.isnan(self.noise) else f", noise ±{self.noise:.1%}"
        fig.suptitle(f"torch-tricks tune: {self.model}, batch {self.batch}, {self.device}{noise} "
                     "(* = recommended, orange)")
        return _save_figure(fig, path)

    def _plot_rows(self) -> list[Result]:
        """The single tricks, then the timed combinations (compile on top of the best) and the chosen one."""
        rows = list(self.results)
        chosen = self.best_throughput
        extra = [r for r in self.combos if r.speedup is not None]
        extra += [chosen] if self._a_trick(chosen) else []
        for r in extra:
            if r not in rows:
                rows.append(r)
        return rows

    def _plot_speed(self, ax: Any, rows: list[Result], colors: list[str]) -> None:
        """The speed-up panel: a bar per row with its interval, the noise band, and why a row has no bar."""
        speed = [r.speedup or 0.0 for r in rows]
        err = [r.speedup_half_ci if _finite_number(r.speedup_half_ci) else 0.0 for r in rows]
        ax.barh(list(range(len(rows))), speed, xerr=err, color=colors, capsize=2)
        ax.axvline(1.0, color="k", lw=1)
        if not math.isnan(self.noise):
            band = max(self.noise, self.min_effect)
            ax.axvspan(1 - band, 1 + band, color="grey", alpha=0.25, label=f"within noise: ±{band:.0%}")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_xlabel("training-step speed-up vs plain fp32 (higher is better)")
        _label_speed_bars(ax, rows, speed, err)

    def _plot_memory(self, ax: Any, rows: list[Result], colors: list[str]) -> None:
        """The memory panel: peak and activations per row against plain fp32, and the memory limit."""
        b = self.baseline
        base_peak, base_act = (b.peak_bytes, b.activation_bytes) if b else (None, None)
        peak = [_share(r.peak_bytes, base_peak) for r in rows]
        act = [_share(r.activation_bytes, base_act) for r in rows]
        y, h = list(range(len(rows))), 0.38
        ax.barh([v - h / 2 for v in y], peak, height=h, color=colors, label="peak")
        ax.barh([v + h / 2 for v in y], act, height=h, color=colors, alpha=0.45, label="activations")
        ax.axvline(1.0, color="k", lw=1)
        self._plot_memory_limit(ax, base_peak)
        ax.set_xlabel("memory vs plain fp32 (lower is better)")
        ax.legend(loc="lower right", fontsize=8)
        _mark_unmeasured(ax, peak)

    def _plot_memory_limit(self, ax: Any, base_peak: int | None) -> None:
        """The memory limit as a line, against the plain peak, where it is in sight (under twice that peak)."""
        if base_peak and self.memory_limit < 2 * base_peak:
            ax.axvline(self.memory_limit / base_peak, color="tab:red", lw=1.5, ls="--",
                       label=f"memory limit ({human_bytes(self.memory_limit)})")

    def plot_distributed(self, path: str | Path) -> Path | None:
        """Two panels: throughput against one process (scaling efficiency on each bar), and per-rank state
        (parameters, gradients, optimizer state) with the peak and the per-rank limit."""
        if not available("matplotlib"):
            return None
        plt = _pyplot()
        d = self.distributed or {}
        rows = _measured_rows(d)
        if not rows:
            return None
        fig, axes = plt.subplots(1, 2, figsize=(13, 0.55 * len(rows) + 2.4), sharey=True)
        chosen = [d.get("recommended") == r["name"] for r in rows]
        _plot_distributed_speed(axes[0], rows, ["tab:orange" if c else "tab:blue" for c in chosen])
        _plot_distributed_memory(axes[1], rows, d.get("memory_limit_per_rank"))
        _label_rows(axes[0], [r["name"] for r in rows], chosen)
        fig.suptitle(f"torch-tricks tune: {self.model}, global batch {d.get('global_batch')} on "
                     f"{d.get('processes')} processes ({d.get('backend')}, {d.get('device')}; * = recommended)")
        return _save_figure(fig, path)


def _bar_color(r: Result, chosen: Result | None) -> str:
    """Orange for the recommendation, red for a trick that failed, blue for the others."""
    if r is chosen:
        return "tab:orange"
    return "tab:red" if r.status == "failed" else "tab:blue"


def _mark_unmeasured(ax: Any, peak: list[float]) -> None:
    """'memory not measured' on each row without a peak bar."""
    for i, p in enumerate(peak):
        if not p:
            ax.text(0.02, i, "memory not measured", va="center", fontsize=8, color="dimgray",
                    transform=ax.get_yaxis_transform())


def _changes_text(changes: dict[str, Any]) -> str:
    """'key=value, ...' of the switches the distributed rows ran with; 'the plain step' for none."""
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "the plain step"


def _distributed_where(d: dict[str, Any]) -> str:
    """The backend and device of the distributed rows (on CPU: the threads each side had)."""
    if d.get("device") == "cpu":
        return (f"{d.get('backend')}, {d.get('device')}, {d.get('threads_per_rank')} thread(s) per rank, "
                f"one process on {d.get('one_process_threads')}")
    return f"{d.get('backend')}, {d.get('device')}"


def _verdict(r: Result) -> dict[str, Any]:
    return _verdict_entry(r.name, r.verdict or r.status, r.decision, r.why, r.advice)


def _verdict_entry(name: str, verdict: str, decision: str, reason: str, advice: str) -> dict[str, Any]:
    return {"name": name, "verdict": verdict, "decision": decision, "reason": reason, "advice": advice}


def _skipped_dict(s: Any) -> dict[str, Any]:
    return {"name": s.name, "ids": list(s.ids), "kind": s.kind, "status": getattr(s, "status", "skipped"),
            "reason": s.reason}


def _name(r: Result | None) -> str | None:
    return r.name if r else None


def _label_speed_bars(ax: Any, rows: list[Result], speed: list[float], err: list[float]) -> None:
    """Each bar's speed-up at its end; for a row without one, why, at the left."""
    left = ax.get_yaxis_transform()
    for i, r in enumerate(rows):
        if r.speedup is not None:
            ax.text(speed[i] + err[i] + 0.01, i, f"{speed[i]:.2f}x", va="center", fontsize=8)
        else:
            ax.text(0.02, i, _plot_label(r), va="center", fontsize=8, transform=left,
                    color="tab:red" if r.status == "failed" else "dimgray")


def _measured_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in d.get("rows", []) if r.get("status") == "measured"]


def _label_rows(ax: Any, names: list[str], chosen: list[bool]) -> None:
    """The rows' names down the shared y axis, top to bottom, the chosen ones starred."""
    ax.set_yticks(list(range(len(names))))
    ax.set_yticklabels([("* " if c else "") + n for n, c in zip(names, chosen)])
    ax.invert_yaxis()


def _plot_distributed_speed(ax: Any, rows: list[dict[str, Any]], colors: list[str]) -> None:
    """Throughput against one process, a bar per mode, with its scaling efficiency."""
    speed = [r.get("throughput_vs_one_process") or (1.0 if r["name"] == "one process" else 0.0) for r in rows]
    ax.barh(list(range(len(rows))), speed, color=colors)
    ax.axvline(1.0, color="k", lw=1)
    for i, r in enumerate(rows):
        eff = r.get("scaling_efficiency")
        label = f"{speed[i]:.2f}x" + (f"  (scaling eff. {eff:.2f})" if eff else "")
        ax.text(speed[i] + 0.01, i, label, va="center", fontsize=8)
    ax.set_xlabel("throughput vs one process on the global batch (higher is better)")


def _plot_distributed_memory(ax: Any, rows: list[dict[str, Any]], limit: int | None) -> None:
    """Per-rank state (parameters, gradients, optimizer state) stacked, the peak, and the per-rank limit."""
    y = list(range(len(rows)))
    _stack_state(ax, rows, y)
    peaks = [_mib(r.get("peak_bytes")) for r in rows]
    ax.scatter(peaks, y, marker="|", s=300, color="k", label="peak", zorder=3)
    if limit and limit < 2 * max(peaks + [1.0]) * 2**20:
        ax.axvline(limit / 2**20, color="tab:red", ls="--", lw=1.5, label="per-rank limit")
    ax.set_xlabel("per-rank MiB: parameters + gradients + optimizer state, and the peak")
    ax.legend(loc="lower right", fontsize=8)


def _stack_state(ax: Any, rows: list[dict[str, Any]], y: list[int]) -> None:
    """Per-rank parameters, gradients and optimizer state, one stacked bar per row."""
    left = [0.0] * len(rows)
    for key, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        vals = [_mib((r.get("state") or {}).get(key)) for r in rows]
        ax.barh(y, vals, left=left, color=color, label=key, height=0.5)
        left = [a + b for a, b in zip(left, vals)]


def _mib(n: int | None) -> float:
    return (n or 0) / 2**20


def _distributed_row(r: dict[str, Any], recommended: bool) -> list[str]:
    """One row of the distributed table (see :attr:`TuneReport.DIST_HEADERS`)."""
    st = r.get("state") or {}
    vs = r.get("throughput_vs_one_process")
    vs_text = f"{vs:.2f}x" + _plus_minus(r.get("throughput_vs_one_process_half_ci")) if vs else ""
    return [r["name"], _if_set(r.get("ranks")), _if_set(r.get("batch_per_rank")), _fmt_s(r.get("step_s")),
            _if_set(r.get("samples_per_s"), ",.1f"), vs_text, _if_set(r.get("scaling_efficiency"), ".2f"),
            _bytes(r.get("peak_bytes")), _bytes(st.get("total")),
            " / ".join(_bytes(st.get(k)) for k in ("params", "grads", "optimizer")) if st else "",
            _pct(r.get("loss_drift")), _distributed_verdict(r, recommended)]


def _verdict_cell(r: Result) -> str:
    """The verdict column of a row that was measured: its verdict, decision and reason, and why it left the race."""
    verdict = r.verdict or r.status
    if r.decision == "recommended":
        verdict = f"* recommended: {verdict}: {r.why}" if r.why else f"* recommended: {verdict}"
    elif r.decision and r.why:
        verdict += f"; {r.decision}: {r.why}"
    elif r.reason:
        verdict += f" ({r.reason})"
    return verdict + _left_text(r)


def _timed_compiled(r: Result) -> bool:
    """A row with compile on that was timed."""
    return bool(r.changes.get("compile")) and r.status == "measured"


def _left_early(r: Result) -> bool:
    """A timed trick that left its race before the end (its question answered)."""
    return r.left_round is not None and r.rounds is not None and r.status == "measured"


def _left_text(r: Result) -> str:
    if r.left_round is not None and r.left_reason:
        return f"; left the race after {r.left_round} rounds: {r.left_reason}"
    return ""


def _distributed_verdict(r: dict[str, Any], recommended: bool) -> str:
    verdict = r.get("verdict") or (f"{r.get('status')}: {r.get('reason')}" if r.get("reason") else r.get(
        "status", ""))
    return "* recommended: " + verdict if recommended else verdict


def _if_set(x: Any, spec: str = "") -> str:
    """``x`` formatted with ``spec``; '' where it is unset (None, 0)."""
    return format(x, spec) if x else ""


def _plus_minus(half: float | None) -> str:
    """' ±0.05' for a finite half-interval, else ''."""
    return f" ±{half:.2f}" if _finite_number(half) else ""


def _finite_number(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _share(n: float | None, base: float | None) -> float:
    """``n`` as a fraction of ``base``; 0.0 (no bar) where either is not measured."""
    return n / base if n is not None and base else 0.0


def _plain_switches() -> dict[str, Any]:
    """Every tuned switch as the plain step the tune measured has it: TrainConfig's defaults, no fused optimizer."""
    defaults = TrainConfig()
    return {**{k: getattr(defaults, k) for k in TUNED_KEYS}, "fused_optimizer": False}


def _break_even(extra: float, saved: float) -> int | None:
    """Steps until ``extra`` one-off seconds are paid back by ``saved`` seconds a step (None: never)."""
    if extra <= 0:
        return 0
    return math.ceil(extra / saved) if saved > 0 else None


def _save_figure(fig: Any, path: str | Path) -> Path:
    """``fig`` as a PNG at ``path``, atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return p


# -- formatting --------------------------------------------------------------------------------

def _finite(x: Any) -> Any:
    """``x`` with non-finite floats as None (JSON has no Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _advice_in(reason: str) -> str:
    """The clause of a reason that says what to do ("...: install one (...)"), or ''."""
    for clause in reason.split(": ")[1:]:
        if clause.startswith(("install ", "pip install", "export ", "use ")):
            return clause
    return ""


def _with_advice(text: str, advice: str) -> str:
    """``text`` and what would change it, unless the text says so already (a skip reason "...: raise it")."""
    said = advice in text or ("--budget-seconds" in advice and "--budget-seconds" in text and "raise" in text)
    return f"{text}; what would change it: {advice}" if advice and not said else text


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (imported lazily: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _measured(x: float | None) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _among(r: Result, rows: list[Result]) -> bool:
    return any(x is r for x in rows)


def _noise(noise: float) -> str:
    return "n/a" if noise is None or math.isnan(noise) else f"±{noise:.1%}"


def _speed_of(ratio: float | None, half: float | None, ref: str) -> str:
    """A time ratio and its half-interval as a speed against ``ref`` with its ~95% interval:
    (0.8, 0.05, 'plain') -> '1.25x the speed of plain (95% interval 1.18-1.33x)'."""
    if not _measured(ratio) or not ratio > 0:
        return "n/a"
    if not _measured(half):
        return f"{1 / ratio:.2f}x the speed of {ref}"
    hi = f"{1 / (ratio - half):.2f}x" if ratio > half else "inf"
    return f"{1 / ratio:.2f}x the speed of {ref} (95% interval {1 / (ratio + half):.2f}-{hi})"


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


def _pct(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.1%}" if math.isfinite(x) else "not finite"


def _plot_label(r: Result) -> str:
    """Why a trick has no speed-up bar, in a few words."""
    if r.probe_ratio is not None:
        return f"{r.probe_ratio:.0f}x slower in a probe: not timed further"
    if r.reason.startswith("measured on top of"):
        return "timed on top of the best: see its +compile row"
    if r.status in ("skipped", "failed"):
        return f"{r.status}: {r.reason[:60]}" + ("..." if len(r.reason) > 60 else "")
    return "not timed"


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def _speedup(r: Result) -> str:
    if r.speedup is None:
        return ""
    return f"{r.speedup:.2f}x{_plus_minus(r.speedup_half_ci)}"


def _rounds(r: Result) -> str:
    if not r.rounds:
        return ""
    return f"{r.rounds}" + (" (left)" if r.left_round is not None else "")


def _span_rounds(rs: list[Result]) -> str:
    ns = sorted(r.rounds for r in rs if r.rounds)
    if not ns:
        return "0"
    return f"{ns[0]}" if ns[0] == ns[-1] else f"{ns[0]}-{ns[-1]}"


def _fmt_s(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return ""
    return f"{s * 1e3:.1f} ms"


def _bytes(n: float | None) -> str:
    return human_bytes(n) if n is not None else ""


def _maxb(r: Result) -> str:
    return f"{r.max_batch:,}" if r.max_batch is not None else ""


def _drift(r: Result) -> str:
    if r.grad_drift is None and r.loss_drift is None:
        return ""
    g = f"{r.grad_drift:.1e}" if r.grad_drift is not None else "n/a"
    l = f"{r.loss_drift:.1e}" if r.loss_drift is not None else "n/a"
    return f"{g} / {l}"


def _deploy_line(s: dict[str, Any]) -> str:
    if s.get("status") not in ("measured", "no change"):
        return f"{s.get('status')}: {s.get('reason', '')}"
    parts = ["changed nothing"] if s.get("status") == "no change" else []
    parts += _deploy_speedups(s) + _deploy_agreement(s) + _deploy_size(s)
    return ", ".join(parts) or "measured"


def _deploy_speedups(s: dict[str, Any]) -> list[str]:
    return [f"{v:.2f}x at batch {k}" for k, v in (s.get("speedup") or {}).items() if isinstance(v, (int, float))]


def _deploy_agreement(s: dict[str, Any]) -> list[str]:
    """How closely the deployed model's outputs agree with the original's."""
    ag, parts = s.get("agreement") or {}, []
    if ag.get("max_abs_diff") is not None:
        parts.append(f"max abs diff {ag['max_abs_diff']:.2g}")
    if ag.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {ag['top1_agreement']:.0%}")
    if s.get("within_tolerance") is not None:
        parts.append("within tolerance" if s["within_tolerance"] else "OUTSIDE its tolerance")
    return parts


def _deploy_size(s: dict[str, Any]) -> list[str]:
    if s.get("size_bytes") and s.get("original_size_bytes"):
        return [f"size {s['size_bytes'] / s['original_size_bytes']:.2f}x"]
    return []


def _seq_bound_text(r: Result, positions: int | None) -> str:
    """', not at N' where a longer sequence was run and did not fit; the model's positions where it was reached."""
    if r.max_seq_bound is not None:
        return f", not at {r.max_seq_bound}"
    if positions is not None and r.max_seq == positions:
        return f" (all of the model's {positions} positions)"
    return ", longer not run"


def _bound_text(r: Result) -> str:
    """', not at N' where a larger batch was run and did not fit, else ', larger not run'."""
    if r.max_batch_bound is not None:
        return f", not at {r.max_batch_bound}"
    return ", larger not run"


def _efficiency_view(e: dict[str, Any]) -> list[str]:
    """The report's lines of an efficiency dict (its figures, as measured)."""
    return Efficiency(**{k: v for k, v in e.items() if k != "status"}).lines()
