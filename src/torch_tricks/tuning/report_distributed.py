"""The distributed rows in the report (ddp, zero1, fsdp against one process): their table, lines, section
of report.md and plot. Mixed into :class:`~torch_tricks.tuning.report.TuneReport` (its ``distributed``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch_tricks._optional import available
from torch_tricks.tuning.report_format import _bytes, _fmt_s, _plus_minus
from torch_tricks.tuning.report_plot import _label_rows, _pyplot, _save_figure


class ReportDistributed:
    """The distributed rows' views (TuneReport's part for ``tune --processes N``)."""

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

    def _has_distributed_rows(self) -> bool:
        return bool(self.distributed and self.distributed.get("rows"))

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


def _distributed_verdict(r: dict[str, Any], recommended: bool) -> str:
    verdict = r.get("verdict") or (f"{r.get('status')}: {r.get('reason')}" if r.get("reason") else r.get(
        "status", ""))
    return "* recommended: " + verdict if recommended else verdict


def _distributed_where(d: dict[str, Any]) -> str:
    """The backend and device of the distributed rows (on CPU: the threads each side had)."""
    if d.get("device") == "cpu":
        return (f"{d.get('backend')}, {d.get('device')}, {d.get('threads_per_rank')} thread(s) per rank, "
                f"one process on {d.get('one_process_threads')}")
    return f"{d.get('backend')}, {d.get('device')}"


def _changes_text(changes: dict[str, Any]) -> str:
    """'key=value, ...' of the switches the distributed rows ran with; 'the plain step' for none."""
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "the plain step"


def _if_set(x: Any, spec: str = "") -> str:
    """``x`` formatted with ``spec``; '' where it is unset (None, 0)."""
    return format(x, spec) if x else ""


def _pct(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.1%}" if math.isfinite(x) else "not finite"


def _measured_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in d.get("rows", []) if r.get("status") == "measured"]


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

