"""The tune report: what was measured, what to switch on, and the files that say so.

``write(out_dir)`` writes ``report.md``, ``report.json``, ``report.png`` (one bar per
trick: speed-up and memory against plain fp32, the chosen configuration marked) and
``tricks.toml`` — the recommended :class:`~torch_tricks.train.TrainConfig` keys, which
``torch-tricks train --config tricks.toml`` and ``fit(config="tricks.toml")`` take as
they are — plus ``tricks-largest-batch.toml`` for the configuration that fits the most
samples per step. Every figure comes from the run that made the report; a figure that
was not measured is absent (``null``), never filled in.

This module holds the report's figures and the recommendation (the TrainConfig keys); its parts
say the rest: why each verdict (:mod:`.explain`, :mod:`.payback`), the text (:mod:`.report_text`),
the distributed rows (:mod:`.report_distributed`), the files (:mod:`.report_files`) and the plot
(:mod:`.report_plot`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch_tricks.train.config import TrainConfig
from torch_tricks.tuning.decide import _valid_together
from torch_tricks.tuning.explain import Explain
from torch_tricks.tuning.payback import Payback
from torch_tricks.tuning.record import model_table
from torch_tricks.tuning.report_distributed import ReportDistributed
from torch_tricks.tuning.report_files import ReportFiles
from torch_tricks.tuning.report_format import HOW_TO_APPLY, _bound_text, _one_line, _toml_value, _with_advice
from torch_tricks.tuning.report_plot import ReportPlot
from torch_tricks.tuning.report_text import ReportText
from torch_tricks.tuning.result import Result

__all__ = ["Result", "TuneReport"]

# The config keys the tuner decides; tricks.toml states those of the tricks it measured (issue 34: no others).
TUNED_KEYS = ("precision", "fp32_matmul", "attention", "float8", "liger", "channels_last", "checkpointing", "compile",
              "fused_optimizer", "inplace", "memory_efficient_bn", "accumulate", "cudnn_benchmark", "ema", "deterministic", "chunked_lm_loss",
              "optimizer_in_backward", "offload_activations", "threads")


@dataclass
class TuneReport(Explain, Payback, ReportText, ReportDistributed, ReportFiles, ReportPlot):
    """Everything one tune measured and decided.

    This class holds the figures and the recommendation (the TrainConfig keys, tricks.toml); its views come
    from its parts: :class:`~torch_tricks.tuning.explain.Explain` (every verdict's reason),
    :class:`~torch_tricks.tuning.payback.Payback` (compile's break-even), the text, the distributed rows,
    the files and the plot (``report_*`` modules).
    """

    model: str
    batch: int
    device: str
    optimizer: str
    memory_limit: int
    memory_limit_source: str
    budget_s: float
    inputs: list[list[int]] = field(default_factory=list)
    parameters: dict[str, int] | None = None  # {"trainable", "total"}: the model's parameters (each once)
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
    tokens: dict[str, Any] | None = None  # T39-T41: the ways to batch the token rows given, real tokens/s (token_phase)
    deploy: dict[str, Any] | None = None
    efficiency: dict[str, Any] | None = None  # MFU of plain and the recommendation (status, figures, or why not)
    emit: dict[str, Any] | None = None  # tune --emit: {"target", "title", "lines"} of the trainer it applies to
    elapsed_s: float = 0.0
    own_optimizer: bool = False  # the caller's optimizer_fn: tricks.toml then names no optimizer
    distributed: dict[str, Any] | None = None  # the ddp/zero1/fsdp rows (tune --processes N, or under torchrun)
    run_steps: int | None = None  # the training run's optimizer steps a one-off cost (compile) must pay back within
    run_steps_source: str = ""  # "given" (tune(steps=...)) or "assumed"
    model_record: dict[str, Any] | None = None  # what the tune ran on (tricks.toml's [model]; see tuning.record)
    machine: dict[str, Any] | None = None  # other processes' use of the machine during the tune (the first line)
    threads: dict[str, Any] | None = None  # the intra-op threads the lanes ran at, and whether the caller gave them
    throughput_batch: dict[str, Any] | None = None  # T36: samples a second at larger micro-batches (tuning.throughput_batch)

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
        if self.threads and (self.threads.get("given") or self.threads.get("chosen_at_start")) \
                and "threads" not in chosen:  # every lane ran at these threads: the caller's, or one (faster)
            cfg["threads"] = self.threads["threads"]
        if not self.own_optimizer and (self.optimizer != TrainConfig.optimizer or cfg.get("optimizer_state")):
            cfg["optimizer"] = self.optimizer
        if which == "throughput":  # T36: a larger micro-batch that keeps the effective batch, measured faster
            cfg.update(self._throughput_accumulate())
        if (self.tokens or {}).get("choice"):  # T39-T41, measured on the rows given: decided either way
            cfg["token_batches"] = self.tokens["choice"]
        batch = self._tuned_batch(which, best)
        mode = self.distributed_choice() if which == "throughput" else None
        if mode is not None:  # fit's batch_size is per rank: the ranks together take the tuned global batch
            cfg["distributed"], batch = self._distributed_setting(mode, batch)
        loader_batch = max(batch // int(cfg.get("accumulate", 1)), 1)
        if loader_batch != self.batch:
            cfg["batch_size"] = loader_batch
        return cfg

    def _throughput_accumulate(self) -> dict[str, Any]:
        """``accumulate`` of the larger micro-batch the throughput-batch phase chose and may write (the effective
        batch kept), else nothing."""
        tb = self.throughput_batch or {}
        return {"accumulate": tb["choice"]["accumulate"]} if tb.get("written") and tb.get("choice") else {}

    def _throughput_batch_comment(self) -> list[str]:
        """tricks.toml's comment on the batch of the most samples a second where it is not written."""
        tb = self.throughput_batch or {}
        if tb.get("status") != "measured" or tb.get("written"):
            return []
        return ["# throughput batch (T36): " + _one_line(tb.get("reason", ""))]

    def _decided_keys(self) -> set[str]:
        """The keys of the speed tricks measured, chosen or not: the tune's answer to "is it faster here" stands
        either way. A memory or cost trick left off is not a decision about your run (your own checkpointing for a
        larger batch, your EMA, your determinism stay yours): it is written only when chosen."""
        keys = {k for r in self.results + self.combos if r.goal == "speed" and r.status.startswith("measured")
                for k in r.changes if k in TUNED_KEYS}
        return keys - self.open_keys()

    def open_keys(self) -> set[str]:
        """The switches of speed tricks measured faster alone whose combination with the recommendation was not
        measured: undecided, so not written (a trick measured faster is never written off on a guess)."""
        best = self.best_throughput
        chosen = best.changes if best is not None else {}
        measured = [r.changes for r in self.results + self.combos if r.status == "measured"]
        out: set[str] = set()
        undecided = self.undecided()
        for r in self.results:
            if r.goal != "speed" or set(r.changes) & set(chosen):
                continue
            if any(r is u for u in undecided):
                out |= set(r.changes)
                continue
            if r.verdict != "faster":
                continue
            together = {**chosen, **r.changes}
            if not any(together.items() <= c.items() for c in measured) and _valid_together(together):
                out |= set(r.changes)
        return out

    def undecided(self) -> list[Result]:
        """The speed tricks whose call a noisy machine withheld: measured faster by more than the least effect
        that counts, but by less than the A/A noise (or their own interval), so not called faster. No
        recommendation is made on them either way (their keys are not written: off would be a call the race
        cannot make either); the report says what would settle them. A 4-layer GPT-2's fused AdamW measured
        1.03x (0.97-1.10x) beside a noise of ±8.5%, and was written off where, timed longer, it added 4% on
        top of compile."""
        noise = self.noise
        if math.isnan(noise) or noise <= self.min_effect:
            return []
        return [r for r in self.results if r.goal == "speed" and r.verdict == "no measurable change"
                and r.ratio is not None and not math.isnan(r.ratio) and self.min_effect < 1 - r.ratio]

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
        if cfg.get("token_batches", "padded") != "padded":  # the loop's default for rows of different lengths
            out.append(f"token_batches={cfg['token_batches']}")
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
                 *(self._toml_reasons() + self._throughput_batch_comment() + self._token_comment()
                   if which == "throughput" else []),
                 *("# " + line if line else "#" for line in HOW_TO_APPLY.splitlines()),
                 "[train]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in cfg.items()]
        lines += model_table(self.model_record, self.model)  # after [train]: load_config reads [train] only
        return "\n".join(lines) + "\n"

    def _token_comment(self) -> list[str]:
        """token_batches' reason, with each way's real tokens a second, for tricks.toml."""
        t = self.tokens or {}
        if not t.get("choice"):
            return []
        ways = ", ".join(f"{w['way']} {w['real_tokens_per_s']:,.0f}" for w in t["ways"] if w.get("status") == "measured")
        return [f"#   token_batches = {t['choice']}: {t['reason']} (real tokens/s: {ways})"]

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


def _plain_switches() -> dict[str, Any]:
    """Every tuned switch as the plain step the tune measured has it: TrainConfig's defaults, no fused optimizer."""
    defaults = TrainConfig()
    return {**{k: getattr(defaults, k) for k in TUNED_KEYS}, "fused_optimizer": False}

