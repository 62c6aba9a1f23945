"""The tune report: what was measured, what to switch on, and the files that say so.

``write(out_dir)`` writes ``report.md``, ``report.json``, ``report.png`` (one bar per
measured trick: speed-up and peak memory against plain fp32, the chosen combination
marked) and ``tricks.toml`` — the recommended :class:`TrainConfig` keys, which
``torch-tricks train --config tricks.toml`` and ``fit(config="tricks.toml")`` take as
they are — plus ``tricks-largest-batch.toml`` for the configuration that fits the most
samples per step. Every figure comes from the run that made the report.
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


@dataclass
class Result:
    """One configuration's measurements (a single trick, a combination, or the baseline)."""

    name: str
    goal: str  # speed | memory | cost | baseline
    changes: dict[str, Any]
    ids: tuple[str, ...]
    note: str = ""
    status: str = "pending"  # measured | skipped | failed | measured (memory)
    reason: str = ""
    step_s: float | None = None  # median step time
    ratio: float | None = None  # median of per-round step-time ratios to plain (< 1: faster)
    ratio_spread: float | None = None  # half the IQR of those ratios
    first_call_s: float | None = None  # first gradient pass: includes compile time when compile is on
    peak_bytes: int | None = None  # peak tensor bytes of build + two steps at the batch
    bytes_per_sample: float | None = None
    max_batch: int | None = None  # under the memory limit, from peaks at the batch and half of it
    grad_drift: float | None = None  # ||g - g_fp32|| / ||g_fp32|| of the first step
    loss_drift: float | None = None  # max relative loss difference over the drift steps
    losses: list[float] = field(default_factory=list)
    verdict: str = ""
    runner: Any = field(default=None, repr=False, compare=False)

    @property
    def speedup(self) -> float | None:
        return 1.0 / self.ratio if self.ratio and not math.isnan(self.ratio) else None

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "runner"}
        d["ids"] = list(self.ids)
        d["speedup"] = self.speedup
        return d


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
    noise: float = 0.0  # relative: A/A disagreement of the plain step with itself (at least 2%)
    rounds: int = 0
    drift_tolerance: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] | None = None
    deploy: dict[str, Any] | None = None
    elapsed_s: float = 0.0

    # -- the recommended configuration ------------------------------------------------------
    def recommended_config(self, which: str = "throughput") -> dict[str, Any]:
        """The TrainConfig keys of the chosen configuration, every tuned key stated."""
        from torch_tricks.tune.tuner import TUNED_KEYS
        from torch_tricks.train.config import TrainConfig

        best = self.best_throughput if which == "throughput" else self.best_batch
        changes = dict(best.changes) if best else {}
        defaults = TrainConfig()
        cfg: dict[str, Any] = {k: getattr(defaults, k) for k in TUNED_KEYS}
        cfg.update({"fused_optimizer": False, "optimizer": self.optimizer})
        cfg.update(changes)
        k = int(cfg.get("accumulate", 1))
        batch = self.batch if which == "throughput" or not (best and best.max_batch) else best.max_batch
        cfg["batch_size"] = max(batch // k, 1)
        return cfg

    def tricks_toml(self, which: str = "throughput") -> str:
        best = self.best_throughput if which == "throughput" else self.best_batch
        cfg = self.recommended_config(which)
        lines = [f"# torch-tricks tune: {self.model}, batch {self.batch}, {self.device}",
                 f"# chosen for {'throughput' if which == 'throughput' else 'the largest batch'}: "
                 f"{best.name if best else 'plain'}" + (f" ({best.speedup:.2f}x the plain step)" if best and best.speedup else ""),
                 "# use: torch-tricks train --config tricks.toml   or   fit(model, data, config='tricks.toml')",
                 "[train]"]
        for k, v in cfg.items():
            lines.append(f"{k} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"

    # -- views --------------------------------------------------------------------------------
    def rows(self) -> list[list[str]]:
        """Table rows: baseline, each trick, each combination, each skipped trick."""
        out = []
        for r in ([self.baseline] if self.baseline else []) + self.results + self.combos:
            out.append([r.name, ",".join(r.ids), r.goal, _ratio(r), _fmt_s(r.step_s), _mem(r), _maxb(r),
                        _drift(r), r.verdict or r.status + (f": {r.reason}" if r.reason else "")])
        for s in self.skipped:
            out.append([s.name, ",".join(s.ids), s.kind, "", "", "", "", "", f"skipped: {s.reason}"])
        return out

    HEADERS = ["trick", "ids", "goal", "speed-up", "step", "peak memory", "max batch", "drift (grad/loss)", "verdict"]

    def summary_lines(self) -> list[str]:
        b = self.baseline
        lines = [f"{self.model}: batch {self.batch}, {self.device}, {self.optimizer}; memory limit "
                 f"{human_bytes(self.memory_limit)} ({self.memory_limit_source}); "
                 f"{self.rounds} interleaved rounds; noise ±{self.noise:.1%} (plain vs plain)"]
        if b and b.step_s:
            lines.append(f"plain fp32 step: {_fmt_s(b.step_s)}, peak {_bytes(b.peak_bytes)}")
        bt = self.best_throughput
        if bt is not None:
            if bt is b:
                lines.append("throughput: no trick is faster beyond the noise here: keep the plain step")
            else:
                lines.append(f"throughput: {bt.name}: {_ratio(bt)} the plain step"
                             + (f", peak {_bytes(bt.peak_bytes)}" if bt.peak_bytes else ""))
        bb = self.best_batch
        if bb is not None and bb.max_batch is not None:
            lines.append(f"largest batch under the limit: {bb.max_batch} with {bb.name}"
                         + (f" (plain: {b.max_batch})" if b and b.max_batch is not None and bb is not b else "")
                         + " (straight-line estimate from peaks at the batch and half of it)")
        lines += [f"note: {n}" for n in self.notes]
        if self.data and self.data.get("summary"):
            lines.append(f"data: {self.data['summary']}")
        if self.deploy:
            for s in self.deploy.get("steps", []):
                lines.append("deploy " + "+".join(s["steps"]) + ": " + _deploy_line(s))
        lines.append(f"tune took {self.elapsed_s:.0f} s (budget {self.budget_s:.0f} s)")
        return lines

    def to_text(self) -> str:
        return "\n".join([table(self.HEADERS, self.rows(), "llllrrrll"), ""] + self.summary_lines())

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "batch": self.batch, "inputs": self.inputs, "device": self.device,
            "optimizer": self.optimizer, "memory_limit": self.memory_limit,
            "memory_limit_source": self.memory_limit_source, "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s, "noise": self.noise, "rounds": self.rounds,
            "drift_tolerance": self.drift_tolerance,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "results": [r.to_dict() for r in self.results],
            "combinations": [r.to_dict() for r in self.combos],
            "skipped": [{"name": s.name, "ids": list(s.ids), "kind": s.kind, "reason": s.reason} for s in self.skipped],
            "best_throughput": self.best_throughput.name if self.best_throughput else None,
            "best_batch": self.best_batch.name if self.best_batch else None,
            "recommended": self.recommended_config("throughput"),
            "recommended_largest_batch": self.recommended_config("batch"),
            "notes": self.notes, "data": self.data, "deploy": self.deploy,
        }

    def to_markdown(self) -> str:
        head = "| " + " | ".join(self.HEADERS) + " |\n|" + "---|" * len(self.HEADERS) + "\n"
        body = "".join("| " + " | ".join(c.replace("|", "/") for c in row) + " |\n" for row in self.rows())
        return (f"# torch-tricks tune: {self.model}\n\n" + "\n".join(f"- {l}" for l in self.summary_lines())
                + "\n\n## Every trick\n\n" + head + body
                + "\nSpeed-up: median of per-round ratios of the plain step time to the trick's, steps timed "
                  "round-robin in one run. Peak memory: tensor bytes from building the model through two steps. "
                  "Drift: relative gradient difference of the first step and loss difference after "
                  f"{len(self.baseline.losses) if self.baseline else 0} steps, against fp32 from the same seed "
                  f"(tolerance {self.drift_tolerance}).\n\n![speed-up and memory per trick](report.png)\n\n"
                  "## Recommended config (`tricks.toml`)\n\n```toml\n" + self.tricks_toml() + "```\n")

    # -- files --------------------------------------------------------------------------------
    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write the report files into ``out_dir`` (each atomically); returns their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {name: out / name for name in ("report.md", "report.json", "tricks.toml", "tricks-largest-batch.toml")}
        with atomic_path(paths["report.json"]) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        with atomic_path(paths["tricks.toml"]) as tmp:
            tmp.write_text(self.tricks_toml("throughput"))
        with atomic_path(paths["tricks-largest-batch.toml"]) as tmp:
            tmp.write_text(self.tricks_toml("batch"))
        png = self.plot(out / "report.png")
        if png is not None:
            paths["report.png"] = png
        with atomic_path(paths["report.md"]) as tmp:
            tmp.write_text(self.to_markdown())
        return paths

    def plot(self, path: str | Path) -> Path | None:
        """Bar chart: speed-up and peak memory per measured trick and the chosen combination."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.notes.append("no plot: matplotlib is not installed (pip install 'torch-tricks[plot]')")
            return None
        rows = [r for r in self.results if r.status == "measured"]
        chosen = self.best_throughput
        if chosen is not None and chosen is not self.baseline and chosen not in rows:
            rows.append(chosen)
        names = [r.name + (" *" if r is chosen else "") for r in rows]
        base_peak = self.baseline.peak_bytes if self.baseline else None
        speed = [r.speedup or 0.0 for r in rows]
        mem = [(r.peak_bytes / base_peak) if (r.peak_bytes and base_peak) else 0.0 for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.8), sharey=True)
        colors = ["tab:orange" if r is chosen else "tab:blue" for r in rows]
        axes[0].barh(names, speed, color=colors)
        axes[0].axvline(1.0, color="k", lw=1)
        axes[0].axvspan(1 - 2 * self.noise, 1 + 2 * self.noise, color="grey", alpha=0.2, label="noise")
        axes[0].set_xlabel("training-step speed-up vs plain fp32 (higher is better)")
        axes[0].legend(loc="lower right")
        axes[1].barh(names, mem, color=colors)
        axes[1].axvline(1.0, color="k", lw=1)
        axes[1].set_xlabel("peak memory vs plain fp32 (lower is better; 0 = not measured)")
        fig.suptitle(f"torch-tricks tune: {self.model}, batch {self.batch}, {self.device} (* = recommended)")
        fig.tight_layout()
        p = Path(path)
        with atomic_path(p) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        return p


# -- formatting --------------------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def _ratio(r: Result) -> str:
    if r.speedup is None:
        return ""
    spread = f" ±{r.ratio_spread:.2f}" if r.ratio_spread else ""
    return f"{r.speedup:.2f}x{spread}"


def _fmt_s(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return ""
    return f"{s * 1e3:.1f} ms"


def _bytes(n: float | None) -> str:
    return human_bytes(n) if n is not None else "n/a"


def _mem(r: Result) -> str:
    return human_bytes(r.peak_bytes) if r.peak_bytes is not None else ""


def _maxb(r: Result) -> str:
    return str(r.max_batch) if r.max_batch is not None else ""


def _drift(r: Result) -> str:
    if r.grad_drift is None and r.loss_drift is None:
        return ""
    g = f"{r.grad_drift:.1e}" if r.grad_drift is not None else "n/a"
    l = f"{r.loss_drift:.1e}" if r.loss_drift is not None else "n/a"
    return f"{g} / {l}"


def _deploy_line(s: dict[str, Any]) -> str:
    if s.get("status") != "measured":
        return f"{s.get('status')}: {s.get('reason', '')}"
    parts = []
    for key in ("speedup_b1", "speedup", "max_abs_diff", "top1_agreement"):
        if key in s and s[key] is not None:
            parts.append(f"{key} {s[key]:.3g}" if isinstance(s[key], float) else f"{key} {s[key]}")
    return ", ".join(parts) or "measured"
