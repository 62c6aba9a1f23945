"""Per-layer summary: shapes, parameters, MACs/FLOPs, memory access cost, activations (P1, P2).

One forward pass in eval mode under ``no_grad``, counted at the ATen operator level (see
:mod:`torch_tricks.inspect.flops` for the conventions), so functional code that is not a
module (``matmul``, attention, ``einsum``) is counted and attributed to the module whose
``forward`` ran it, and a module called twice is counted twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
import torch.nn as nn

from torch_tricks._format import human_bytes, shape_str, si, table
from torch_tricks.errors import UserError
from torch_tricks.inspect.advice import advice_text
from torch_tricks.inspect.flops import ModuleRecord, OpCounter, _unfused_attention
from torch_tricks.inspect.inputs import describe_inputs, input_tensors, split_inputs

__all__ = ["Row", "Summary", "summary", "ForwardError"]


@dataclass
class Row:
    """One module of the table; cost columns include everything the module called."""

    name: str
    type: str
    depth: int
    calls: int
    input_shapes: Any
    output_shapes: Any
    params: int
    trainable: int
    frozen: int
    macs: int
    flops: int
    mac_bytes: int
    activation_bytes: int
    pointwise_bytes: int
    is_leaf: bool
    branches: int
    extra: dict[str, Any] = field(default_factory=dict)  # layer hyper-parameters for the advisor


@dataclass
class Summary:
    """The result of :func:`summary`. ``rows`` holds modules down to ``depth``; ``all_rows``
    every module that ran; ``totals`` the whole model."""

    model: str
    inputs: str
    rows: list[Row]
    all_rows: list[Row]
    totals: dict[str, int]
    by_operator: dict[str, int]  # MACs per operator family
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "inputs": self.inputs,
            "conventions": {
                "flops": "FLOPs = 2 x MACs; MACs of conv, linear, matmul/bmm/einsum, attention, RNN matmuls",
                "mac_bytes": "memory access cost: bytes read (inputs + weights) + bytes written, summed over operators",
                "activation_bytes": "bytes of each module's outputs; total = sum over leaf modules",
            },
            "totals": dict(self.totals),
            "by_operator": dict(self.by_operator),
            "rows": [_jsonable(asdict(r)) for r in self.rows],
        }

    def to_text(self, model_name: str | None = None, advice: Sequence[Any] = ()) -> str:
        """What ``torch-tricks summary`` prints: the per-layer table, the totals and, given the
        :func:`~torch_tricks.inspect.advisor.advise` list of this summary, one line per advice
        pattern. ``model_name`` (default: the model's class) heads the table."""
        rows = [
            ["  " * (r.depth - 1) + r.name + (f" x{r.calls}" if r.calls > 1 else ""), r.type,
             shape_str(r.output_shapes), f"{r.params:,}", si(r.macs), human_bytes(r.mac_bytes),
             human_bytes(r.activation_bytes)]
            for r in self.rows
        ]
        t = self.totals
        lines = [
            f"{model_name or self.model}: input {self.inputs}",
            table(["layer", "type", "output", "params", "MACs", "mem access", "activations"], rows, "lllrrrr"),
            "",
            f"params: {t['params']:,} ({t['trainable_params']:,} trainable, {t['frozen_params']:,} frozen), "
            f"{human_bytes(t['param_bytes'])} with buffers",
            f"MACs: {si(t['macs'])}   FLOPs: {si(t['flops'])} (= 2 x MACs; conv, linear, matmul, attention, RNN)",
            f"memory access cost: {human_bytes(t['mac_bytes'])} "
            f"({t['pointwise_bytes'] / max(t['mac_bytes'], 1):.0%} in element-wise ops)   "
            f"activations (leaf outputs): {human_bytes(t['activation_bytes'])}",
            "by operator: " + ", ".join(f"{k} {si(v)}" for k, v in self.by_operator.items()),
        ]
        if advice:
            lines += ["", advice_text(list(advice))]
        return "\n".join(lines)


class ForwardError(UserError):
    """The model's forward raised: names the innermost module and its input shapes."""


def summary(
    model: nn.Module,
    inputs: Any,
    *,
    depth: int = 3,
    kwargs: dict[str, Any] | None = None,
    train_mode: bool = False,
) -> Summary:
    """Table of what ``model`` costs on ``inputs``: a tensor, a tuple of positional inputs or a
    dict of keyword inputs (``kwargs`` adds keyword inputs to positional ones).

    ``depth`` limits the rows shown (``0`` = totals only; negative is a :class:`UserError`);
    deeper modules are folded into their ancestors, whose columns already include them. The
    model's train/eval mode is restored afterwards.
    """
    if depth < 0:
        raise UserError(f"depth must be >= 0, got {depth!r}")
    args, named = split_inputs(inputs)
    named = {**named, **(kwargs or {})}
    counter = _count_forward(model, args, named, train_mode)
    all_rows = [_row(counter.records[n]) for n in _tree_order(model, counter)]
    root = counter.records.get("")
    tensors = input_tensors(args) + input_tensors(named)
    return Summary(
        model=type(model).__name__,
        inputs=_describe(args, named),
        rows=_down_to(all_rows, depth),
        all_rows=all_rows,
        totals=_totals(model, root, all_rows, tensors),
        by_operator=_families(root.total.by_op if root else {}),
        input_shapes=[tuple(t.shape) for t in tensors],
    )


# -- helpers -----------------------------------------------------------------------------

def _down_to(rows: list[Row], depth: int) -> list[Row]:
    """The rows shown: modules down to ``depth``, the model's own (totals) row left out."""
    return [r for r in rows if r.name and r.depth <= depth]


def _count_forward(model: nn.Module, args: tuple[Any, ...], named: dict[str, Any], train_mode: bool) -> OpCounter:
    """One counted forward in the requested mode; the model's mode is restored afterwards."""
    was_training = model.training
    model.train(train_mode)
    counter = OpCounter(model)
    try:
        with torch.no_grad(), _unfused_attention(), counter:
            model(*args, **named)
    except UserError:
        raise
    except Exception as exc:
        raise _forward_error(exc, counter, _describe(args, named)) from exc
    finally:
        model.train(was_training)
    return counter


def _totals(model: nn.Module, root: ModuleRecord | None, all_rows: list[Row],
            tensors: list[torch.Tensor]) -> dict[str, int]:
    trainable, frozen = _param_counts(model)
    totals = {
        "params": trainable + frozen,
        "trainable_params": trainable,
        "frozen_params": frozen,
        "param_bytes": _param_bytes(model),
        "macs": 0,
        "flops": 0,
        "mac_bytes": 0,
        "pointwise_bytes": 0,
        "activation_bytes": sum(r.activation_bytes for r in all_rows if r.is_leaf),
        "input_bytes": sum(t.numel() * t.element_size() for t in tensors),
    }
    if root:
        for key in ("macs", "flops", "mac_bytes", "pointwise_bytes"):
            totals[key] = getattr(root.total, key)
    return totals


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return ", ".join(d for d in (describe_inputs(args), describe_inputs(kwargs)) if d)


def _forward_error(exc: Exception, counter: OpCounter, inputs: str) -> ForwardError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    frame = counter.failed_in
    if frame is None or frame.rec.name == "":
        where = f"the model's forward ({type(counter.model).__name__})"
        shapes = inputs
    else:
        where = f"module '{frame.rec.name}' ({type(frame.rec.module).__name__})"
        shapes = ", ".join(str(s) for s in frame.rec.input_shapes or []) or "no tensor inputs"
    return ForwardError(
        f"forward failed in {where} on input {shapes}: {type(exc).__name__}: {first} "
        "(check --input: shape excludes the batch, e.g. 3x224x224)"
    )


def _tree_order(model: nn.Module, counter: OpCounter) -> list[str]:
    """Modules that ran, in definition (tree) order, so nesting reads top-down."""
    ran = counter.records
    return [n for n, _ in model.named_modules() if n in ran]


def _row(rec: ModuleRecord) -> Row:
    m = rec.module
    trainable, frozen = _param_counts(m)
    return Row(
        name=rec.name,
        type=type(m).__name__,
        depth=0 if rec.name == "" else rec.name.count(".") + 1,
        calls=rec.calls,
        input_shapes=rec.input_shapes,
        output_shapes=rec.output_shapes,
        params=trainable + frozen,
        trainable=trainable,
        frozen=frozen,
        macs=rec.total.macs,
        flops=rec.total.flops,
        mac_bytes=rec.total.mac_bytes,
        activation_bytes=rec.output_bytes,
        pointwise_bytes=rec.total.pointwise_bytes,
        is_leaf=next(m.children(), None) is None,
        branches=rec.branches,
        extra=_layer_extra(m),
    )


def _param_counts(module: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) element counts, each shared parameter counted once."""
    trainable = frozen = 0
    for p in module.parameters():  # parameters() already de-duplicates shared tensors
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()) + sum(
        b.numel() * b.element_size() for b in module.buffers()
    )


_LAYER_EXTRA: tuple[tuple[type, tuple[str, ...]], ...] = (
    (nn.modules.conv._ConvNd, ("in_channels", "out_channels", "groups", "kernel_size")),
    (nn.Linear, ("in_features", "out_features")),
    (nn.Embedding, ("num_embeddings", "embedding_dim")),
    (nn.MultiheadAttention, ("embed_dim", "num_heads", "head_dim")),
    (nn.RNNBase, ("input_size", "hidden_size")),
    (nn.modules.batchnorm._BatchNorm, ("num_features",)),
)


def _layer_extra(m: nn.Module) -> dict[str, Any]:
    for cls, attrs in _LAYER_EXTRA:
        if isinstance(m, cls):
            extra = {a: getattr(m, a) for a in attrs}
            if "kernel_size" in extra:
                extra["kernel_size"] = tuple(extra["kernel_size"])
            return extra
    return {}


_FAMILY = {
    "convolution": "conv", "_convolution": "conv", "conv2d": "conv", "cudnn_convolution": "conv",
    "_slow_conv2d_forward": "conv", "convolution_overrideable": "conv",
    "addmm": "linear/matmul", "mm": "linear/matmul", "bmm": "linear/matmul", "baddbmm": "linear/matmul",
    "_scaled_mm": "linear/matmul", "_trilinear": "linear/matmul",
}


def _families(by_op: dict[str, int]) -> dict[str, int]:
    """Group per-operator MACs into conv / linear-matmul / attention / rnn families."""
    out: dict[str, int] = {}
    for op, macs in by_op.items():
        fam = _FAMILY.get(op)
        if fam is None:
            fam = "attention" if "attention" in op else ("rnn" if op.startswith("rnn.") else op)
        out[fam] = out.get(fam, 0) + macs
    return dict(sorted(out.items()))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
