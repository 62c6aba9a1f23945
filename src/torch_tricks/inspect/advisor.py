"""Design advice from a summary: the ShuffleNetV2 rules (T8) and tensor-core dims (T23).

ShuffleNetV2 (Ma et al., 2018) found that FLOPs do not predict speed; memory access
cost (MAC) and parallelism do. Its four guidelines, checked here per layer:

* G1: equal input and output channels minimise MAC for a given FLOP count; for a 1×1
  conv the excess is ``(c1 + c2) / (2·sqrt(c1·c2))``.
* G2: group convolutions raise MAC (depthwise convs most: few FLOPs per byte moved).
* G3: network fragmentation (many small parallel branches) hurts parallelism. Branches
  whose outputs are summed (RepVGG's 3x3 + 1x1 + identity) merge by re-parameterization;
  parallel projections of one input (attention's Q, K and V) cannot, but fuse into one
  wider matmul (fused QKV). Each branching is reported once, at the innermost block.
* G4: element-wise operators (ReLU, add, bias) cost memory traffic, not FLOPs.

T23: tensor cores (fp16/bf16 on NVIDIA, and AMX/oneDNN blocking on CPUs) want the
matmul dims — channels, features, head dims — to be multiples of 8.

A 12-layer model repeats each finding 12 times: :func:`group_advice` folds advice that
differs only in the layer index (``encoder.layer.0`` ... ``encoder.layer.11``) into one
line with the count and the first modules.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from torch_tricks.inspect.summarize import Summary

__all__ = ["Advice", "advise", "group_advice", "advice_text"]


@dataclass
class Advice:
    rule: str  # G1..G4, T23
    severity: str  # "info" | "warn"
    module: str  # a module name; for a group, the pattern ("encoder.layer.*.attention")
    message: str
    count: int = 1  # modules this line stands for (group_advice)
    modules: list[str] = field(default_factory=list)  # for a group: the first few module names

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def advise(
    s: Summary,
    *,
    channel_ratio: float = 4.0,
    branches: int = 3,
    pointwise_share: float = 0.3,
    multiple: int = 8,
) -> list[Advice]:
    """Advice for every module of ``s`` (all depths), most important first.

    Thresholds: G1 flags an in/out channel ratio of at least ``channel_ratio`` (either
    way); G3 a block whose input feeds ``branches`` or more compute operators; G4 a
    model whose element-wise operators move at least ``pointwise_share`` of its bytes,
    and a block where they do and their share is 10 points above the model's; T23 dims not divisible by ``multiple``.
    """
    out: list[Advice] = []
    g4_flagged: list[str] = []
    model_share = s.totals["pointwise_bytes"] / s.totals["mac_bytes"] if s.totals.get("mac_bytes") else 0.0
    compute = [r.name for r in s.all_rows if r.is_leaf and _matmul_dims(r)]
    first_compute, last_compute = (compute[0], compute[-1]) if compute else (None, None)
    for r in s.all_rows:
        out.extend(_channel_advice(r, channel_ratio, first_compute))
        if not r.is_leaf and r.branches >= branches and not _branching_inside(s, r):
            out.append(_fragmentation(s, r))
        g4 = _pointwise_block_advice(r, g4_flagged, max(pointwise_share, model_share + 0.1))
        if g4 is not None:
            g4_flagged.append(r.name)
            out.append(g4)
        out.extend(_dims_advice(s, r, multiple, first_compute, last_compute))
    total = s.totals
    if total.get("mac_bytes") and total["pointwise_bytes"] / total["mac_bytes"] >= pointwise_share:
        out.insert(0, Advice("G4", "warn", "(model)",
            f"element-wise ops move {total['pointwise_bytes'] / total['mac_bytes']:.0%} of all bytes: "
            "fusion (deploy fuse, torch.compile) will pay off"))
    order = {"warn": 0, "info": 1}
    return sorted(out, key=lambda a: order[a.severity])


def group_advice(advice: list[Advice], keep: int = 3) -> list[Advice]:
    """One line per pattern: advice of the same rule, severity and message (numbers aside) on
    modules whose names differ only in their indices is folded into one :class:`Advice` whose
    ``module`` is the pattern (``encoder.layer.*.attention``), with ``count`` and the first
    ``keep`` module names; the first one's message stands for all. Order is kept."""
    groups: dict[tuple, Advice] = {}
    for a in advice:
        pattern = _INDEX.sub("*", a.module) if a.module != "(model)" else a.module
        key = (a.rule, a.severity, pattern, _NUMBER.sub("#", a.message))
        g = groups.get(key)
        if g is None:
            groups[key] = Advice(a.rule, a.severity, a.module, a.message, 1, [a.module])
        else:
            g.count += 1
            g.module = pattern
            if len(g.modules) < keep:
                g.modules.append(a.module)
    return list(groups.values())


def advice_text(advice: list[Advice], grouped: list[Advice] | None = None, shown_at_most: int = 12) -> str:
    """The advice lines ``torch-tricks summary`` prints: a heading, then one line per pattern of
    ``grouped`` (default: :func:`group_advice` of ``advice``) with its modules counted, the first
    ``shown_at_most`` of them, so a 12-layer model does not print 12 copies. Empty for no advice."""
    if not advice:
        return ""
    if grouped is None:
        grouped = group_advice(advice)
    shown = grouped[:shown_at_most]
    lines = [f"advice ({len(advice)} in {len(grouped)} pattern(s); ShuffleNetV2 G1-G4, tensor-core dims T23):"]
    for a in shown:
        where = (f" (x{a.count}: {', '.join(a.modules)}{', ...' if a.count > len(a.modules) else ''})"
                 if a.count > 1 else "")
        lines.append(f"  [{a.rule} {a.severity}] {a.module}{where}: {a.message}")
    if len(grouped) > len(shown):
        lines.append(f"  ... {len(grouped) - len(shown)} more (use --json for all)")
    return "\n".join(lines)


_INDEX = re.compile(r"(?:(?<=^)|(?<=\.))\d+(?=\.|$)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _channel_advice(r, channel_ratio: float, first_compute: str | None) -> list[Advice]:
    """G1 (unequal in/out channels) and G2 (group convolutions) for a conv row; nothing for others."""
    e = r.extra
    if "in_channels" not in e:
        return []
    out: list[Advice] = []
    c1, c2, g = e["in_channels"], e["out_channels"], e["groups"]
    ratio = max(c1, c2) / max(min(c1, c2), 1)
    if g == 1 and ratio >= channel_ratio and r.name != first_compute:
        excess = (c1 + c2) / (2 * math.sqrt(c1 * c2))
        out.append(Advice("G1", "info", r.name,
            f"{c1}->{c2} channels (ratio {ratio:.0f}): a 1x1 conv at this ratio moves "
            f"{(excess - 1) * 100:.0f}% more activation bytes than equal widths at the same FLOPs"))
    if g > 1:
        kind = "depthwise" if g == c1 == c2 or (g == c1 and c2 % c1 == 0) else f"{g}-group"
        out.append(Advice("G2", "info", r.name,
            f"{kind} conv: few FLOPs per byte moved, so it runs far below peak; "
            "fewer groups or fused kernels help"))
    return out


def _pointwise_block_advice(r, flagged: list[str], threshold: float) -> Advice | None:
    """G4 for a block whose element-wise share reaches ``threshold``, once per subtree (not inside ``flagged``)."""
    share = r.pointwise_bytes / r.mac_bytes if r.mac_bytes else 0.0
    nested = any(r.name.startswith(f + ".") for f in flagged)  # say it once per subtree
    if r.is_leaf or not r.name or nested or share < threshold:
        return None
    return Advice("G4", "info", r.name,
        f"element-wise ops move {r.pointwise_bytes / r.mac_bytes:.0%} of its bytes; "
        "fuse them (Conv-BN-ReLU fusion, torch.compile, inplace activations)")


def _dims_advice(s: Summary, r, multiple: int, first_compute: str | None, last_compute: str | None) -> list[Advice]:
    """T23 for each matmul dim of ``r`` not a multiple of ``multiple``; only "info" where the data or
    the classes set it (the first layer's input, the last layer's output)."""
    out: list[Advice] = []
    for dim_name, value in _matmul_dims(r).items():
        if value % multiple:
            reads_input = r.name == first_compute or (r.input_shapes or None) == s.input_shapes
            edge = (reads_input and dim_name in ("in_channels", "in_features")) or (
                r.name == last_compute and dim_name in ("out_channels", "out_features"))
            out.append(Advice("T23", "info" if edge else "warn", r.name,
                f"{dim_name}={value} is not a multiple of {multiple}: tensor cores and blocked "
                f"CPU kernels pad it; use {math.ceil(value / multiple) * multiple}"
                + (" (set by the data or the classes: pad only if this layer dominates)" if edge else "")))
    return out


def _branching_inside(s: Summary, r) -> bool:
    """A block inside ``r`` has as many branches: the branching is its (the encoder, the layer and
    the attention all "see" the Q/K/V projections of the attention's input)."""
    return any(o.name.startswith(r.name + ".") and not o.is_leaf and o.branches >= r.branches
               for o in s.all_rows) if r.name else any(not o.is_leaf and o.name and o.branches >= r.branches
                                                        for o in s.all_rows)


def _fragmentation(s: Summary, r) -> Advice:
    """G3 for block ``r``, with the remedy that applies to its kind of branches."""
    inside = [o for o in s.all_rows if o.is_leaf and (o.name.startswith(r.name + ".") if r.name else o.name)]
    same_input = [o for o in inside if "in_features" in o.extra and o.input_shapes and r.input_shapes
                  and o.input_shapes[0] == r.input_shapes[0]]
    if len(same_input) >= 2:
        widths = "+".join(str(o.extra["out_features"]) for o in same_input)
        names = ", ".join(o.name.rsplit(".", 1)[-1] for o in same_input)
        return Advice("G3", "info", r.name,
                      f"{len(same_input)} projections of one input ({names}): fuse them into one Linear of "
                      f"width {widths} (fused QKV: one matmul instead of {len(same_input)}); re-parameterization "
                      "does not apply, their outputs are not summed")
    if any("in_channels" in o.extra for o in inside):
        return Advice("G3", "warn", r.name,
                      f"its input feeds {r.branches} parallel compute ops (fragmentation); if their outputs are "
                      "summed, merge them for inference (re-parameterize, torch-tricks deploy)")
    return Advice("G3", "warn", r.name, f"its input feeds {r.branches} parallel compute ops (fragmentation): "
                                        "fewer, wider operators use the hardware better")


def _matmul_dims(r) -> dict[str, int]:
    e = r.extra
    if "in_channels" in e:
        if e["groups"] > 1:  # per-group dims are what the kernel sees
            return {"in_channels": e["in_channels"] // e["groups"], "out_channels": e["out_channels"] // e["groups"]} \
                if e["in_channels"] // e["groups"] > 1 else {}
        return {"in_channels": e["in_channels"], "out_channels": e["out_channels"]}
    if "in_features" in e:
        return {"in_features": e["in_features"], "out_features": e["out_features"]}
    if "head_dim" in e:
        return {"embed_dim": e["embed_dim"], "head_dim": e["head_dim"]}
    if "hidden_size" in e:
        return {"input_size": e["input_size"], "hidden_size": e["hidden_size"]}
    if "embedding_dim" in e:
        return {"embedding_dim": e["embedding_dim"]}
    return {}
