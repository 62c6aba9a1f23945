"""The report as text: the table's rows (each with its verdict and reason) and the summary lines under it.

Mixed into :class:`~torch_tricks.tuning.report.TuneReport`, whose fields it reads; ``to_text`` is what the
CLI prints.
"""

from __future__ import annotations

import math
from typing import Any

from torch_tricks._format import human_bytes, table
from torch_tricks.tuning.efficiency import Efficiency
from torch_tricks.tuning.report_format import _bound_text, _bytes, _fmt_s, _speedup, _with_advice
from torch_tricks.tuning.result import Result


class ReportText:
    """The table and the summary lines (TuneReport's text view)."""

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

    def to_text(self) -> str:
        parts = self.machine_lines() + [table(self.HEADERS, self.rows(compact=True), "llllrrrrrll"), ""]
        if self._has_distributed_rows():
            parts += [table(self.DIST_HEADERS, self.distributed_rows(), "lrrrrrrrrrrl"), ""]
        return "\n".join(parts + self.summary_lines())

    def machine_lines(self) -> list[str]:
        """The first line where other processes used the machine during the tune: how much, what the tune did
        about it, and what would give figures that hold on a quiet machine (none on a quiet machine)."""
        m = self.machine
        if not m or not m.get("shared"):
            return []
        did = ["a trick is called faster only beyond the noise measured under that load"]
        t = self.threads or {}
        probe = t.get("probe_s") or {}
        if t.get("chosen_at_start"):
            many = next(k for k in probe if k != "1")
            did.insert(0, f"one intra-op thread was faster at the start ({probe['1'] * 1e3:.0f} ms against "
                          f"{probe[many] * 1e3:.0f} ms at {many}), so every step ran on one and {many} was raced "
                          f"(threads:{many})")
        elif any(r.name.startswith("threads:") for r in self.results):
            did.insert(0, "it raced one intra-op thread against all (threads:1)")
        gpu = f"; {m['gpu']}" if m.get("gpu") else ""
        return [f"shared machine: {m['text']}{gpu}; {', and '.join(did)}; for figures that hold on a quiet machine, "
                "tune when the other processes are done, or give them and the tune separate cores (taskset)"]

    def summary_lines(self) -> list[str]:
        """The lines under the table, in order: the set-up and the race, what to switch on and what it
        costs, memory, notes, the distributed rows, data and deploy, then how to apply it and the time."""
        lines = self._setup_lines() + self._race_lines() + self._baseline_lines() + self._throughput_lines()
        self.explain()
        lines += self._compile_lines() + self._faster_not_recommended_lines() + self._run_length_lines()
        lines += self._efficiency_lines()
        lines += self._memory_lines() + self._throughput_batch_lines() + [f"note: {n}" for n in self.notes]
        lines += self.distributed_lines()
        lines += self._data_lines() + self._token_lines() + self._deploy_lines()
        return lines + [self._tricks_toml_line(), self._time_line()]

    def _setup_lines(self) -> list[str]:
        """What was tuned, and the rule a verdict follows."""
        noise = "n/a" if math.isnan(self.noise) else f"±{self.noise:.1%}"
        return [f"{self.model}: batch {self.batch}, input {self.inputs}, {self.device}, {self.optimizer}; "
                f"memory limit {human_bytes(self.memory_limit)} ({self.memory_limit_source})"
                + self._trainable_text(),
                f"{self.rounds} interleaved rounds; noise {noise} (plain vs plain, A/A); a trick is called faster or "
                f"slower only beyond the larger of the noise, its own 95% interval and {self.min_effect:.0%}"]

    def _trainable_text(self) -> str:
        """"; N of M parameters train (x%)" where some are frozen (LoRA, a frozen backbone): the gradients and
        the optimizer state the memory tricks cut are the trainable share's, the weights are all of them."""
        counts = self.parameters or {}
        n, total = counts.get("trainable", 0), counts.get("total", 0)
        if not total or n >= total:
            return ""
        pct = 100 * n / total
        return f"; {n:,} of {total:,} parameters train ({pct:.1f}%)" if pct >= 1 else \
            f"; {n:,} of {total:,} parameters train ({pct:.2g}%)"

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
        out = [f"throughput: {bt.name}: {_speedup(bt)} the plain step"
               + (f", peak {_bytes(bt.peak_bytes)}" if bt.peak_bytes else "")] if bt is not b else []
        undecided = self.undecided()
        if undecided:
            out.append(self._undecided_line(undecided))
        elif bt is b:
            out.append("throughput: no trick is faster beyond the noise here: keep the plain step")
        return out

    def _undecided_line(self, undecided: list[Result]) -> str:
        """No call where the noise is larger than the effect: which tricks, and what would settle them."""
        what = ", ".join(f"{r.name} {_speedup(r)}" for r in undecided)
        settle = ["a longer --budget-seconds (more rounds narrow the noise)"]
        m = self.machine or {}
        if m.get("shared"):
            settle.insert(0, f"a quieter machine (other processes used {m.get('foreign_cores', 0):.1f} cores "
                             "during the tune)")
        if self.device.startswith("cpu") and not (self.threads or {}).get("given"):
            settle.insert(1 if m.get("shared") else 0, "--threads 1 (one thread waits less for a busy core)")
        return (f"no recommendation on {what}: faster by more than {self.min_effect:.0%}, but the noise of this "
                f"machine (±{self.noise:.1%}) or its own interval is as large as the effect, so neither on nor off "
                f"is written to tricks.toml; what would settle it: {', or '.join(settle)}")

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

    def _throughput_batch_lines(self) -> list[str]:
        """T36: samples a second at the larger micro-batches timed, against the batch tuned, and the choice."""
        tb = self.throughput_batch
        if not tb:
            return []
        if tb.get("status") != "measured":
            return [f"throughput batch: {tb.get('status')}: {tb.get('reason', '')}"]
        sizes = "; ".join(_size_text(r) for r in tb["rows"])
        on = f", {tb['note']}" if tb.get("note") else ""
        return [f"throughput batch (samples a second of {tb['measured_on']}{on}): {sizes}",
                f"throughput batch: {tb.get('reason', '')}"]

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

    def _token_lines(self) -> list[str]:
        """The ways to batch the token rows, each in real tokens a second against padding to the maximum."""
        t = self.tokens
        if not t:
            return []
        if t.get("status") != "measured":
            return [f"token batches: {t.get('status')}: {t.get('reason', '')}"]
        out = [f"token batches ({t['sample_rows']} rows of the data, {t['real_tokens']:,} tokens; real tokens/s, "
               "padding not counted):"]
        for w in t["ways"]:
            if w.get("status") == "measured":
                vs = f", {w['vs_max']:.2f}x padded-to-max" if w.get("vs_max") else ""
                out.append(f"  {w['way']:<8} {w['real_tokens_per_s']:>10,.0f} tok/s ({w['real_share']:.0%} of the "
                           f"tokens computed are data{vs}; at most {w['tokens_per_step']:,} tokens a step"
                           f"{_token_extras(w)})")
            else:
                out.append(f"  {w['way']:<8} {w['status']}: {w.get('reason', '')}")
        out.append(f"  token_batches = {t['choice']}: {t['reason']}" if t.get("choice") else f"  {t.get('reason')}")
        return out

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


def _left_text(r: Result) -> str:
    if r.left_round is not None and r.left_reason:
        return f"; left the race after {r.left_round} rounds: {r.left_reason}"
    return ""


def _timed_compiled(r: Result) -> bool:
    """A row with compile on that was timed."""
    return bool(r.changes.get("compile")) and r.status == "measured"


def _left_early(r: Result) -> bool:
    """A timed trick that left its race before the end (its question answered)."""
    return r.left_round is not None and r.rounds is not None and r.status == "measured"


def _span_rounds(rs: list[Result]) -> str:
    ns = sorted(r.rounds for r in rs if r.rounds)
    if not ns:
        return "0"
    return f"{ns[0]}" if ns[0] == ns[-1] else f"{ns[0]}-{ns[-1]}"


def _rounds(r: Result) -> str:
    if not r.rounds:
        return ""
    return f"{r.rounds}" + (" (left)" if r.left_round is not None else "")


def _maxb(r: Result) -> str:
    return f"{r.max_batch:,}" if r.max_batch is not None else ""


def _drift(r: Result) -> str:
    if r.grad_drift is None and r.loss_drift is None:
        return ""
    g = f"{r.grad_drift:.1e}" if r.grad_drift is not None else "n/a"
    l = f"{r.loss_drift:.1e}" if r.loss_drift is not None else "n/a"
    return f"{g} / {l}"


def _seq_bound_text(r: Result, positions: int | None) -> str:
    """', not at N' where a longer sequence was run and did not fit; the model's positions where it was reached."""
    if r.max_seq_bound is not None:
        return f", not at {r.max_seq_bound}"
    if positions is not None and r.max_seq == positions:
        return f" (all of the model's {positions} positions)"
    return ", longer not run"


def _efficiency_view(e: dict[str, Any]) -> list[str]:
    """The report's lines of an efficiency dict (its figures, as measured)."""
    return Efficiency(**{k: v for k, v in e.items() if k != "status"}).lines()


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


def _size_text(r: dict[str, Any]) -> str:
    """One size of the throughput-batch phase: micro-batch x accumulation, samples a second, against the tuned."""
    what = f"{r['micro_batch']}" + (f" x {r['accumulate']}" if r.get("accumulate", 1) > 1 else "")
    if "error" in r:
        return f"{what}: {r['error']}"
    vs = f", {r['samples_vs_tuned']:.2f}x ±{r['half_ci']:.2f}" if "samples_vs_tuned" in r else " (tuned)"
    return f"{what}: {r['samples_per_s']:,.0f} samples/s{vs}"


def _token_extras(w: dict[str, Any]) -> str:
    """A token way's step peak and its loss against padded's (the same rows, the same weights)."""
    out = ""
    if w.get("peak_bytes"):
        out += f", step peak {w['peak_bytes'] / 2**20:,.1f} MiB"
    if w.get("loss_drift") is not None and w["way"] != "padded":
        out += f", loss {w['loss_drift']:.1e} from padded's"
    return out
