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

__all__ = ["Result", "TuneReport"]

# The two ways to use a tune's result, shown in tricks.toml's header and report.md.
HOW_TO_APPLY = """\
use it: torch-tricks train --config tricks.toml     or     fit(model, data, config="tricks.toml")
or keep your own loop:
    tricks = torch_tricks.Tricks("tricks.toml")
    model, optimizer = tricks.prepare(model, optimizer)   # or tricks.prepare(model): the config's optimizer
    for batch in loader:
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
    first_call_s: float | None = None  # first gradient pass: includes compile time when compile is on
    probe_ratio: float | None = None  # too slow to measure: its probe step's time / the plain one's
    peak_bytes: int | None = None  # peak tensor bytes of build + two steps at the batch
    state_bytes: int | None = None  # live between steps: weights, optimizer state, EMA ...
    activation_bytes: int | None = None  # kept by one forward for its backward (one micro-batch)
    bytes_per_sample: float | None = None
    max_batch: int | None = None  # under the memory limit: straight line from the batch and half of it
    grad_drift: float | None = None  # ||g - g_fp32|| / ||g_fp32|| of the first step (reported, does not decide)
    loss_drift: float | None = None  # max |loss - fp32 loss| over the drift steps / the first fp32 loss
    losses: list[float] = field(default_factory=list)
    verdict: str = ""
    chosen: bool = False
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
    elapsed_s: float = 0.0
    own_optimizer: bool = False  # the caller's optimizer_fn: tricks.toml then names no optimizer
    distributed: dict[str, Any] | None = None  # the ddp/zero1/fsdp rows (tune --processes N, or under torchrun)

    # -- the recommended configuration ------------------------------------------------------
    def recommended_config(self, which: str = "throughput") -> dict[str, Any]:
        """The TrainConfig keys of the chosen configuration: every tuned switch, the optimizer and the batch.

        ``batch_size`` is the loader batch ``fit`` takes: the tuned batch divided by
        ``accumulate``, so the effective batch is the one measured (for ``which="batch"``,
        the estimated largest batch).
        """
        from torch_tricks.train.config import TrainConfig
        from torch_tricks.tuning.tuner import TUNED_KEYS

        best = self.best_throughput if which == "throughput" else self.best_batch
        changes = dict(best.changes) if best else {}
        defaults = TrainConfig()
        cfg: dict[str, Any] = {k: getattr(defaults, k) for k in TUNED_KEYS}
        cfg["fused_optimizer"] = False  # the plain step the tune measured
        if not self.own_optimizer:
            cfg["optimizer"] = self.optimizer
        cfg.update(changes)
        k = int(cfg.get("accumulate", 1))
        batch = self.batch if which == "throughput" or not (best and best.max_batch) else best.max_batch
        mode = self.distributed_choice() if which == "throughput" else None
        if mode is not None:  # fit's batch_size is per rank: the ranks together take the tuned global batch
            cfg["distributed"] = "off" if mode == "one process" else mode
            if mode != "one process":
                batch //= int(self.distributed["processes"])
        cfg["batch_size"] = max(batch // k, 1)
        return cfg

    def distributed_choice(self) -> str | None:
        """The distributed rows' recommendation: a mode, ``"one process"``, or None (not measured)."""
        d = self.distributed
        if not d or d.get("status") != "measured":
            return None
        return d.get("recommended")

    def recommended_tricks(self, which: str = "throughput") -> list[str]:
        """The switches the recommendation turns on (``key=value`` for non-boolean ones)."""
        cfg = self.recommended_config(which)
        from torch_tricks.train.config import TrainConfig
        from torch_tricks.tuning.tuner import TUNED_KEYS

        plain = {**{k: getattr(TrainConfig(), k) for k in TUNED_KEYS}, "fused_optimizer": False}
        out = []
        for k in TUNED_KEYS:
            if cfg[k] != plain[k]:
                out.append(k if cfg[k] is True else f"{k}={cfg[k]}")
        if cfg.get("distributed") not in (None, "off"):
            out.append(f"distributed={cfg['distributed']}")
        return out

    def tricks_toml(self, which: str = "throughput") -> str:
        best = self.best_throughput if which == "throughput" else self.best_batch
        cfg = self.recommended_config(which)
        on = self.recommended_tricks(which)
        head = f"# torch-tricks tune: {self.model}, batch {self.batch}, {self.device}, {self.optimizer}"
        if which == "throughput":
            why = "throughput under the memory limit"
            if best is None or best is self.baseline:
                what = ("the plain fp32 step (no trick was faster beyond the noise)"
                        if any(r.status.startswith("measured") for r in self.results)
                        else "the plain fp32 step (no trick was measured: over --budget-seconds)")
            else:
                what = best.name + (f" ({best.speedup:.2f}x the plain step)" if best.speedup else "")
        else:
            why = "the largest batch under the memory limit"
            what = (best.name if best else "plain") + (
                f"; batch_size is a straight-line estimate ({best.max_batch}), not a run at that size"
                if best and best.max_batch else "")
        lines = [head, f"# chosen for {why}: {what}",
                 f"# switched on: {', '.join(on) if on else 'nothing'}; every tuned switch is stated",
                 *self._distributed_header(which),
                 *("# " + line if line else "#" for line in HOW_TO_APPLY.splitlines()),
                 "[train]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in cfg.items()]
        return "\n".join(lines) + "\n"

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
        out = []
        for r in d.get("rows", []):
            st = r.get("state") or {}
            vs = r.get("throughput_vs_one_process")
            half = r.get("throughput_vs_one_process_half_ci")
            eff = r.get("scaling_efficiency")
            verdict = r.get("verdict") or (f"{r.get('status')}: {r.get('reason')}" if r.get("reason") else r.get(
                "status", ""))
            if d.get("recommended") == r["name"]:
                verdict = "* recommended: " + verdict
            out.append([r["name"], str(r.get("ranks") or ""), str(r.get("batch_per_rank") or ""), _fmt_s(r.get("step_s")),
                        f"{r['samples_per_s']:,.1f}" if r.get("samples_per_s") else "",
                        (f"{vs:.2f}x" + (f" ±{half:.2f}" if half is not None and math.isfinite(half) else "")) if vs
                        else "",
                        f"{eff:.2f}" if eff else "", _bytes(r.get("peak_bytes")), _bytes(st.get("total")),
                        " / ".join(_bytes(st.get(k)) for k in ("params", "grads", "optimizer")) if st else "",
                        _pct(r.get("loss_drift")), verdict])
        return out

    def distributed_lines(self) -> list[str]:
        d = self.distributed
        if not d:
            return []
        n = d.get("processes")
        if d.get("status") != "measured":
            return [f"distributed ({n} processes): {d.get('status')}: {d.get('reason', '')}"]
        where = (f"{d.get('backend')}, {d.get('device')}, {d.get('threads_per_rank')} thread(s) per rank, "
                 f"one process on {d.get('one_process_threads')}" if d.get("device") == "cpu"
                 else f"{d.get('backend')}, {d.get('device')}")
        on = ", ".join(f"{k}={v}" for k, v in (d.get("changes") or {}).items()) or "the plain step"
        lines = [f"distributed: {n} processes ({d.get('launched_by', '')}; {where}), global batch "
                 f"{d.get('global_batch')} = {n} x {d.get('per_rank_batch')}, with {on}; {d.get('rounds')} "
                 f"interleaved rounds; per-rank memory limit {_bytes(d.get('memory_limit_per_rank'))}"]
        if d.get("recommended"):
            lines.append(f"distributed: recommended {d['recommended']}: {d.get('why', '')}")
        lines += [f"note: {x}" for x in d.get("notes", [])]
        return lines

    # -- views --------------------------------------------------------------------------------
    HEADERS = ["trick", "ids", "goal", "speed-up", "rounds", "step", "peak memory", "activations", "max batch",
               "drift grad / loss", "verdict"]

    def rows(self, compact: bool = False) -> list[list[str]]:
        """Table rows: baseline, its A/A twin, each trick, each combination, each skipped trick.

        ``compact``: data and deploy tricks skipped for the same reason share one row.
        """
        out = []
        if self.baseline:
            out.append(self._row(self.baseline))
            if not math.isnan(self.aa_ratio):
                aa = Result("plain again (A/A)", "noise", {}, (), grad_drift=self.aa_grad_drift,
                            loss_drift=self.aa_loss_drift)
                out.append(["plain again (A/A)", "", "noise", f"{1 / self.aa_ratio:.2f}x ±{self.aa_half_ci:.2f}",
                            str(self.rounds), "", "", "", "", _drift(aa), "the noise: identical steps"])
        for r in self.results + self.combos:
            out.append(self._row(r))
        groups: dict[tuple[str, str], list[Any]] = {}
        for s in self.skipped:
            if compact and s.kind in ("data", "deploy") and getattr(s, "status", "skipped") == "skipped":
                groups.setdefault((s.kind, s.reason), []).append(s)
                continue
            out.append([s.name, ",".join(s.ids), s.kind, "", "", "", "", "", "", "",
                        f"{getattr(s, 'status', 'skipped')}: {s.reason}"])
        for (kind, reason), items in groups.items():
            out.append([f"{len(items)} {kind} tricks", "", kind, "", "", "", "", "", "", "",
                        f"skipped: {reason}: {', '.join(s.name for s in items)}"])
        return out

    def _row(self, r: Result) -> list[str]:
        if r.status in ("skipped", "failed"):
            verdict = f"{r.status}: {r.reason}"
        else:
            verdict = r.verdict or r.status
            if r.reason:
                verdict += f" ({r.reason})"
            if r.left_round is not None and r.left_reason:
                verdict += f"; left the race after {r.left_round} rounds: {r.left_reason}"
        if r.chosen:
            verdict = "* recommended: " + verdict
        return [r.name, ",".join(r.ids), r.goal, _speedup(r), _rounds(r), _fmt_s(r.step_s), _bytes(r.peak_bytes),
                _bytes(r.activation_bytes), _maxb(r), _drift(r), verdict]

    def summary_lines(self) -> list[str]:
        b = self.baseline
        noise = "n/a" if math.isnan(self.noise) else f"±{self.noise:.1%}"
        lines = [f"{self.model}: batch {self.batch}, input {self.inputs}, {self.device}, {self.optimizer}; "
                 f"memory limit {human_bytes(self.memory_limit)} ({self.memory_limit_source})",
                 f"{self.rounds} interleaved rounds; noise {noise} (plain vs plain, A/A); a trick is called faster or "
                 f"slower only beyond the larger of the noise, its own 95% interval and {self.min_effect:.0%}"]
        left = [r for r in self.results if r.left_round is not None and r.rounds is not None and r.status == "measured"]
        if self.rounds:
            timed = sum(1 for r in self.results if r.rounds)
            lines.append(f"race: {len(left)} of {timed} tricks left it early, once their question was answered "
                         f"(after {_span_rounds(left)} rounds; each row says why); the others and both baselines "
                         f"got all {self.rounds} rounds" if left else
                         f"race: all {timed} tricks and both baselines got all {self.rounds} rounds")
        if self.stop_reason:
            lines.append(f"stopped: {self.stop_reason}")
        if b and b.step_s:
            lines.append(f"plain fp32 step: {_fmt_s(b.step_s)}" + (
                f", peak {_bytes(b.peak_bytes)} (state {_bytes(b.state_bytes)}, activations "
                f"{_bytes(b.activation_bytes)})" if b.peak_bytes else " (memory not measured)"))
        bt = self.best_throughput
        measured = any(r.status.startswith("measured") for r in self.results)
        if bt is not None:
            if bt is b and not measured:
                lines.append("throughput: no trick was measured: keep the plain step until a longer tune says more")
            elif bt is b:
                lines.append("throughput: no trick is faster beyond the noise here: keep the plain step")
            else:
                lines.append(f"throughput: {bt.name}: {_speedup(bt)} the plain step"
                             + (f", peak {_bytes(bt.peak_bytes)}" if bt.peak_bytes else ""))
        for r in self.results + self.combos:
            if r.changes.get("compile") and r.status == "measured" and r.first_call_s is not None:
                lines.append(f"compile ({r.name}): first call {r.first_call_s:.1f} s (compilation), apart from the step "
                             "times; its memory is not measured (the eager figures do not apply)")
        if self.fits_with:
            lines.append(f"memory: the plain step does not fit under the limit; it fits with {self.fits_with}")
        bb = self.best_batch
        if bb is not None and bb.max_batch is not None:
            lines.append(f"largest batch under the limit: {bb.max_batch} with {bb.name}"
                         + (f" (plain: {b.max_batch})" if b and b.max_batch is not None and bb is not b else "")
                         + " (straight-line estimate from the batch and half of it)")
        lines += [f"note: {n}" for n in self.notes]
        lines += self.distributed_lines()
        if self.data:
            lines.append("data: " + (self.data.get("summary") or f"{self.data.get('status')}: {self.data.get('reason', '')}"))
        if self.deploy:
            for s in self.deploy.get("steps", []):
                lines.append("deploy " + "+".join(s["steps"]) + ": " + _deploy_line(s))
        on = self.recommended_tricks("throughput") if self.baseline else []
        lines.append(f"tricks.toml switches on: {', '.join(on) if on else 'nothing (the plain step)'}; apply it with "
                     "`torch-tricks train --config tricks.toml`, fit(..., config='tricks.toml'), or in your own "
                     "loop with torch_tricks.Tricks('tricks.toml') (five lines: see report.md or tricks.toml)")
        spent = ", ".join(f"{k} {v:.0f} s" for k, v in self.phase_s.items())
        lines.append(f"tune took {self.elapsed_s:.0f} s (budget {self.budget_s:.0f} s" + (f": {spent})" if spent else ")"))
        return lines

    def to_text(self) -> str:
        parts = [table(self.HEADERS, self.rows(compact=True), "llllrrrrrll"), ""]
        if self.distributed and self.distributed.get("rows"):
            parts += [table(self.DIST_HEADERS, self.distributed_rows(), "lrrrrrrrrrrl"), ""]
        return "\n".join(parts + self.summary_lines())

    def to_dict(self) -> dict[str, Any]:
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
            "skipped": [{"name": s.name, "ids": list(s.ids), "kind": s.kind, "status": getattr(s, "status", "skipped"),
                         "reason": s.reason} for s in self.skipped],
            "best_throughput": self.best_throughput.name if self.best_throughput else None,
            "best_batch": self.best_batch.name if self.best_batch else None,
            "fits_with": self.fits_with,
            "recommended": self.recommended_config("throughput") if self.baseline else None,
            "recommended_tricks": self.recommended_tricks("throughput") if self.baseline else None,
            "recommended_largest_batch": self.recommended_config("batch") if self.baseline else None,
            "notes": self.notes, "data": self.data, "deploy": self.deploy,
            "distributed": _finite(self.distributed),
        }

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
                  "**Max batch**: under the memory limit, a straight line through the batch and half of it. "
                  f"**Drift**, against fp32 from the same seed and batch: the relative gradient difference of the "
                  f"first step (reported only: a fresh deep net's early gradients are chaotic), and the largest loss "
                  f"difference over {n_drift} steps relative to the first fp32 loss, which decides "
                  f"(tolerance {self.drift_tolerance}).\n\n"
                  + self._distributed_markdown() +
                  "## Recommended config (`tricks.toml`)\n\n```toml\n" + self.tricks_toml() + "```\n\n"
                  "## How to apply it\n\n```python\n" + HOW_TO_APPLY + "```\n")

    def _distributed_markdown(self) -> str:
        if not self.distributed or not self.distributed.get("rows"):
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
        if self.distributed and self.distributed.get("rows"):
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
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.notes.append("no plot: matplotlib is not installed (pip install matplotlib)")
            return None
        rows = list(self.results)
        chosen = self.best_throughput
        extra = [r for r in self.combos if r.speedup is not None]  # the timed combinations (compile on top of the best)
        extra += [chosen] if chosen is not None and chosen is not self.baseline else []
        for r in extra:
            if r not in rows:
                rows.append(r)
        names = [("* " if r is chosen else "") + r.name for r in rows]
        base_peak = self.baseline.peak_bytes if self.baseline else None
        base_act = self.baseline.activation_bytes if self.baseline else None
        speed = [r.speedup or 0.0 for r in rows]
        err = [r.speedup_half_ci if r.speedup_half_ci is not None and math.isfinite(r.speedup_half_ci) else 0.0
               for r in rows]
        peak = [(r.peak_bytes / base_peak) if (r.peak_bytes and base_peak) else 0.0 for r in rows]
        act = [(r.activation_bytes / base_act) if (r.activation_bytes is not None and base_act) else 0.0 for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(15, 0.5 * len(rows) + 2.2), sharey=True,
                                 gridspec_kw={"width_ratios": [3, 2]})
        colors = ["tab:orange" if r is chosen else ("tab:red" if r.status == "failed" else "tab:blue") for r in rows]
        y = list(range(len(rows)))
        axes[0].barh(y, speed, xerr=err, color=colors, capsize=2)
        axes[0].axvline(1.0, color="k", lw=1)
        if not math.isnan(self.noise):
            band = max(self.noise, self.min_effect)
            axes[0].axvspan(1 - band, 1 + band, color="grey", alpha=0.25, label=f"within noise: ±{band:.0%}")
            axes[0].legend(loc="lower right", fontsize=8)
        axes[0].set_xlabel("training-step speed-up vs plain fp32 (higher is better)")
        h = 0.38
        axes[1].barh([v - h / 2 for v in y], peak, height=h, color=colors, label="peak")
        axes[1].barh([v + h / 2 for v in y], act, height=h, color=colors, alpha=0.45, label="activations")
        axes[1].axvline(1.0, color="k", lw=1)
        if base_peak and self.memory_limit < 2 * base_peak:
            axes[1].axvline(self.memory_limit / base_peak, color="tab:red", lw=1.5, ls="--",
                            label=f"memory limit ({human_bytes(self.memory_limit)})")
        axes[1].set_xlabel("memory vs plain fp32 (lower is better)")
        axes[1].legend(loc="lower right", fontsize=8)
        left = axes[0].get_yaxis_transform()
        for i, r in enumerate(rows):
            if r.speedup is not None:
                axes[0].text(speed[i] + err[i] + 0.01, i, f"{speed[i]:.2f}x", va="center", fontsize=8)
            else:
                axes[0].text(0.02, i, _plot_label(r), va="center", fontsize=8, transform=left,
                             color="tab:red" if r.status == "failed" else "dimgray")
            if not peak[i]:
                axes[1].text(0.02, i, "memory not measured", va="center", fontsize=8, color="dimgray",
                             transform=axes[1].get_yaxis_transform())
        axes[0].set_yticks(y)
        axes[0].set_yticklabels(names)
        axes[0].invert_yaxis()
        noise = "" if math.isnan(self.noise) else f", noise ±{self.noise:.1%}"
        fig.suptitle(f"torch-tricks tune: {self.model}, batch {self.batch}, {self.device}{noise} "
                     "(* = recommended, orange)")
        return _save_figure(fig, path)

    def plot_distributed(self, path: str | Path) -> Path | None:
        """Two panels: throughput against one process (scaling efficiency on each bar), and per-rank state
        (parameters, gradients, optimizer state) with the peak and the per-rank limit."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        d = self.distributed or {}
        rows = [r for r in d.get("rows", []) if r.get("status") == "measured"]
        if not rows:
            return None
        names = [("* " if d.get("recommended") == r["name"] else "") + r["name"] for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(13, 0.55 * len(rows) + 2.4), sharey=True)
        y = list(range(len(rows)))
        speed = [r.get("throughput_vs_one_process") or (1.0 if r["name"] == "one process" else 0.0) for r in rows]
        colors = ["tab:orange" if d.get("recommended") == r["name"] else "tab:blue" for r in rows]
        axes[0].barh(y, speed, color=colors)
        axes[0].axvline(1.0, color="k", lw=1)
        for i, r in enumerate(rows):
            eff = r.get("scaling_efficiency")
            label = f"{speed[i]:.2f}x" + (f"  (scaling eff. {eff:.2f})" if eff else "")
            axes[0].text(speed[i] + 0.01, i, label, va="center", fontsize=8)
        axes[0].set_xlabel("throughput vs one process on the global batch (higher is better)")
        left = [0.0] * len(rows)
        for key, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
            vals = [((r.get("state") or {}).get(key) or 0) / 2**20 for r in rows]
            axes[1].barh(y, vals, left=left, color=color, label=key, height=0.5)
            left = [a + b for a, b in zip(left, vals)]
        peaks = [(r.get("peak_bytes") or 0) / 2**20 for r in rows]
        axes[1].scatter(peaks, y, marker="|", s=300, color="k", label="peak", zorder=3)
        lim = d.get("memory_limit_per_rank")
        if lim and lim < 2 * max(peaks + [1.0]) * 2**20:
            axes[1].axvline(lim / 2**20, color="tab:red", ls="--", lw=1.5, label="per-rank limit")
        axes[1].set_xlabel("per-rank MiB: parameters + gradients + optimizer state, and the peak")
        axes[1].legend(loc="lower right", fontsize=8)
        axes[0].set_yticks(y)
        axes[0].set_yticklabels(names)
        axes[0].invert_yaxis()
        fig.suptitle(f"torch-tricks tune: {self.model}, global batch {d.get('global_batch')} on "
                     f"{d.get('processes')} processes ({d.get('backend')}, {d.get('device')}; * = recommended)")
        return _save_figure(fig, path)


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
    h = r.speedup_half_ci
    spread = f" ±{h:.2f}" if h is not None and math.isfinite(h) else ""
    return f"{r.speedup:.2f}x{spread}"


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
    parts = []
    sp = s.get("speedup") or {}
    parts += [f"{v:.2f}x at batch {k}" for k, v in sp.items() if isinstance(v, (int, float))]
    ag = s.get("agreement") or {}
    if ag.get("max_abs_diff") is not None:
        parts.append(f"max abs diff {ag['max_abs_diff']:.2g}")
    if ag.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {ag['top1_agreement']:.0%}")
    if s.get("within_tolerance") is not None:
        parts.append("within tolerance" if s["within_tolerance"] else "OUTSIDE its tolerance")
    if s.get("size_bytes") and s.get("original_size_bytes"):
        parts.append(f"size {s['size_bytes'] / s['original_size_bytes']:.2f}x")
    if s.get("status") == "no change":
        parts.insert(0, "changed nothing")
    return ", ".join(parts) or "measured"
