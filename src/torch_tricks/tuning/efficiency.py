"""How far a training step is from the machine's limit: model FLOPs per step, achieved FLOP/s, MFU (issue 22).

The model FLOPs of one training step (forward and backward, fp32, no recomputation: the work the
model needs, whatever a trick adds) are counted once by the package's own counter
(:class:`~torch_tricks.inspect.flops.OpCounter`, which agrees with ``FlopCounterMode``). A step of
``step_s`` seconds then achieves ``flops / step_s`` FLOP/s; its MFU is that over the peak matmul
rate of the dtype it computes in (:func:`~torch_tricks.inspect.peak.device_peak`, measured once per
machine and cached). A step far from its peak is bound elsewhere: the same count gives the step's
arithmetic intensity (FLOPs per byte of memory traffic) and the share of that traffic moved by
element-wise operators, which do no FLOPs.

A step cannot beat the peak of its dtype: one that does shows the cached peak was measured low (a
disturbed measurement, cached). The peak is then measured again where the caller can afford it
(``remeasure``), replacing the cache entry; an MFU still over 100% is withheld, with the reason and
how to refresh the peak, never printed.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch.nn as nn

from torch_tricks._format import human_bytes
from torch_tricks.inspect.flops import OpCounter
from torch_tricks.inspect.peak import Peak, mfu, rate
from torch_tricks.train.loop import TrainStep

__all__ = ["StepCost", "Efficiency", "step_cost", "efficiency"]

FAR = 0.3  # an MFU under this is "far from the peak": the report names what bounds the step


@dataclass
class StepCost:
    """The model FLOPs and memory traffic of one training step (forward and backward)."""

    flops: int
    traffic_bytes: int
    pointwise_bytes: int
    top_layer: str = ""  # the layer whose forward moves the most bytes: "name (Type)"
    top_layer_bytes: int = 0
    top_layer_flops: int = 0

    @property
    def intensity(self) -> float:
        """FLOPs per byte of memory traffic."""
        return self.flops / max(self.traffic_bytes, 1)


@dataclass
class Efficiency:
    """MFU of the plain step and of the recommended one, against the machine's peak (a row's ``mfu`` is None
    where it is withheld: see :func:`efficiency`)."""

    flops_per_step: int
    peak_key: str
    peak_cached: bool
    peak_flops: dict[str, float]
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)  # "plain" / "recommended" -> the figures
    intensity: float = 0.0
    pointwise_share: float = 0.0
    top_layer: str = ""
    top_layer_bytes: int = 0
    top_layer_flops: int = 0
    remeasured: str = ""  # why the cached peak was measured again (a step beat it), with its old figure
    withheld: str = ""  # why the MFU of some rows is None (a step beat the peak, measured again or not)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [self._row_line(label, r) for label, r in self.rows.items()
               if label == "plain" or r["name"] != "plain"]  # a recommendation of plain: its line is plain's
        out += [text for text in (self.remeasured, self.withheld) if text]
        if any(r["mfu"] is not None and r["mfu"] < FAR for r in self.rows.values()):
            out.append(self._far_line())
        return out

    def _row_line(self, label: str, r: dict[str, Any]) -> str:
        what = "the plain step" if label == "plain" else f"the recommendation ({r['name']})"
        figure = "withheld" if r["mfu"] is None else f"{r['mfu']:.0%}"
        return (f"MFU of {what}: {figure} ({rate(r['flops_per_s'])} of model FLOPs, "
                f"{self.flops_per_step / 1e9:.2f} GFLOP a step, against this machine's {r['dtype']} matmul peak "
                f"{rate(self.peak_flops[r['dtype']])}, {'cached' if self.peak_cached else 'measured now'})")

    def _far_line(self) -> str:
        return (f"far from the peak: the step does {self.intensity:.1f} FLOP a byte of memory traffic, and "
                f"element-wise operators (norms, activations and their gradients) move "
                f"{self.pointwise_share:.0%} of the bytes: memory-bound work, which fusing (compile) or a "
                f"larger batch attacks, not faster matmuls"
                + (f"; the layer whose forward moves the most: {self.top_layer}, "
                   f"{human_bytes(self.top_layer_bytes)} at {self.top_layer_flops / max(self.top_layer_bytes, 1):.1f} "
                   "FLOP a byte" if self.top_layer else ""))


def step_cost(model: nn.Module, config: dict[str, Any], batch: Any, *,
              loss_fn: Callable[..., Any] | None = None, optimizer_fn: Callable[..., Any] | None = None) -> StepCost:
    """The FLOPs and memory traffic of one forward and backward of a copy of ``model`` on ``batch`` in fp32."""
    cfg = {**config, "precision": "fp32", "checkpointing": "", "compile": False, "accumulate": 1}
    step = TrainStep(copy.deepcopy(model), loss_fn=loss_fn, optimizer=optimizer_fn, config=cfg)
    counter = OpCounter(step.model)
    with counter:
        step.gradients(batch)
    total = counter.records[""].total
    layers = [r for name, r in counter.records.items() if name and not any(True for _ in r.module.children())]
    top = max(layers, key=lambda r: r.self_.mac_bytes, default=None)
    return StepCost(total.flops, total.mac_bytes, total.pointwise_bytes,
                    *((f"{top.name} ({type(top.module).__name__})", top.self_.mac_bytes, top.self_.flops) if top
                      else ()))


def efficiency(cost: StepCost, peak: Peak, steps: dict[str, tuple[str, str, float]], *,
               remeasure: Callable[[], Peak] | None = None) -> Efficiency:
    """MFU of each step: ``steps`` maps a label to (its configuration's name, the dtype it computes in, its step
    seconds); a dtype the peak has no rate for is left out.

    A step faster than the peak of its dtype means the peak was measured low: ``remeasure`` (given where the
    caller has the time of a measurement, e.g. ``lambda: device_peak(dev, refresh=True)``, which replaces the
    cache entry) measures it again and every row is computed against the new one; an MFU still over 100%, or
    without ``remeasure``, is withheld (None) and ``withheld`` says why and how to refresh the peak."""
    out = _figures(cost, peak, steps)
    beaten = _beaten(out)
    if beaten and remeasure is not None:
        stale, peak = peak, remeasure()
        out = _figures(cost, peak, steps)
        out.remeasured = (f"the cached peak ({_peak_text(stale, beaten)}, measured {stale.measured_at}) was below "
                          "what a step achieved: measured again now")
        beaten = _beaten(out)
    if beaten:
        for r in out.rows.values():
            if r["dtype"] in beaten:
                r["mfu"] = None
        out.withheld = _withheld_text(out, beaten, peak)
    return out


def _figures(cost: StepCost, peak: Peak, steps: dict[str, tuple[str, str, float]]) -> Efficiency:
    """The figures of each step against ``peak``, as they come (an MFU over 1 included)."""
    out = Efficiency(cost.flops, peak.key, peak.cached, dict(peak.flops), intensity=cost.intensity,
                     pointwise_share=cost.pointwise_bytes / max(cost.traffic_bytes, 1), top_layer=cost.top_layer,
                     top_layer_bytes=cost.top_layer_bytes, top_layer_flops=cost.top_layer_flops)
    for label, (name, dtype, step_s) in steps.items():
        if dtype in peak.flops and step_s and step_s > 0:
            out.rows[label] = {"name": name, "dtype": dtype, "step_s": step_s, "flops_per_s": cost.flops / step_s,
                               "mfu": mfu(cost.flops, step_s, peak.flops[dtype])}
    return out


def _beaten(e: Efficiency) -> list[str]:
    """The dtypes whose peak some step of ``e`` achieved more than (in the order of the rows)."""
    return list(dict.fromkeys(r["dtype"] for r in e.rows.values() if r["mfu"] is not None and r["mfu"] > 1.0))


def _peak_text(peak: Peak, dtypes: list[str]) -> str:
    """``fp32 12.0 GFLOP/s`` for each of ``dtypes``."""
    return ", ".join(f"{d} {rate(peak.flops[d])}" for d in dtypes)


def _withheld_text(e: Efficiency, beaten: list[str], peak: Peak) -> str:
    """One line: which MFU is withheld, the figures that disagree, and how to measure the peak again."""
    best = {d: max(r["flops_per_s"] for r in e.rows.values() if r["dtype"] == d) for d in beaten}
    achieved = ", ".join(f"{d} {rate(f)}" for d, f in best.items())
    device = " --device cpu" if "|threads=" in peak.key else ""
    source = "measured again now" if not peak.cached else f"cached, measured {peak.measured_at}"
    return (f"MFU withheld: a step achieved more ({achieved} of model FLOPs) than this machine's matmul peak "
            f"({_peak_text(peak, beaten)}, {source}): that peak is too low (its measurement was disturbed); "
            f"measure it again on a quiet machine with `torch-tricks peak --refresh{device}`")
