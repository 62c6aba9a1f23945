"""Conv+BN and Linear+BN fusion for inference (catalogue I1).

In eval mode a BatchNorm is a fixed per-channel affine map, ``y = a * x + b``; when its
input comes straight from a convolution (or a linear layer) the scale and shift fold
into that layer's weight and bias, so the BN disappears: one operator less and one
pass over the activation tensor less per pair, with the same outputs up to rounding.
The fold itself is PyTorch's (:func:`torch.nn.utils.fusion.fuse_conv_bn_eval` and
:func:`~torch.nn.utils.fusion.fuse_linear_bn_eval`); what this module adds is finding
the pairs that are safe to fold.

How pairs are found:

* **torch.fx** (any model :func:`torch.fx.symbolic_trace` can trace): a BN module whose
  input is the output of a conv / linear module, where that output has no other user
  and neither module is called more than once. This is the rule of
  :func:`torch.fx.experimental.optimization.fuse`, whose result is a ``GraphModule``;
  here the graph only *finds* the pairs and the fold is applied to a copy of the
  model itself (conv replaced by the fused conv, BN by :class:`~torch.nn.Identity`), so
  the result keeps its class, its methods (``forward_features``...), its non-module
  attributes and the state-dict keys of everything that was not folded.
* **Eager fallback** when fx cannot trace (data-dependent control flow, ...): only
  pairs whose data flow is known without tracing: adjacent ``(conv, BN)`` /
  ``(Linear, BatchNorm1d)`` children of an ``nn.Sequential`` that uses
  ``nn.Sequential.forward`` (subclasses included, as long as they do not override
  ``forward``), and the ``conv1/bn1``, ``conv2/bn2`` (``conv3/bn3``) pairs of the
  built-in :class:`~torch_tricks.models.resnet.BasicBlock` / ``Bottleneck`` and the
  ResNet stem, when their ``forward`` is the built-in one. Both assume that the parent
  calls the container as a whole (not ``seq[0]`` alone), which is what a Sequential is for.

Folded: ``Conv1d/2d/3d`` (and ``ConvTranspose1d/2d/3d`` with ``groups=1``, the case
PyTorch's fold handles) followed by ``BatchNorm1d/2d/3d`` or ``SyncBatchNorm`` of the
same width, and ``Linear`` followed by ``BatchNorm1d``. Exact layer types only: a
subclass may override ``forward`` (weight-standardised convs) and then the fold is wrong.
A BN with ``track_running_stats=False`` normalises with batch statistics even in eval
mode and is never folded. Linear+BN1d assumes the linear output is ``(N, features)``;
pass ``example_inputs`` to have the rank checked (a 3-D ``(N, C, L)`` output is skipped).

ReLU (or any activation) after the BN is kept as its own module: fusing the activation
into the convolution kernel is the backend's job (oneDNN, TensorRT, ``torch.compile``
do it), not a change of weights. BN that follows something other than a conv/linear
(RepVGG's identity branch, pre-activation nets) is left alone and listed in the report.
Re-parameterize multi-branch blocks (:mod:`torch_tricks.deploy.reparam`) *before*
fusing: their ``reparameterize()`` needs the BNs that fusion removes.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.inputs import as_input_tuple
from torch_tricks.models.resnet import BasicBlock, Bottleneck, ResNet
from torch_tricks.deploy.steps import EXACT, Coverage, StepContext, StepResult, deploy_step

__all__ = ["FuseReport", "fuse", "fuse_with_report", "count_batchnorm"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass
class FuseReport:
    """What :func:`fuse_with_report` did.

    ``method`` is ``"fx"``, ``"eager"`` (the fallback) or ``"none"``; ``fused`` lists
    ``(layer, bn)`` module names; ``kept_batchnorm`` the BNs still in the model, each
    with the reason it was not folded.
    """

    method: str
    fused: list[tuple[str, str]] = field(default_factory=list)
    kept_batchnorm: list[str] = field(default_factory=list)
    batchnorm_before: int = 0
    batchnorm_after: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fuse(model: nn.Module, *, inplace: bool = False, example_inputs: Any = None) -> nn.Module:
    """``model`` in eval mode with every safe Conv+BN / Linear+BN pair folded into one layer.

    Returns a new model unless ``inplace`` (which saves a copy of the weights, but then
    the input model must not be used afterwards). The outputs equal those of the eval-mode
    original up to float rounding. A model with nothing to fold is returned unfolded (a
    copy unless ``inplace``) and a warning says why; :func:`fuse_with_report` gives the
    details as data instead.
    """
    fused, rep = fuse_with_report(model, inplace=inplace, example_inputs=example_inputs)
    if not rep.fused:
        warnings.warn(f"fuse: nothing folded ({'; '.join(rep.notes)})", stacklevel=2)
    return fused


def fuse_with_report(
    model: nn.Module, *, inplace: bool = False, example_inputs: Any = None
) -> tuple[nn.Module, FuseReport]:
    """:func:`fuse`, returning ``(fused model, FuseReport)``.

    All pairs are found and folded before the model is touched, so an error leaves the
    input model as it was (``inplace`` included).
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"fuse needs an nn.Module, got {type(model).__name__}")
    target = model if inplace else copy.deepcopy(model)
    before = count_batchnorm(target)
    rep = FuseReport(method="none", batchnorm_before=before)
    if before == 0:
        rep.notes.append("the model has no BatchNorm layers")
        target.eval()
        return target, rep

    was_training = target.training
    target.eval()  # the fold uses running statistics, which only eval mode uses
    try:
        plan, kept, method, why = _plan(target, example_inputs)
    except BaseException:
        target.train(was_training)
        raise
    rep.method = method
    if why:
        rep.notes.append(why)
    _fold(target, plan)
    rep.fused = [(a, b) for a, b in plan]
    rep.kept_batchnorm = kept
    rep.batchnorm_after = count_batchnorm(target)
    rep.notes.extend(_fold_notes(target, plan))
    return target, rep


def _fold(target: nn.Module, plan: list[tuple[str, str]]) -> None:
    """Fold everything first (pure), then swap modules: nothing can fail half-way."""
    swaps: list[tuple[str, nn.Module, str]] = []
    with torch.no_grad():
        for layer_name, bn_name in plan:
            layer, bn = target.get_submodule(layer_name), target.get_submodule(bn_name)
            swaps.append((layer_name, _folded(layer, bn), bn_name))
    for layer_name, new, bn_name in swaps:
        _set_submodule(target, layer_name, new)
        _set_submodule(target, bn_name, nn.Identity())


def _folded(layer: nn.Module, bn: nn.Module) -> nn.Module:
    if isinstance(layer, nn.Linear):
        return fuse_linear_bn_eval(layer, bn)
    return fuse_conv_bn_eval(layer, bn, transpose=isinstance(layer, _CONV_TRANSPOSES))


def _fold_notes(target: nn.Module, plan: list[tuple[str, str]]) -> list[str]:
    """Why nothing was folded, and a warning about multi-branch blocks not folded first."""
    notes = []
    if not plan:
        notes.append("no BatchNorm directly follows a conv/linear layer whose output it alone uses")
    if any(callable(getattr(m, "reparameterize", None)) and not getattr(m, "deployed", True)
           for m in target.modules()):
        notes.append(
            "the model has multi-branch blocks not yet re-parameterized: run reparameterize_model before fuse"
        )
    return notes


def count_batchnorm(model: nn.Module) -> int:
    """Number of BatchNorm modules (1d/2d/3d, SyncBatchNorm, lazy variants) in ``model``."""
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


# -- finding the pairs -------------------------------------------------------------------

# -- the deploy step --------------------------------------------------------------------------


@deploy_step(
    "fuse",
    summary="fold each Conv+BN / Linear+BN pair into one layer (same outputs, one op less)",
    tolerance=EXACT,
    order=10,
    ids=("I1",),
    earlier_name="fuse_conv_bn",
    fn=fuse,
    trades="one operator and one pass over the activations less per Conv/Linear+BN pair, for losing train-mode BN",
    needs="eval mode; a BN right after a conv/linear; a torch.fx-traceable model (else nn.Sequential pairs only)",
    measured_in="benchmarks/deploy.py",
)
def fuse_step(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """The ``fuse`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: :func:`fuse_with_report`."""
    new, rep = fuse_with_report(model, example_inputs=ctx.example)
    return new, ctx.result(
        backend=rep.method, changed=bool(rep.fused), notes=list(rep.notes), coverage=_coverage(rep),
        details={"fused": len(rep.fused), "batchnorm_before": rep.batchnorm_before,
                 "batchnorm_after": rep.batchnorm_after, "kept_batchnorm": rep.kept_batchnorm})


def _coverage(rep: FuseReport) -> Coverage:
    """The BatchNorms folded of those in the model; the others are left by design (each says why)."""
    kept = dict(k.split(": ", 1) if ": " in k else (k, "not folded") for k in rep.kept_batchnorm)
    return Coverage("folded", len(rep.fused), rep.batchnorm_before,
                    "BatchNorm layers into the conv/linear before them", kept=kept)


def _plan(model: nn.Module, example_inputs: Any) -> tuple[list[tuple[str, str]], list[str], str, str]:
    """(pairs to fold, kept BNs with reasons, method, note)."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # TraceError, TypeError, ... from user code under tracing
        return _eager_plan(model, one_line(exc, 10_000))
    shapes = _output_ranks(gm, example_inputs) if example_inputs is not None else None
    pairs, kept = _fx_pairs(gm, model, shapes)
    return pairs, kept, "fx", ""


def _eager_plan(model: nn.Module, reason: str) -> tuple[list[tuple[str, str]], list[str], str, str]:
    """:func:`_plan` for a model torch.fx cannot trace: the pairs of known containers and blocks."""
    pairs = _eager_pairs(model)
    names = {b for _, b in pairs}
    kept = [f"{n}: not in an nn.Sequential or a known block (eager fallback)"
            for n in _bn_names(model) if n not in names]
    return pairs, kept, "eager", f"torch.fx could not trace the model ({reason[:160]}); eager fallback used"


def _fx_pairs(
    gm: fx.GraphModule, model: nn.Module, ranks: dict[str, int] | None
) -> tuple[list[tuple[str, str]], list[str]]:
    modules = dict(model.named_modules())
    calls = _module_calls(gm)
    pairs: list[tuple[str, str]] = []
    kept: list[str] = []
    bn_calls = _first_bn_calls(gm, modules)
    for node in bn_calls:
        src = node.args[0] if node.args else None
        why = _fx_pair_problem(src, modules[node.target], node.target, modules, calls, ranks)
        if why is None:
            pairs.append((src.target, node.target))
        else:
            kept.append(f"{node.target}: {why}")
    # BNs that are never called in the traced graph (dead modules) stay where they are.
    called = {node.target for node in bn_calls}
    kept += [f"{n}: not called in the model's forward" for n in _bn_names(model) if n not in called]
    return pairs, kept


def _module_calls(gm: fx.GraphModule) -> Counter:
    """How many times the graph calls each submodule."""
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_module")


def _first_bn_calls(gm: fx.GraphModule, modules: dict[str, nn.Module]) -> list[fx.Node]:
    """The first call of each BatchNorm in the graph, in graph order."""
    first: dict[str, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and _is_bn(modules.get(node.target)):
            first.setdefault(node.target, node)
    return list(first.values())


def _bn_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if _is_bn(m)]


def _fx_pair_problem(src: Any, bn: nn.Module, bn_name: str, modules: dict[str, nn.Module], calls: Counter,
                     ranks: dict[str, int] | None) -> str | None:
    """Why the BN ``bn_name`` cannot fold into the module whose output ``src`` is (None: it can)."""
    if not isinstance(src, fx.Node) or src.op != "call_module":
        return "its input is not the output of a module"
    layer = modules.get(src.target)
    why = _pair_problem(layer, bn)
    if why is not None:
        return why
    if len(src.users) > 1:
        return f"the output of {src.target} has other users besides the BN"
    if calls[src.target] > 1 or calls[bn_name] > 1:
        return "the layer or the BN is called more than once"
    if isinstance(layer, nn.Linear) and not _is_2d(src, ranks):
        return "the linear output is not (N, features), so BatchNorm1d normalises another dim"
    return None


def _is_2d(node: fx.Node, ranks: dict[str, int] | None) -> bool:
    """Whether ``node``'s traced output has two dims (True where the ranks are unknown)."""
    return ranks is None or ranks.get(node.name, 2) == 2


def _output_ranks(gm: fx.GraphModule, example_inputs: Any) -> dict[str, int]:
    with torch.no_grad():
        ShapeProp(gm).propagate(*as_input_tuple(example_inputs))
    out = {}
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            out[node.name] = len(meta.shape)
    return out


def _eager_pairs(model: nn.Module) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        for a, b in _eager_candidates(m):
            if _pair_problem(getattr(m, a, None), getattr(m, b, None)) is None:
                pairs.append((prefix + a, prefix + b))
    return _reached_once(model, pairs)


def _reached_once(model: nn.Module, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs whose modules have one name each: a module reachable under two names (shared)
    may be called elsewhere, so those are kept out."""
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    return [p for p in pairs if all(uses[id(model.get_submodule(n))] == 1 for n in p)]


_KNOWN_BLOCKS: tuple[tuple[type[nn.Module], tuple[tuple[str, str], ...]], ...] = (
    (Bottleneck, (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3"))),
    (BasicBlock, (("conv1", "bn1"), ("conv2", "bn2"))),
)


def _eager_candidates(m: nn.Module) -> tuple[tuple[str, str], ...]:
    """Child names ``(layer, bn)`` that ``m``'s forward runs back to back: the neighbours in a
    plain ``nn.Sequential``, the conv/BN pairs of the ResNet stem and blocks (forward not overridden)."""
    if _plain(m, nn.Sequential):
        names = [a for a, _ in m.named_children()]
        return tuple(zip(names, names[1:]))
    if _plain(m, ResNet) and type(m).forward_features is ResNet.forward_features:
        return (("conv1", "bn1"),)
    for cls, pattern in _KNOWN_BLOCKS:
        if _plain(m, cls):
            return pattern
    return ()


def _plain(m: nn.Module, cls: type[nn.Module]) -> bool:
    """An instance of ``cls`` whose ``forward`` is ``cls``'s own."""
    return isinstance(m, cls) and type(m).forward is cls.forward


def _pair_problem(layer: nn.Module | None, bn: nn.Module | None) -> str | None:
    """Why ``layer`` followed by ``bn`` cannot be folded (None if it can)."""
    if not _is_bn(bn):
        return "not a BatchNorm"
    if layer is None:
        return "no layer before it"
    if not bn.track_running_stats or bn.running_mean is None:
        return "it has no running statistics (track_running_stats=False), so eval mode uses batch statistics"
    t = type(layer)
    if t in _CONVS or t in _CONV_TRANSPOSES:
        return _conv_bn_problem(layer, bn)
    if t is nn.Linear:
        return _linear_bn_problem(layer, bn)
    return f"it follows a {t.__name__}, not a Conv/Linear layer"


def _conv_bn_problem(layer: nn.Module, bn: nn.Module) -> str | None:
    if type(layer) in _CONV_TRANSPOSES and layer.groups != 1:
        return "grouped transposed convolutions are not folded"
    if layer.out_channels != bn.num_features:
        return f"{layer.out_channels} conv channels but {bn.num_features} BN features"
    return None


def _linear_bn_problem(layer: nn.Linear, bn: nn.Module) -> str | None:
    if type(bn) is not nn.BatchNorm1d:
        return "only BatchNorm1d is folded into a Linear"
    if layer.out_features != bn.num_features:
        return f"{layer.out_features} linear features but {bn.num_features} BN features"
    return None


def _is_bn(m: Any) -> bool:
    return type(m) in _BNS


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
