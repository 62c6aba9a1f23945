"""How far a training step is from the machine's limit: model FLOPs per step, achieved FLOP/s, MFU (issue 22).

The model FLOPs of one training step (forward and backward, fp32, no recomputation: the work the
model needs, whatever a trick adds) are counted once by the package's own counter
(:class:`~torch_tricks.inspect.flops.OpCounter`, which agrees with ``FlopCounterMode``). A step of
``step_s`` seconds then achieves ``flops / step_s`` FLOP/s; its MFU is that over the peak matmul
rate of the dtype it computes in (:func:`~torch_tricks.inspect.peak.device_peak`, measured once per
machine and cached). A step far from its peak is bound elsewhere: the same count gives the step's
arithmetic intensity (FLOPs per byte of memory traffic) and the share of that traffic moved by
element-wise operators, which do no FLOPs.
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
    """MFU of the plain step and of the recommended one, against the machine's cached peak."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = []
        for label, r in self.rows.items():
            if label != "plain" and r["name"] == "plain":
                continue  # the recommendation is the plain step: its line is the plain one
            what = "the plain step" if label == "plain" else f"the recommendation ({r['name']})"
            out.append(f"MFU of {what}: {r['mfu']:.0%} ({rate(r['flops_per_s'])} of model FLOPs, "
                       f"{self.flops_per_step / 1e9:.2f} GFLOP a step, against this machine's {r['dtype']} matmul peak "
                       f"{rate(self.peak_flops[r['dtype']])}, {'cached' if self.peak_cached else 'measured now'})")
        if any(r["mfu"] > 1.0 for r in self.rows.values()):
            out.append("an MFU over 100% means the cached peak is below what the step achieved (its measurement was "
                       "disturbed): measure it again with `torch-tricks peak --refresh`")
        elif any(r["mfu"] < FAR for r in self.rows.values()):
            out.append(f"far from the peak: the step does {self.intensity:.1f} FLOP a byte of memory traffic, and "
                       f"element-wise operators (norms, activations and their gradients) move "
                       f"{self.pointwise_share:.0%} of the bytes: memory-bound work, which fusing (compile) or a "
                       f"larger batch attacks, not faster matmuls"
                       + (f"; the layer whose forward moves the most: {self.top_layer}, "
                          f"{human_bytes(self.top_layer_bytes)} at {self.top_layer_flops / max(self.top_layer_bytes, 1):.1f} "
                          "FLOP a byte" if self.top_layer else ""))
        return out


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


def efficiency(cost: StepCost, peak: Peak, steps: dict[str, tuple[str, str, float]]) -> Efficiency:
    """MFU of each step: ``steps`` maps a label to (its configuration's name, the dtype it computes in, its step
    seconds); a dtype the peak has no rate for is left out."""
    out = Efficiency(cost.flops, peak.key, peak.cached, dict(peak.flops), intensity=cost.intensity,
                     pointwise_share=cost.pointwise_bytes / max(cost.traffic_bytes, 1), top_layer=cost.top_layer,
                     top_layer_bytes=cost.top_layer_bytes, top_layer_flops=cost.top_layer_flops)
    for label, (name, dtype, step_s) in steps.items():
        if dtype in peak.flops and step_s and step_s > 0:
            out.rows[label] = {"name": name, "dtype": dtype, "step_s": step_s, "flops_per_s": cost.flops / step_s,
                               "mfu": mfu(cost.flops, step_s, peak.flops[dtype])}
    return out
