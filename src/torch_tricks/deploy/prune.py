"""Pruning: unstructured (zeros in the weights) and structured (fewer channels) (catalogue I5).

* :func:`prune_unstructured` zeroes the smallest weights with :mod:`torch.nn.utils.prune`.
  The tensors keep their shape, so dense kernels do the same work: it makes a model
  *compressible* (a sparse format, gzip) and is a step towards sparse kernels, but on
  its own it is **not** faster and not smaller on disk. The report says so.
* :func:`prune_channels` removes whole output channels of convolutions, and with them
  the matching BN entries and the input channels of every layer that reads them, so
  the tensors really shrink and the model is smaller and faster.

``torch.nn.utils.prune.ln_structured`` only *masks* channels to zero (shapes unchanged)
and PyTorch has no tool that rewrites the layers that depend on a channel, so that part
is written here: the model is traced with :mod:`torch.fx` and each conv's output
channels are followed through BN, activations, pooling, dropout, flatten (into the
next linear), residual adds and ``torch.cat`` to the layers that consume them:

* convs whose outputs are **added** (ResNet shortcuts, inverted residuals) form one
  group and keep the *same* channel indices, chosen from their summed importance;
* a **depthwise** conv (``groups == in == out``) keeps exactly the channels of its
  input (its weight and ``groups`` shrink with them);
* a **grouped** conv (``1 < groups``) keeps the same number of channels in every group,
  on its input and its output, so ``groups`` still divides both;
* a **linear** after ``flatten``/``view(N, -1)`` of a ``C x H x W`` map loses the
  ``H*W`` features of each removed channel.

Channels that reach the model output, feed an operation not in that list (a reshape
that mixes channels, a functional conv, a layer called twice...), or belong to a group
with such a member are left alone and listed in the report. Linear layers' own
outputs are not pruned (only their inputs follow the convs).
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Iterable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as tprune
from torch.fx.passes.shape_prop import ShapeProp

from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.inputs import as_input_tuple
from torch_tricks.inspect.summarize import summary
from torch_tricks.deploy.steps import Coverage, StepContext, StepResult, deploy_step
from torch_tricks.registry import register_trick

__all__ = [
    "UnstructuredReport",
    "ChannelPruneReport",
    "prune_unstructured",
    "prune_unstructured_with_report",
    "prune_channels",
    "prune_channels_with_report",
]


# -- unstructured ---------------------------------------------------------------------------

@dataclass
class UnstructuredReport:
    """Sparsity after :func:`prune_unstructured` (share of zero weights), overall and per layer."""

    amount: float
    global_: bool
    sparsity: float
    per_layer: dict[str, float] = field(default_factory=dict)
    permanent: bool = True
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@register_trick(
    "prune_unstructured",
    ids=("I5",),
    kind="deploy",
    trades="zeros in the weights (compressible, a start for sparse kernels) for accuracy; dense kernels are not faster",
    needs="Conv/Linear weights",
)
def prune_unstructured(
    model: nn.Module, amount: float = 0.5, *, global_: bool = True, make_permanent: bool = True
) -> nn.Module:
    """A copy of ``model`` whose conv/linear weights have the ``amount`` smallest (|w|) set to zero.

    ``global_=True`` ranks all weights together (:func:`torch.nn.utils.prune.global_unstructured`),
    so layers with many small weights lose more; ``False`` prunes ``amount`` of each layer.
    ``make_permanent`` bakes the zeros into ``weight`` (:func:`torch.nn.utils.prune.remove`);
    otherwise the copy keeps ``weight_orig`` + ``weight_mask`` and a hook that re-applies the
    mask, as needed to fine-tune with the zeros held. The result is as large and as fast as
    the original: see :func:`prune_channels` for a model that really shrinks.
    """
    return prune_unstructured_with_report(model, amount, global_=global_, make_permanent=make_permanent)[0]


def prune_unstructured_with_report(
    model: nn.Module, amount: float = 0.5, *, global_: bool = True, make_permanent: bool = True
) -> tuple[nn.Module, UnstructuredReport]:
    """:func:`prune_unstructured`, returning ``(model, UnstructuredReport)``."""
    _check_model(model, "prune_unstructured")
    if not _is_fraction(amount):
        raise UserError(f"prune amount must be a fraction in [0, 1), got {amount!r}")
    out = copy.deepcopy(model)
    targets = _weight_layers(out)
    if not targets:
        raise UserError("prune_unstructured: the model has no Conv/Linear weights to prune")
    _zero_smallest(targets, float(amount), global_)
    if make_permanent:
        for _, m in targets:
            tprune.remove(m, "weight")
    return out, _unstructured_report(targets, float(amount), global_, make_permanent)


def _weight_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The conv/linear layers with a weight parameter not already pruned."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear))
            and isinstance(getattr(m, "weight", None), nn.Parameter) and not tprune.is_pruned(m)]


def _zero_smallest(targets: list[tuple[str, nn.Module]], amount: float, global_: bool) -> None:
    """Mask the ``amount`` smallest weights, ranked over all ``targets`` or within each."""
    if global_:
        tprune.global_unstructured([(m, "weight") for _, m in targets],
                                   pruning_method=tprune.L1Unstructured, amount=amount)
    else:
        for _, m in targets:
            tprune.l1_unstructured(m, "weight", amount=amount)


def _unstructured_report(targets: list[tuple[str, nn.Module]], amount: float, global_: bool,
                         permanent: bool) -> UnstructuredReport:
    per_layer = {n: float((m.weight == 0).float().mean()) for n, m in targets}
    total = sum(m.weight.numel() for _, m in targets)
    zeros = sum(int((m.weight == 0).sum()) for _, m in targets)
    rep = UnstructuredReport(
        amount=amount, global_=global_, sparsity=zeros / total, per_layer=per_layer,
        permanent=permanent,
        notes=["dense kernels do the same work on zeros: expect no speed-up and the same size on disk "
               "(the zeros compress, and sparse kernels or structured pruning can use them)"],
    )
    if not permanent:
        rep.notes.append("masks kept (weight_orig + weight_mask): the state dict is about twice as large")
    return rep


# -- structured (channels) ---------------------------------------------------------------

@dataclass
class ChannelPruneReport:
    """What :func:`prune_channels_with_report` removed.

    ``amount`` is the share of channels removed from each pruned group (the one found
    for ``target_macs`` if that was given); ``groups`` lists each channel group that was
    pruned (its conv layers, channels before -> after, ``residual`` when the convs meet in
    an add and so share their kept channels); ``skipped`` the convs whose
    outputs were left alone and why. ``macs_before`` is measured on the example inputs
    (:func:`torch_tricks.inspect.summarize.summary`); ``macs_after`` is that minus the change in
    the conv/linear MACs, counted from the traced shapes with the same convention.
    """

    amount: float
    importance: str
    macs_before: int
    macs_after: int
    params_before: int
    params_after: int
    target_macs: float | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def mac_ratio(self) -> float:
        return self.macs_after / self.macs_before if self.macs_before else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mac_ratio"] = self.mac_ratio
        return d


def prune_channels(
    model: nn.Module,
    example_inputs: Any,
    amount: float | None = None,
    *,
    target_macs: float | None = None,
    importance: str = "l1",
    round_to: int = 8,
) -> nn.Module:
    """A copy of ``model`` with conv output channels physically removed (see the module doc).

    ``amount`` is the share of channels removed from every prunable group (0.5 by default);
    since a conv's cost scales with its input *and* output channels, removing 50% of all
    channels leaves about a quarter of the conv MACs. ``target_macs`` instead gives the
    share of the model's MACs to keep (``0.5`` = about half) and finds the ``amount``
    that gets there. Channels are ranked by the L1 (``importance="l1"``) or L2 norm of
    their filters, summed over the convs of a residual group; kept counts are multiples
    of ``round_to`` (where the layer is wider), which vectorised kernels prefer.
    The input model is not changed; the copy keeps its train/eval mode.
    """
    return prune_channels_with_report(
        model, example_inputs, amount, target_macs=target_macs, importance=importance, round_to=round_to
    )[0]


def prune_channels_with_report(
    model: nn.Module,
    example_inputs: Any,
    amount: float | None = None,
    *,
    target_macs: float | None = None,
    importance: str = "l1",
    round_to: int = 8,
) -> tuple[nn.Module, ChannelPruneReport]:
    """:func:`prune_channels`, returning ``(model, ChannelPruneReport)``."""
    _check_model(model, "prune_channels")
    amount = _checked_amount(amount, target_macs, importance, round_to)
    args = as_input_tuple(example_inputs)

    work = copy.deepcopy(model)
    was_training = work.training
    work.eval()  # tracing and shape propagation must not update BN statistics or drop out
    gm, ref_out = _trace(work, args)
    base_macs = summary(work, args, depth=0).totals["macs"]
    params_before = _n_params(work)

    deps = _Deps(gm, dict(work.named_modules()))
    deps.walk()
    groups = deps.prunable_groups()
    skipped = deps.skipped()
    if not groups:
        raise _nothing_to_prune(skipped)

    scores = {r: deps.scores(r, importance) for r in groups}
    if target_macs is not None:
        amount = _solve_amount(deps, groups, base_macs, float(target_macs), round_to)
    fixed = base_macs - deps.macs({})  # MACs outside convs/linears (matmuls...): unchanged
    kept = {r: _choose(scores[r], deps.constraint(r), float(amount), round_to) for r in groups}
    deps.apply(kept)
    _check_pruned_runs(work, args, ref_out)
    work.train(was_training)
    # Counted from the traced shapes (the same convention as summary: out elements x in/groups x
    # kernel), which saves a forward; the tests check it against a measured summary.
    macs_after = fixed + deps.macs({r: int(k.numel()) for r, k in kept.items()})
    rep = ChannelPruneReport(
        amount=float(amount), importance=importance, macs_before=base_macs, macs_after=macs_after,
        params_before=params_before, params_after=_n_params(work),
        target_macs=target_macs,
        groups=_pruned_groups(deps, groups, kept),
        skipped=skipped,
    )
    rep.notes.extend(_prune_notes(rep, work))
    return work, rep


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _nothing_to_prune(skipped: list[dict[str, Any]]) -> UserError:
    why = "; ".join(f"{', '.join(s['layers'])}: {s['reason']}" for s in skipped[:3]) or "it has no convolutions"
    return UserError(f"prune_channels: no conv channels can be pruned in this model ({why})"[:400])


def _pruned_groups(deps: _Deps, groups: list[int], kept: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
    """The report's entry for each group that lost channels."""
    return [
        {"layers": deps.members(r), "channels": deps.size(r), "kept": int(kept[r].numel()),
         "residual": len(deps.members(r)) > 1}
        for r in groups if kept[r].numel() < deps.size(r)
    ]


def _checked_amount(amount: float | None, target_macs: float | None, importance: str, round_to: int) -> float | None:
    """Check :func:`prune_channels_with_report`'s options; the amount (0.5 when neither it nor target_macs is given)."""
    if amount is not None and target_macs is not None:
        raise UserError("prune_channels: give amount (share of channels) or target_macs (share of MACs), not both")
    if target_macs is not None and not _is_share(target_macs):
        raise UserError(f"target_macs must be the share of MACs to keep, in (0, 1], got {target_macs!r}")
    if amount is None and target_macs is None:
        amount = 0.5
    if amount is not None and not _is_fraction(amount):
        raise UserError(f"prune amount must be a fraction of channels in [0, 1), got {amount!r}")
    _check_ranking(importance, round_to)
    return amount


def _check_ranking(importance: str, round_to: int) -> None:
    """How channels are ranked and how their kept counts are rounded."""
    if importance not in ("l1", "l2"):
        raise UserError(f"importance must be 'l1' or 'l2', got {importance!r}")
    if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
        raise UserError(f"round_to must be a positive int, got {round_to!r}")


def _trace(work: nn.Module, args: tuple[Any, ...]) -> tuple[fx.GraphModule, Any]:
    """The fx graph of ``work`` with its shapes propagated, and its output on ``args``."""
    try:
        gm = fx.symbolic_trace(work)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(
            f"prune_channels needs a model torch.fx can trace to find channel dependencies: {first[:200]}"
        ) from None
    try:
        with torch.no_grad():
            ref_out = ShapeProp(gm).propagate(*args)
    except Exception as exc:
        raise UserError(f"prune_channels: the model does not run on the example inputs: {exc}".splitlines()[0]) from None
    return gm, ref_out


def _check_pruned_runs(work: nn.Module, args: tuple[Any, ...], ref_out: Any) -> None:
    """The pruned model must run and give outputs of the original's shapes (a forward may hard-code a count)."""
    try:
        with torch.no_grad():
            new_out = work(*args)  # still in eval mode
    except Exception as exc:
        raise UserError(
            f"prune_channels: the pruned model fails to run ({one_line(exc)}); "
            "its forward probably hard-codes a channel count"
        ) from None
    if _shapes(new_out) != _shapes(ref_out):
        raise UserError("prune_channels: the pruned model's output shape changed; its forward hard-codes a channel count")


def _prune_notes(rep: ChannelPruneReport, work: nn.Module) -> list[str]:
    """What the report must warn about: a MACs target missed, no fine-tuning, unfolded multi-branch blocks."""
    notes = []
    if rep.target_macs is not None and abs(rep.mac_ratio - rep.target_macs) > 0.1:
        notes.append(
            f"MACs kept {rep.mac_ratio:.2f} of the original, not {rep.target_macs:.2f}: "
            "the layers that cannot be pruned cost too much, or rounding to round_to channels limits the steps"
        )
    notes.append("pruned weights are not fine-tuned: accuracy drops until the model is trained again")
    if any(callable(getattr(m, "reparameterize", None)) and getattr(m, "deployed", None) is False
           for m in work.modules()):
        notes.append("multi-branch blocks were pruned before reparameterize_model: fold them first, "
                     "their reparameterize() uses the channel counts they were built with")
    return notes


# -- the deploy step --------------------------------------------------------------------------


@deploy_step(
    "prune",
    summary="remove conv channels: prune = prune:macs=0.5 (keep ~half the MACs), "
            "prune:0.3 removes 30% of each layer's channels (accuracy drops until fine-tuned)",
    args=("F", "macs=F"),
    check_arg=lambda arg: _check_step_arg(arg),
    order=30,
    ids=("I5",),
    earlier_name="prune_channels",
    fn=prune_channels,
    trades="a physically smaller, faster model for accuracy (fine-tune afterwards to recover it)",
    needs="a torch.fx-traceable conv model and example inputs",
    measured_in="benchmarks/deploy.py",
)
def prune_step(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """The ``prune`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: ``prune:F`` or ``prune:macs=F``."""
    if ctx.arg and not ctx.arg.startswith("macs="):
        amount, target = float(ctx.arg), None
    else:
        amount, target = None, float(ctx.arg.removeprefix("macs=") or 0.5)
    new, rep = prune_channels_with_report(model, ctx.example, amount, target_macs=target)
    new.eval()
    return new, ctx.result(
        backend="torch.fx channel pruning", coverage=_coverage(model, rep),
        details={"amount": rep.amount, "target_macs": rep.target_macs, "macs_before": rep.macs_before,
                 "macs_after": rep.macs_after, "mac_ratio": rep.mac_ratio,
                 "params_before": rep.params_before, "params_after": rep.params_after,
                 "groups_pruned": len(rep.groups), "layers_skipped": len(rep.skipped)},
        notes=[f"removed {rep.amount:.0%} of the channels of {len(rep.groups)} layer groups: "
               f"{rep.mac_ratio:.0%} of the MACs kept", *rep.notes])


def _coverage(model: nn.Module, rep: ChannelPruneReport) -> Coverage:
    """The conv layers that lost output channels, of all the model's convs; the others say why they kept theirs."""
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.modules.conv._ConvNd)]
    pruned = {n for g in rep.groups for n in g["layers"]}
    skipped = {n: s["reason"] for s in rep.skipped for n in s["layers"]}
    kept = {n: skipped.get(n, "every channel kept (the share removed rounds to none of them)")
            for n in convs if n not in pruned}
    return Coverage("pruned", len(convs) - len(kept), len(convs), "conv layers (output channels removed)", kept=kept)


def _check_step_arg(arg: str) -> None:
    """``prune:F`` removes the share F in (0, 1); ``prune:macs=F`` keeps the share F in (0, 1] of the MACs."""
    try:
        f = float(arg.removeprefix("macs="))
    except ValueError:
        f = math.nan
    ok = (0.0 < f <= 1.0) if arg.startswith("macs=") else (0.0 < f < 1.0)
    if not ok:
        raise UserError(
            f"bad prune argument {arg!r}: prune:F removes the share F in (0, 1) of each layer's channels "
            "(e.g. prune:0.3), prune:macs=F keeps the share F in (0, 1] of the MACs (e.g. prune:macs=0.5)"
        )


# -- the dependency graph ---------------------------------------------------------------------

_ELEMENTWISE_MODULES: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Upsample,
    nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReplicationPad2d,
)
_ELEMENTWISE_FUNCTIONS = {
    torch.relu, torch.relu_, F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.gelu, F.silu, F.mish,
    F.hardswish, F.hardsigmoid, F.hardtanh, torch.sigmoid, F.sigmoid, torch.tanh, F.tanh, F.softplus,
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.max_pool1d, F.max_pool2d, F.max_pool3d,
    F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
    F.interpolate, torch.clamp, torch.clip, torch.abs, torch.neg, operator.neg,
}
_ELEMENTWISE_METHODS = {
    "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "clamp", "clamp_", "clip", "abs", "neg",
    "contiguous", "clone", "detach", "float", "to", "type_as",
}
_BINARY = {operator.add, operator.iadd, operator.sub, operator.isub, operator.mul, operator.imul,
           operator.truediv, operator.itruediv, torch.add, torch.sub, torch.mul, torch.div}
_BINARY_METHODS = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"}
_REDUCTIONS = {"mean", "sum", "amax", "amin"}
_HARMLESS_METHODS = {"size", "dim", "numel"}


@dataclass(frozen=True)
class _Layout:
    """Channel layout of a tensor: segments ``(space, width)`` along dim 1, in order;
    ``factor`` > 1 after flattening a ``C x H x W`` map (each channel spans ``H*W`` features)."""

    segs: tuple[tuple[int, int], ...]
    factor: int = 1

    @property
    def width(self) -> int:
        return sum(w for _, w in self.segs) * self.factor

    def aligned_with(self, other: _Layout) -> bool:
        """The same segment widths and flattening factor: channel i of one lines up with channel i of the other."""
        return tuple(w for _, w in self.segs) == tuple(w for _, w in other.segs) and self.factor == other.factor


class _Deps:
    """Channel spaces of a traced model and the layers that read or write them.

    A *space* is the set of output channels of one conv; spaces that must keep the same
    channels (they meet in an add) are merged (union-find). Walking the graph records
    who produces each space, who consumes it (conv/BN/linear inputs) and which spaces
    are frozen (may not be pruned).
    """

    def __init__(self, gm: fx.GraphModule, modules: dict[str, nn.Module]) -> None:
        self.gm, self.modules = gm, modules
        self.parent: list[int] = []
        self.widths: list[int] = []
        self.frozen: dict[int, str] = {}
        self.group_div: dict[int, int] = {}
        self.sources: dict[int, list[str]] = {}  # space -> convs producing it
        self.layout: dict[fx.Node, _Layout | None] = {}
        self.conv_in: dict[str, _Layout] = {}  # groups == 1 or grouped: input channels to slice
        self.depthwise: dict[str, _Layout] = {}  # in == out == groups: follow the input
        self.conv_out: dict[str, int] = {}  # conv -> its output space
        self.norm_in: dict[str, _Layout] = {}  # BN (and PReLU) -> channels to slice
        self.linear_in: dict[str, _Layout] = {}
        self.calls: dict[str, int] = {}
        # conv/linear -> (output elements, out channels, in channels, groups, kernel size), as traced
        self.out_numel: dict[str, tuple[int, int, int, int, int]] = {}
        for n in gm.graph.nodes:
            if n.op == "call_module":
                self.calls[n.target] = self.calls.get(n.target, 0) + 1

    # union-find
    def _new(self, width: int, frozen: str | None = None) -> int:
        self.parent.append(len(self.parent))
        self.widths.append(width)
        if frozen:
            self.frozen[len(self.parent) - 1] = frozen
        return len(self.parent) - 1

    def find(self, e: int) -> int:
        while self.parent[e] != e:
            self.parent[e] = self.parent[self.parent[e]]
            e = self.parent[e]
        return e

    def _union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        self.parent[rb] = ra
        if rb in self.frozen:
            self.frozen.setdefault(ra, self.frozen.pop(rb))
        if rb in self.group_div:
            self.group_div[ra] = math.lcm(self.group_div.get(ra, 1), self.group_div.pop(rb))
        self.sources.setdefault(ra, []).extend(self.sources.pop(rb, []))

    def _freeze(self, lay: _Layout | None, why: str) -> None:
        if lay is None:
            return
        for e, _ in lay.segs:
            self.frozen.setdefault(self.find(e), why)

    def _freeze_all(self, lays: Iterable[_Layout | None], why: str) -> None:
        for lay in lays:
            self._freeze(lay, why)

    def _freeze_nodes(self, objs: Iterable[Any], why: str) -> None:
        for n in _nodes_in(objs):
            self._freeze(self.layout.get(n), why)

    # the walk
    def walk(self) -> None:
        for node in self.gm.graph.nodes:
            self.layout[node] = self._visit(node)

    def _visit(self, node: fx.Node) -> _Layout | None:
        op = node.op
        if op in ("placeholder", "get_attr"):
            return None
        if op == "output":
            self._freeze_nodes(node.args, "reaches the model output")
            return None
        if op == "call_module":
            return self._visit_module(node)
        return self._visit_op(node)

    def _visit_op(self, node: fx.Node) -> _Layout | None:
        """A function or method call: where the channels of its tracked inputs go."""
        x, lx = self._input(node)
        tracked = self._tracked((node.args, node.kwargs))
        if not tracked:
            return None
        name = _op_name(node)
        if _is_method(node, _HARMLESS_METHODS) or _is_function(node, (getattr,)):
            return None  # x.size(), x.shape: no channel data flows
        if _is_binary(node):
            return self._binary(node)
        if lx is not None:
            handled, out = self._channel_op(node, x, lx, tracked, name)
            if handled:
                return out
        if _is_function(node, (torch.cat,)):
            return self._cat(node)
        self._freeze_nodes(tracked, f"feeds {name}, which may mix channels")
        return None

    def _input(self, node: fx.Node) -> tuple[Any, _Layout | None]:
        """A call's first argument and its channel layout (None where it is untracked)."""
        x = node.args[0] if node.args else None
        return x, self._layout_of(x)

    def _layout_of(self, obj: Any) -> _Layout | None:
        return self.layout.get(obj) if isinstance(obj, fx.Node) else None

    def _tracked(self, obj: Any) -> list[fx.Node]:
        """The nodes in ``obj`` (args, kwargs) whose channels are tracked."""
        return [n for n in _nodes_in(obj) if self.layout.get(n) is not None]

    def _channel_op(self, node: fx.Node, x: fx.Node, lx: _Layout, tracked: list[fx.Node],
                    name: str) -> tuple[bool, _Layout | None]:
        """An op on a tracked tensor that keeps or reshapes its channels: (it is one, the layout out)."""
        if _is_function(node, _ELEMENTWISE_FUNCTIONS) or _is_method(node, _ELEMENTWISE_METHODS):
            others = [n for n in tracked if n is not x]
            self._freeze_nodes(others, f"used as an argument of {name}")
            return True, lx
        if _is_function(node, (F.pad,)):
            return True, self._pad(node, x, lx)
        if _is_flatten(node):
            return True, self._flatten(node, lx)
        if name in _REDUCTIONS:
            return True, self._reduce(node, lx)
        return False, None

    def _pad(self, node: fx.Node, x: fx.Node, lx: _Layout) -> _Layout | None:
        """``F.pad`` keeps the channels where it pads the spatial dims only."""
        pad = _arg(node, 1, "pad", ())
        nd = _ndim(x)
        if nd is not None and isinstance(pad, (tuple, list)) and len(pad) // 2 <= nd - 2:
            return lx
        self._freeze(lx, "padded along the channel dim")
        return None

    def _visit_module(self, node: fx.Node) -> _Layout | None:
        name = node.target
        mod = self.modules.get(name)
        x, lx = self._input(node)
        self._freeze_nodes(self._tracked((node.args[1:], node.kwargs)), f"extra input of {name}")
        shared = self.calls.get(name, 0) > 1
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            self.out_numel[name] = (_numel(node), mod.out_channels, mod.in_channels, mod.groups,
                                    math.prod(mod.kernel_size))
            return self._conv(name, mod, lx, shared)
        if _is_channel_norm(mod):
            return self._norm(name, mod, lx, shared)
        if isinstance(mod, nn.Linear):
            self.out_numel[name] = (_numel(node), mod.out_features, mod.in_features, 1, 1)
            self._linear(name, mod, x, lx, shared)
            return None
        return self._other_module(node, name, mod, lx)

    def _other_module(self, node: fx.Node, name: str, mod: nn.Module | None, lx: _Layout | None) -> _Layout | None:
        """A module that is no conv, norm or linear: it keeps, flattens or (not understood) freezes the channels."""
        if isinstance(mod, (*_ELEMENTWISE_MODULES, nn.PReLU)):
            return lx
        if isinstance(mod, nn.Flatten) and lx is not None:
            return self._flatten(node, lx, start=mod.start_dim, end=mod.end_dim)
        if lx is not None:
            self._freeze(lx, f"feeds {type(mod).__name__} {name}, which is not understood")
        return None

    def _conv(self, name: str, mod: nn.Module, lx: _Layout | None, shared: bool) -> _Layout | None:
        """A conv: a depthwise one passes its input's channels on; any other starts a new channel group."""
        if shared:
            self._freeze(lx, f"read by {name}, which is called more than once")
            return None
        g, cin, cout = mod.groups, mod.in_channels, mod.out_channels
        if g > 1 and g == cin == cout:
            return self._depthwise(name, lx)
        if lx is not None:
            self._conv_input(name, lx, g, cin)
        e = self._new(cout)
        self.sources[e] = [name]
        if g > 1:
            self.group_div[e] = g
        self.conv_out[name] = e
        return _Layout(((e, cout),))

    def _depthwise(self, name: str, lx: _Layout | None) -> _Layout | None:
        """A depthwise conv keeps exactly its input's channels (unless they were flattened)."""
        if lx is None:
            return None
        if lx.factor != 1:
            self._freeze(lx, f"flattened before {name}")
            return None
        self.depthwise[name] = lx
        return lx

    def _conv_input(self, name: str, lx: _Layout, g: int, cin: int) -> None:
        """Track the input channels of a (grouped) conv, or freeze them where the layout does not fit."""
        if lx.factor != 1 or lx.width != cin:
            self._freeze(lx, f"layout mismatch at {name}")
        elif g > 1 and len(lx.segs) != 1:
            self._freeze(lx, f"concatenated input of grouped {name}")
        else:
            if g > 1:
                self._add_div(lx.segs[0][0], g)
            self.conv_in[name] = lx

    def _norm(self, name: str, mod: nn.Module, lx: _Layout | None, shared: bool) -> _Layout | None:
        """A BatchNorm or per-channel PReLU follows its input's channels."""
        if lx is None:
            return None
        width = mod.num_features if hasattr(mod, "num_features") else mod.num_parameters
        if shared or lx.width != width:
            self._freeze(lx, f"{name} is called more than once" if shared else f"layout mismatch at {name}")
            return None
        self.norm_in[name] = lx
        return lx

    def _linear(self, name: str, mod: nn.Linear, x: Any, lx: _Layout | None, shared: bool) -> None:
        """A linear layer reads the channels (its inputs follow the pruning; its outputs are not pruned)."""
        if lx is None:
            return
        if shared or _ndim(x) != 2 or lx.width != mod.in_features:
            self._freeze(lx, f"{name} is called more than once" if shared
                         else f"{name} reads it in a shape other than (N, features)")
            return
        self.linear_in[name] = lx

    def _add_div(self, e: int, g: int) -> None:
        r = self.find(e)
        self.group_div[r] = math.lcm(self.group_div.get(r, 1), g)

    def _binary(self, node: fx.Node) -> _Layout | None:
        lays, ok = self._operands(node)
        if not lays:
            return None
        first = lays[0]
        if not ok or not all(la.aligned_with(first) for la in lays):
            self._freeze_all(lays, f"combined with other channels in {_op_name(node)}")
            return None
        for la in lays[1:]:
            self._unite(first, la)
        return first

    def _unite(self, a: _Layout, b: _Layout) -> None:
        """Operands of an add (or mul...) keep the same channels: merge their spaces segment by segment."""
        for (ea, _), (eb, _) in zip(a.segs, b.segs):
            self._union(ea, eb)

    def _operands(self, node: fx.Node) -> tuple[list[_Layout], bool]:
        """The layouts of a binary op's tracked operands, and whether the op keeps channels apart."""
        operands = list(node.args[:2]) + ([node.kwargs["other"]] if "other" in node.kwargs else [])
        out_nd = _ndim(node)
        lays: list[_Layout] = []
        ok = True
        for a in operands:
            if not isinstance(a, fx.Node):
                continue  # a python number
            la = self.layout.get(a)
            if la is not None:
                lays.append(la)
            if not _operand_fits(a, la, out_nd):
                ok = False
        return lays, ok

    def _flatten(self, node: fx.Node, lx: _Layout, start: int | None = None, end: int | None = None) -> _Layout | None:
        shape = _shape(node.args[0])
        out = _shape(node)
        if shape is None or out is None:
            self._freeze(lx, "flattened with unknown shapes")
            return None
        if start is None:
            start, end = _flatten_dims(node)
        if not _flattens_from_channels(start, end, len(shape)) or len(out) != 2:
            self._freeze(lx, f"reshaped by {_op_name(node)} in a way that mixes the channel dim")
            return None
        return _Layout(lx.segs, lx.factor * math.prod(shape[2:]))

    def _reduce(self, node: fx.Node, lx: _Layout) -> _Layout | None:
        shape = _shape(node.args[0])
        dims = _arg(node, 1, "dim", None)
        if shape is None or dims is None or lx.factor != 1:
            self._freeze(lx, f"reduced by {_op_name(node)}")
            return None
        if not _spatial_dims_only(dims, len(shape)):
            self._freeze(lx, f"reduced over the batch or channel dim by {_op_name(node)}")
            return None
        return lx

    def _cat(self, node: fx.Node) -> _Layout | None:
        tensors = _arg(node, 0, "tensors", ())
        dim = _arg(node, 1, "dim", 0)
        shape = _shape(node)
        lays = [self._layout_of(t) for t in tensors]
        if shape is None or not isinstance(dim, int) or dim % len(shape) != 1:
            self._freeze_all(lays, "concatenated along a dim other than the channels")
            return None
        return self._cat_layout(tensors, lays)

    def _cat_layout(self, tensors: Iterable[Any], lays: list[_Layout | None]) -> _Layout | None:
        """The inputs' segments one after the other; an untracked (or flattened) input's channels
        become a new frozen space. None where an input's channel count is unknown."""
        segs: list[tuple[int, int]] = []
        for t, la in zip(tensors, lays):
            if la is not None and la.factor == 1:
                segs.extend(la.segs)
                continue
            self._freeze(la, "concatenated after flattening")
            s = _shape(t)
            if s is None or len(s) < 2:
                return None
            segs.append((self._new(s[1], frozen="concatenated with untracked channels"), s[1]))
        return _Layout(tuple(segs))

    # results
    def prunable_groups(self) -> list[int]:
        roots = []
        for e in range(len(self.parent)):
            r = self.find(e)
            if r == e and r not in self.frozen and self.sources.get(r):
                roots.append(r)
        return roots

    def members(self, r: int) -> list[str]:
        return list(self.sources.get(r, []))

    def size(self, r: int) -> int:
        return self.widths[r]

    def constraint(self, r: int) -> int:
        return self.group_div.get(r, 1)

    def skipped(self) -> list[dict[str, Any]]:
        out = []
        for e in range(len(self.parent)):
            if self.find(e) == e and e in self.frozen and self.sources.get(e):
                out.append({"layers": list(self.sources[e]), "reason": self.frozen[e]})
        return out

    def scores(self, r: int, importance: str) -> torch.Tensor:
        """Per-channel importance: filter norms of each conv in the group, each divided by its
        mean so that no conv of a residual group dominates by scale alone, then summed."""
        total = torch.zeros(self.widths[r])
        for name in self.sources[r]:
            w = self.modules[name].weight.detach().float().flatten(1)
            s = w.abs().sum(1) if importance == "l1" else w.pow(2).sum(1).sqrt()
            total += s / s.mean().clamp_min(1e-12)
        return total

    def macs(self, kept_count: dict[int, int]) -> int:
        """MACs of the convs and linears with the given kept channels per group (others as they are)."""

        def width(lay: _Layout) -> int:
            return sum(kept_count.get(self.find(e), w) for e, w in lay.segs) * lay.factor

        total = 0
        for name, (numel, cout0, cin0, groups, k) in self.out_numel.items():
            mod = self.modules[name]
            if isinstance(mod, nn.Linear):
                lay = self.linear_in.get(name)
                cin = width(lay) if lay is not None else cin0
                total += numel * cin
                continue
            if name in self.depthwise:
                total += numel // cout0 * width(self.depthwise[name]) * k
                continue
            lay = self.conv_in.get(name)
            cin = width(lay) if lay is not None else cin0
            e = self.conv_out.get(name)
            cout = kept_count.get(self.find(e), cout0) if e is not None else cout0
            total += numel // cout0 * cout * (cin // groups) * k
        return total

    # rewriting the layers
    def _index(self, lay: _Layout, kept: dict[int, torch.Tensor]) -> torch.Tensor:
        parts, off = [], 0
        for e, w in lay.segs:
            idx = kept.get(self.find(e))
            parts.append((idx if idx is not None else torch.arange(w)) + off)
            off += w
        idx = torch.cat(parts)
        if lay.factor > 1:
            idx = (idx[:, None] * lay.factor + torch.arange(lay.factor)).flatten()
        return idx

    @torch.no_grad()
    def apply(self, kept: dict[int, torch.Tensor]) -> None:
        changed = {r for r, k in kept.items() if k.numel() < self.widths[r]}

        def touched(layouts: dict[str, _Layout]) -> Iterator[tuple[nn.Module, torch.Tensor]]:
            for name, lay in layouts.items():
                if any(self.find(e) in changed for e, _ in lay.segs):
                    yield self.modules[name], self._index(lay, kept)

        for mod, idx in touched(self.conv_in):
            _keep_conv_inputs(mod, idx)
        for mod, idx in touched(self.depthwise):
            _keep_outputs(mod, idx)
            mod.in_channels = mod.groups = int(idx.numel())
        for name, e in self.conv_out.items():
            if self.find(e) in changed:
                _keep_outputs(self.modules[name], kept[self.find(e)])
        for mod, idx in touched(self.norm_in):
            _keep_norm(mod, idx)
        for mod, idx in touched(self.linear_in):
            _set_param(mod, "weight", mod.weight[:, idx])
            mod.in_features = int(idx.numel())


def _keep_conv_inputs(mod: nn.Module, idx: torch.Tensor) -> None:
    """Keep the input channels ``idx`` of a conv (of a grouped one: the same count in each group)."""
    g = mod.groups
    if g == 1:
        w = mod.weight[:, idx]
    else:  # the same count per group; indices local to each group's block of inputs
        in_g, out_g = mod.in_channels // g, mod.out_channels // g
        blocks = []
        for j in range(g):
            local = idx[(idx >= j * in_g) & (idx < (j + 1) * in_g)] - j * in_g
            blocks.append(mod.weight[j * out_g:(j + 1) * out_g][:, local])
        w = torch.cat(blocks)
    _set_param(mod, "weight", w)
    mod.in_channels = int(idx.numel())


def _keep_outputs(mod: nn.Module, idx: torch.Tensor) -> None:
    """Keep the output channels ``idx`` of a conv (weight rows and bias)."""
    _set_param(mod, "weight", mod.weight[idx])
    if mod.bias is not None:
        _set_param(mod, "bias", mod.bias[idx])
    mod.out_channels = int(idx.numel())


def _keep_norm(mod: nn.Module, idx: torch.Tensor) -> None:
    """Keep the channels ``idx`` of a BatchNorm (affine parameters and running statistics) or a PReLU."""
    if isinstance(mod, nn.PReLU):
        _set_param(mod, "weight", mod.weight[idx])
        mod.num_parameters = int(idx.numel())
        return
    for p in ("weight", "bias"):
        if getattr(mod, p, None) is not None:
            _set_param(mod, p, getattr(mod, p)[idx])
    for b in ("running_mean", "running_var"):
        if getattr(mod, b, None) is not None:
            setattr(mod, b, getattr(mod, b)[idx])
    mod.num_features = int(idx.numel())


def _keep_count(width: int, div: int, amount: float, round_to: int) -> int:
    unit = math.lcm(div, round_to)
    if unit > width or width % unit:
        unit = div
    k = int(round(width * (1.0 - amount) / unit)) * unit
    return min(width, max(unit, k))


def _choose(scores: torch.Tensor, div: int, amount: float, round_to: int) -> torch.Tensor:
    """Indices (sorted) of the channels to keep: the same number, the highest scores, in each of
    ``div`` equal blocks (``div`` > 1 for grouped convs)."""
    width = scores.numel()
    k = _keep_count(width, div, amount, round_to)
    if k == width:
        return torch.arange(width)
    block, per = width // div, k // div
    parts = []
    for j in range(div):
        s = scores[j * block:(j + 1) * block]
        parts.append(torch.topk(s, per).indices.sort().values + j * block)
    return torch.cat(parts)


def _solve_amount(deps: _Deps, groups: list[int], base_macs: int, target: float, round_to: int) -> float:
    """The uniform channel share whose estimated MACs come closest to ``target`` of the original.

    The estimate counts conv/linear MACs analytically from the traced shapes, and
    everything else (matmuls outside those layers) as unchanged.
    """
    fixed = base_macs - deps.macs({})

    def ratio(a: float) -> float:
        counts = {r: _keep_count(deps.size(r), deps.constraint(r), a, round_to) for r in groups}
        return (fixed + deps.macs(counts)) / base_macs if base_macs else 1.0

    lo, hi = 0.0, 0.99
    if ratio(hi) > target:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        if ratio(mid) > target:
            lo = mid
        else:
            hi = mid
    return lo if abs(ratio(lo) - target) <= abs(ratio(hi) - target) else hi


# -- small helpers ----------------------------------------------------------------------------

def _check_model(model: Any, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"{what} needs an nn.Module, got {type(model).__name__}")


def _is_real(x: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_fraction(x: Any) -> bool:
    """A number in [0, 1): a share to remove."""
    return _is_real(x) and 0.0 <= x < 1.0


def _is_share(x: Any) -> bool:
    """A number in (0, 1]: a share to keep."""
    return _is_real(x) and 0.0 < x <= 1.0


def _set_param(mod: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(mod, name)
    # ``value`` comes from advanced indexing, which already copies: no clone needed
    setattr(mod, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


def _nodes_in(obj: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(obj, out.append)
    return out


def _meta(node: Any) -> Any:
    return node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    m = _meta(node)
    return tuple(m.shape) if m is not None and hasattr(m, "shape") else None


def _ndim(node: Any) -> int | None:
    s = _shape(node)
    return len(s) if s is not None else None


def _numel(node: fx.Node) -> int:
    s = _shape(node)
    return math.prod(s) if s is not None else 0


def _op_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _is_function(node: fx.Node, targets: Collection[Any]) -> bool:
    return node.op == "call_function" and node.target in targets


def _is_method(node: fx.Node, names: Collection[str]) -> bool:
    return node.op == "call_method" and node.target in names


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    """A call's argument given by position ``index`` or by keyword ``name``."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _is_binary(node: fx.Node) -> bool:
    return _is_function(node, _BINARY) or _is_method(node, _BINARY_METHODS)


def _is_channel_norm(mod: nn.Module | None) -> bool:
    """A BatchNorm or a PReLU with one weight per channel."""
    return isinstance(mod, nn.modules.batchnorm._BatchNorm) or (isinstance(mod, nn.PReLU) and mod.num_parameters > 1)


def _operand_fits(a: fx.Node, la: _Layout | None, out_nd: int | None) -> bool:
    """Whether an operand of a binary op keeps its channels apart: a tracked one has the output's
    rank, an untracked tensor has no channels of its own (it still broadcasts after pruning)."""
    if la is not None:
        return _ndim(a) == out_nd
    shape = _shape(a)
    if shape is None:
        return True  # not a tensor (an int from x.size())
    idx = 1 - (out_nd - len(shape)) if out_nd is not None else 1
    return not (0 <= idx < len(shape) and shape[idx] != 1)


def _is_flatten(node: fx.Node) -> bool:
    if _is_function(node, (torch.flatten,)) or _is_method(node, ("flatten",)):
        return True
    if _is_method(node, ("view", "reshape")):
        return _is_batch_by_rest(node.args[1:])
    return False


def _is_batch_by_rest(shape: tuple[Any, ...]) -> bool:
    """Whether ``view``/``reshape`` arguments are ``(N, -1)``."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    # (N, -1) only: a literal channel count (x.view(-1, 512)) would be wrong after pruning
    return len(shape) == 2 and shape[1] == -1 and not (isinstance(shape[0], int) and shape[0] < 0)


def _flatten_dims(node: fx.Node) -> tuple[int | None, int | None]:
    if node.target in ("view", "reshape"):
        return 1, -1
    start = _arg(node, 1, "start_dim", 0)
    end = _arg(node, 2, "end_dim", -1)
    return (start if isinstance(start, int) else None), (end if isinstance(end, int) else None)


def _flattens_from_channels(start: int | None, end: int | None, nd: int) -> bool:
    """Whether flattening dims ``start..end`` of an ``nd``-dim tensor merges the channel dim and all after it."""
    end = end % nd if end is not None else nd - 1
    return start is not None and start % nd == 1 and end == nd - 1


def _spatial_dims_only(dims: Any, nd: int) -> bool:
    """Whether a reduction's ``dim`` argument names int dims, none of them the batch or channel dim."""
    dims = [dims] if isinstance(dims, int) else list(dims)
    return all(isinstance(d, int) for d in dims) and not any(d % nd in (0, 1) for d in dims)


def _shapes(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (list, tuple)):
        return tuple(_shapes(o) for o in out)
    if isinstance(out, dict):
        return {k: _shapes(v) for k, v in out.items()}
    return None
