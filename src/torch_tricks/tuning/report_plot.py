"""report.png: a bar per trick, its speed-up (with its interval) and its memory against plain fp32, the
recommendation marked. Mixed into :class:`~torch_tricks.tuning.report.TuneReport`; matplotlib is optional."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch_tricks._format import human_bytes
from torch_tricks._io import atomic_path
from torch_tricks._optional import available, install_hint
from torch_tricks.tuning.report_format import _finite_number
from torch_tricks.tuning.result import Result


class ReportPlot:
    """The plot of the single tricks and the timed combinations (TuneReport's report.png)."""

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


def _label_speed_bars(ax: Any, rows: list[Result], speed: list[float], err: list[float]) -> None:
    """Each bar's speed-up at its end; for a row without one, why, at the left."""
    left = ax.get_yaxis_transform()
    for i, r in enumerate(rows):
        if r.speedup is not None:
            ax.text(speed[i] + err[i] + 0.01, i, f"{speed[i]:.2f}x", va="center", fontsize=8)
        else:
            ax.text(0.02, i, _plot_label(r), va="center", fontsize=8, transform=left,
                    color="tab:red" if r.status == "failed" else "dimgray")


def _plot_label(r: Result) -> str:
    """Why a trick has no speed-up bar, in a few words."""
    if r.probe_ratio is not None:
        return f"{r.probe_ratio:.0f}x slower in a probe: not timed further"
    if r.reason.startswith("measured on top of"):
        return "timed on top of the best: see its +compile row"
    if r.status in ("skipped", "failed"):
        return f"{r.status}: {r.reason[:60]}" + ("..." if len(r.reason) > 60 else "")
    return "not timed"


def _share(n: float | None, base: float | None) -> float:
    """``n`` as a fraction of ``base``; 0.0 (no bar) where either is not measured."""
    return n / base if n is not None and base else 0.0


def _label_rows(ax: Any, names: list[str], chosen: list[bool]) -> None:
    """The rows' names down the shared y axis, top to bottom, the chosen ones starred."""
    ax.set_yticks(list(range(len(names))))
    ax.set_yticklabels([("* " if c else "") + n for n, c in zip(names, chosen)])
    ax.invert_yaxis()


def _save_figure(fig: Any, path: str | Path) -> Path:
    """``fig`` as a PNG at ``path``, atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    p = Path(path)
    with atomic_path(p) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return p


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (imported lazily: plotting is optional)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

