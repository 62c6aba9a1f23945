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
line with the count and the first modules. :class:`Advice`, its grouping and its printing live in
:mod:`torch_tricks.inspect.advice` (the summary prints advice without importing these rules).
"""

from __future__ import annotations

import math
from typing import Any

from torch_tricks.inspect.advice import Advice, advice_text, group_advice  # re-exported: the advisor's names
from torch_tricks.inspect.summarize import Summary

__all__ = ["Advice", "advise", "group_advice", "advice_text"]


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
    model_share = _pointwise_share(s.totals)
    first_compute, last_compute = _compute_ends(s)
    for r in s.all_rows:
        out.extend(_channel_advice(r, channel_ratio, first_compute))
        if _is_fragmented(s, r, branches):
            out.append(_fragmentation(s, r))
        g4 = _pointwise_block_advice(r, g4_flagged, max(pointwise_share, model_share + 0.1))
        if g4 is not None:
            g4_flagged.append(r.name)
            out.append(g4)
        out.extend(_dims_advice(s, r, multiple, first_compute, last_compute))
    if s.totals.get("mac_bytes") and model_share >= pointwise_share:
        out.insert(0, Advice("G4", "warn", "(model)",
            f"element-wise ops move {model_share:.0%} of all bytes: "
            "fusion (deploy fuse, torch.compile) will pay off"))
    order = {"warn": 0, "info": 1}
    return sorted(out, key=lambda a: order[a.severity])


def _pointwise_share(totals: dict[str, int]) -> float:
    return totals["pointwise_bytes"] / totals["mac_bytes"] if totals.get("mac_bytes") else 0.0


def _compute_ends(s: Summary) -> tuple[str | None, str | None]:
    """The first and last leaf compute layers (their dims are set by the data and the classes)."""
    compute = [r.name for r in s.all_rows if r.is_leaf and _matmul_dims(r)]
    return (compute[0], compute[-1]) if compute else (None, None)


def _is_inside(name: str, block: str) -> bool:
    """Module ``name`` lies strictly inside ``block`` (every named module lies inside the root "")."""
    return name.startswith(block + ".") if block else bool(name)


def _is_fragmented(s: Summary, r, branches: int) -> bool:
    return not r.is_leaf and r.branches >= branches and not _branching_inside(s, r)


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
        out.append(Advice("G2", "info", r.name,
            f"{_group_kind(g, c1, c2)} conv: few FLOPs per byte moved, so it runs far below peak; "
            "fewer groups or fused kernels help"))
    return out


def _group_kind(groups: int, c1: int, c2: int) -> str:
    """``depthwise`` for one group per input channel, else ``N-group``."""
    if groups == c1 == c2 or (groups == c1 and c2 % c1 == 0):
        return "depthwise"
    return f"{groups}-group"


def _pointwise_block_advice(r, flagged: list[str], threshold: float) -> Advice | None:
    """G4 for a block whose element-wise share reaches ``threshold``, once per subtree (not inside ``flagged``)."""
    share = r.pointwise_bytes / r.mac_bytes if r.mac_bytes else 0.0
    nested = any(_is_inside(r.name, f) for f in flagged)  # say it once per subtree
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
            edge = _is_edge_dim(s, r, dim_name, first_compute, last_compute)
            out.append(Advice("T23", "info" if edge else "warn", r.name,
                f"{dim_name}={value} is not a multiple of {multiple}: tensor cores and blocked "
                f"CPU kernels pad it; use {math.ceil(value / multiple) * multiple}"
                + (" (set by the data or the classes: pad only if this layer dominates)" if edge else "")))
    return out


def _is_edge_dim(s: Summary, r, dim_name: str, first_compute: str | None, last_compute: str | None) -> bool:
    """The dim is the data's (the first layer's input) or the classes' (the last layer's output)."""
    reads_input = r.name == first_compute or (r.input_shapes or None) == s.input_shapes
    return (reads_input and dim_name in ("in_channels", "in_features")) or (
        r.name == last_compute and dim_name in ("out_channels", "out_features"))


def _branching_inside(s: Summary, r) -> bool:
    """A block inside ``r`` has as many branches: the branching is its (the encoder, the layer and
    the attention all "see" the Q/K/V projections of the attention's input)."""
    return any(_is_inside(o.name, r.name) and not o.is_leaf and o.branches >= r.branches for o in s.all_rows)


def _fragmentation(s: Summary, r) -> Advice:
    """G3 for block ``r``, with the remedy that applies to its kind of branches."""
    inside = _leaves_inside(s, r)
    same_input = [o for o in inside if "in_features" in o.extra and _same_first_input(o, r)]
    if len(same_input) >= 2:
        return _fuse_projections(r, same_input)
    if any("in_channels" in o.extra for o in inside):
        return Advice("G3", "warn", r.name,
                      f"its input feeds {r.branches} parallel compute ops (fragmentation); if their outputs are "
                      "summed, merge them for inference (re-parameterize, torch-tricks deploy)")
    return Advice("G3", "warn", r.name, f"its input feeds {r.branches} parallel compute ops (fragmentation): "
                                        "fewer, wider operators use the hardware better")


def _leaves_inside(s: Summary, r) -> list:
    return [o for o in s.all_rows if o.is_leaf and _is_inside(o.name, r.name)]


def _fuse_projections(r, projections: list) -> Advice:
    """G3 for Linear layers reading the block's input (Q, K, V): one wider Linear."""
    widths = "+".join(str(o.extra["out_features"]) for o in projections)
    names = ", ".join(o.name.rsplit(".", 1)[-1] for o in projections)
    return Advice("G3", "info", r.name,
                  f"{len(projections)} projections of one input ({names}): fuse them into one Linear of "
                  f"width {widths} (fused QKV: one matmul instead of {len(projections)}); re-parameterization "
                  "does not apply, their outputs are not summed")


def _same_first_input(o, r) -> bool:
    return bool(o.input_shapes and r.input_shapes and o.input_shapes[0] == r.input_shapes[0])


# the layer hyper-parameter that identifies each kind of non-conv layer, and its matmul dims
_MATMUL_DIMS = (
    ("in_features", ("in_features", "out_features")),
    ("head_dim", ("embed_dim", "head_dim")),
    ("hidden_size", ("input_size", "hidden_size")),
    ("embedding_dim", ("embedding_dim",)),
)


def _matmul_dims(r) -> dict[str, int]:
    e = r.extra
    if "in_channels" in e:
        return _conv_dims(e)
    for key, dims in _MATMUL_DIMS:
        if key in e:
            return {d: e[d] for d in dims}
    return {}


def _conv_dims(e: dict[str, Any]) -> dict[str, int]:
    g = e["groups"]
    if g > 1:  # per-group dims are what the kernel sees; none for a depthwise conv
        return {"in_channels": e["in_channels"] // g, "out_channels": e["out_channels"] // g} \
            if e["in_channels"] // g > 1 else {}
    return {"in_channels": e["in_channels"], "out_channels": e["out_channels"]}
