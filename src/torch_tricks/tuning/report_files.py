"""The report's files: report.json, report.md, tricks.toml and tricks-largest-batch.toml (and the plots),
each written atomically. Mixed into :class:`~torch_tricks.tuning.report.TuneReport`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from torch_tricks._io import atomic_path
from torch_tricks.tuning.report_format import HOW_TO_APPLY, _one_line
from torch_tricks.tuning.result import Result


class ReportFiles:
    """report.json's dict, report.md's text, and ``write`` (TuneReport's files)."""

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

    def to_dict(self) -> dict[str, Any]:
        verdicts = self.explain()
        return {
            "model": self.model, "batch": self.batch, "inputs": self.inputs, "parameters": self.parameters,
            "device": self.device,
            "optimizer": self.optimizer, "memory_limit": self.memory_limit,
            "memory_limit_source": self.memory_limit_source, "budget_s": self.budget_s,
            "elapsed_s": self.elapsed_s, "rounds": self.rounds, "stop_reason": self.stop_reason,
            "phase_s": self.phase_s, "machine": self.machine, "threads": self.threads,
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
            "notes": self.notes, "data": self.data, "tokens": self.tokens, "deploy": self.deploy,
            "efficiency": self.efficiency, "throughput_batch": self.throughput_batch, "mfu": {k: r["mfu"] for k, r in (self.efficiency or {}).get("rows", {}).items()},
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
        return (f"# torch-tricks tune: {self.model}\n\n" + "".join(f"**{line}**\n\n" for line in self.machine_lines())
                + "\n".join(f"- {line}" for line in self.summary_lines())
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


def _skipped_dict(s: Any) -> dict[str, Any]:
    return {"name": s.name, "ids": list(s.ids), "kind": s.kind, "status": getattr(s, "status", "skipped"),
            "reason": s.reason}


def _name(r: Result | None) -> str | None:
    return r.name if r else None


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats as None (JSON has no Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

