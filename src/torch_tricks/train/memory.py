"""Trading compute for activation memory: inplace activations (T9), memory-efficient
BN+activation (T10) and activation checkpointing (T12).

The activations saved for backward, not the weights, fill the memory of a CNN in
training; each trick here keeps fewer of them and recomputes or overwrites the rest.
The hard part of every one is *correctness*, which is why they are more than one-liners:

* :func:`inplace_activations` (T9). ``model.apply(lambda m: setattr(m, "inplace", True))``
  is the folk recipe, and it silently breaks models: an inplace activation overwrites
  its input, which is wrong when anything else reads that input later (a residual
  branch, the model's caller), and raises in backward when the op that produced it
  saved its *output* (sigmoid, tanh, exp, softmax, another ReLU). So each activation is
  judged on a ``torch.fx`` trace: it becomes inplace only if its input has no other user
  and comes from an op that returns a fresh tensor and does not need it for backward
  (conv, linear, norms, pooling, add, mul, cat...). Where fx cannot trace, the
  torchvision/timm rule applies: only an activation directly after a conv / linear /
  norm inside an ``nn.Sequential``.
* :class:`MemoryEfficientBNAct` (T10): BatchNorm + activation that keeps only the BN
  input for backward and recomputes the normalised tensor and the activation in
  backward (the efficient-DenseNet idea), using ``torch.utils.checkpoint``; the
  recompute uses the batch statistics again *without* touching the running statistics,
  so they are updated once, exactly as by plain BN.
* :func:`checkpoint_blocks` / :func:`checkpoint_sequential_sqrt` (T12) use
  ``torch.utils.checkpoint(use_reentrant=False)``. PyTorch's checkpoint re-runs the
  forward in backward, so every BatchNorm inside updates its running statistics twice
  (and ``num_batches_tracked`` counts twice); nothing in PyTorch prevents that. Here a
  ``context_fn`` gives the recompute the buffers as they were in the original forward
  and puts back the current ones afterwards, so running statistics (and any other
  buffer a forward updates: spectral-norm vectors, counters) change exactly once.
  ``checkpoint_sequential`` takes no ``context_fn``, hence the hand-made segmenting.
  The forward is wrapped in place, so ``state_dict`` keys do not change.

How much each one saves depends on the network; measure with
:func:`torch_tricks.inspect.memory.saved_activation_bytes`. In particular inplace
saves *saved* bytes only for activations whose backward reads the output (LeakyReLU,
ELU, CELU, SELU); for ReLU it only avoids one transient buffer per activation, which
rarely moves a training step's peak (ResNet-18, MobileNetV2: no change measured);
SiLU/Hardswish/Mish/ReLU6 keep a copy of the input in autograd either way.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import operator
import warnings
from collections import Counter
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = [
    "inplace_activations",
    "MemoryEfficientBNAct",
    "memory_efficient_bn_act",
    "checkpoint_blocks",
    "checkpoint_sequential_sqrt",
    "repeated_blocks",
    "checkpointed_names",
]


# -- T9: inplace activations ----------------------------------------------------------------

#: Activation modules with an ``inplace`` flag that autograd supports in place.
INPLACE_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU,
    nn.SiLU, nn.Hardswish, nn.Hardsigmoid, nn.Mish,
)


@register_trick(
    "inplace_activations",
    ids=("T9",),
    kind="train",
    trades="one transient buffer per activation (and the saved input of LeakyReLU/ELU/SELU) for nothing, where safe",
    needs="activation modules (nn.ReLU...) rather than functional calls",
    config_key="inplace",
    measured_in="benchmarks/train_tricks.py",
)
def inplace_activations(model: nn.Module, *, return_count: bool = False) -> Any:
    """Set ``inplace=True`` on every activation module of ``model`` where it is safe.

    Safe means (see the module docstring): every call of that activation module gets a
    tensor that nothing else reads, produced by an op that returns a fresh tensor and
    does not need it for its own backward. Decided on a ``torch.fx`` trace, or, for the
    parts fx cannot trace, only for activations right after a conv / linear / norm in an
    ``nn.Sequential``. Activations already inplace are left as they are; LeakyReLU/ELU/
    CELU with a negative slope are skipped (autograd cannot do them inplace).

    The model is changed in place and returned; with ``return_count=True`` the return is
    ``(model, number of activation modules switched to inplace)``.
    """
    verdict = _activation_verdicts(model)
    changed = 0
    for m in model.modules():
        if _inplace_capable(m) and not m.inplace and verdict.get(id(m), False):
            m.inplace = True
            changed += 1
    return (model, changed) if return_count else model


# -- T10: memory-efficient BatchNorm + activation ---------------------------------------------

class MemoryEfficientBNAct(nn.modules.batchnorm._BatchNorm):
    """BatchNorm followed by a parameter-free activation (ReLU by default) that saves only
    the BN input for backward; the BN output and the activation are recomputed.

    A plain ``Sequential(BatchNorm2d, ReLU)`` keeps two full-size tensors for backward:
    the BN input and the ReLU output (with ReLU6, SiLU, GELU, Hardswish or Mish, whose
    backward reads their input, the BN output as well). This keeps only the BN input
    (weights and buffers are parameters, not activations). Outputs, gradients and
    running statistics equal the plain pair's; the price is one more BN + activation
    forward per backward.

    It *is* a BatchNorm (any input of 2 or more dims: 1d, 2d, 3d), so its ``state_dict``
    has exactly BN's keys and a BN checkpoint loads into it.

    Where the saving shows in a network: the BN output of input-reading activations is
    always saved; the activation output only when its consumer does not keep it anyway
    (an add, a concat, average pooling). A conv or max-pool right after a ReLU keeps
    that output for its own backward. Measured with ``saved_activation_bytes``:
    MobileNetV2 (ReLU6) -32%, ResNet-9 -4%, ResNet-18 -0.4% (its BN -> ReLU pairs all
    feed a conv).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: nn.Module | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        act = nn.ReLU() if activation is None else activation
        if any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
            raise UserError(
                f"MemoryEfficientBNAct needs a parameter-free activation, not {type(act).__name__}: "
                "keep that activation as a separate module"
            )
        self.act = act
        self._recomputing = False

    @classmethod
    def from_bn(
        cls, bn: nn.modules.batchnorm._BatchNorm, activation: nn.Module | None = None
    ) -> "MemoryEfficientBNAct":
        """A MemoryEfficientBNAct that *shares* ``bn``'s parameters and buffers (same
        tensor objects, so an optimizer built on the old model still holds them)."""
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, activation)
        for name in ("weight", "bias"):
            setattr(new, name, getattr(bn, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(new, name, getattr(bn, name))
        new.train(bn.training)
        return new

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected a 2-D or higher input (N, C, ...), got {input.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor = self._count_batch()
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not self._needs_grad(x):
            return self._bn_act(x, use_batch_stats, factor)
        return checkpoint(
            self._bn_act, x, use_batch_stats, factor,
            use_reentrant=False, context_fn=self._contexts,
        )

    def _count_batch(self) -> float:
        """The running-statistics bookkeeping of nn.BatchNorm's forward, done once here, outside the
        recomputed part: counts the batch in training; returns the exponential average factor."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return factor

    def _needs_grad(self, x: torch.Tensor) -> bool:
        """Whether this forward builds a graph: only then is recomputing in backward worth it."""
        params = (p for p in (self.weight, self.bias) if p is not None)
        return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))

    def _bn_act(self, x: torch.Tensor, use_batch_stats: bool, factor: float) -> torch.Tensor:
        track = not self.training or self.track_running_stats
        rm = self.running_mean if track else None
        rv = self.running_var if track else None
        if self._recomputing and use_batch_stats and rm is not None:
            # The same batch statistics again; the update goes to throwaway copies, so the
            # running stats change once (copies, not None: checkpoint wants the same saves).
            rm, rv = rm.clone(), rv.clone()
        return self.act(F.batch_norm(x, rm, rv, self.weight, self.bias, use_batch_stats, factor, self.eps))

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), _flag(self, "_recomputing")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={type(self.act).__name__}"


_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_ELEMENTWISE_ACTS = INPLACE_ACTIVATIONS + (nn.GELU, nn.Sigmoid, nn.Tanh)


@register_trick(
    "memory_efficient_bn",
    ids=("T10",),
    kind="train",
    trades="saved BN outputs (and activation outputs not kept downstream) for one more BN+activation forward",
    needs="BatchNorm followed by a parameter-free activation (in an nn.Sequential, or BN -> inplace ReLU in a block)",
    config_key="memory_efficient_bn",
    measured_in="benchmarks/train_tricks.py",
)
def memory_efficient_bn_act(model: nn.Module, *, return_count: bool = False) -> Any:
    """Replace BatchNorm -> activation pairs of ``model`` by :class:`MemoryEfficientBNAct`.

    Patterns converted (``state_dict`` keys unchanged in both, parameters shared):

    1. inside an ``nn.Sequential`` (with Sequential's own forward): a ``BatchNorm1d/2d/3d``
       directly followed by a parameter-free element-wise activation (ReLU, ReLU6,
       LeakyReLU, ELU, SiLU, GELU, Hardswish, Mish, Sigmoid, Tanh...). The BN becomes
       the pair, the activation an ``nn.Identity``.
    2. torchvision-style blocks (``out = self.relu(self.bn1(self.conv1(x)))``), found on
       a ``torch.fx`` trace: a BN whose only user is an ``nn.ReLU(inplace=True)``. The
       BN becomes the pair and the block's ReLU stays; applied again to a ReLU output
       it changes nothing, values and gradients alike, and inplace it saves nothing.

    BN and activation modules used at more than one place are left alone, as are
    SyncBatchNorm and anything fx cannot trace beyond pattern 1. Returns the model (and
    the number of pairs converted with ``return_count=True``).
    """
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    converted = _convert_sequential_pairs(model, uses)
    converted += _convert_traced_pairs(model, uses)
    return (model, converted) if return_count else model


# -- T12: activation checkpointing -----------------------------------------------------------

@register_trick(
    "checkpointing",
    ids=("T12",),
    kind="train",
    trades="most activation memory for about one more forward pass per step",
    needs="a model built from repeated blocks (or name them with types=/names=)",
    config_key="checkpointing",
    measured_in="benchmarks/train_tricks.py",
)
def checkpoint_blocks(
    model: nn.Module,
    *,
    types: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
    names: str | Sequence[str] | None = None,
) -> nn.Module:
    """Checkpoint the forward of chosen submodules of ``model`` (in place; returned).

    Chosen: instances of ``types``, and submodules whose qualified name matches a glob
    of ``names`` (``fnmatch``: ``"layer*.*"``, ``"encoder.layers.*"``); with neither, the
    repeated blocks of the model: the children of its ``nn.Sequential``/``nn.ModuleList``
    stacks that have submodules of their own and whose class occurs at least twice
    (ResNet BasicBlock/Bottleneck, TransformerEncoderLayer, MobileNet inverted
    residuals). Only the outermost match is checkpointed when matches nest.

    A checkpointed module keeps only its inputs for backward and reruns its forward in
    backward; it runs plainly in eval mode or without grad. Its ``forward`` is wrapped
    in place, so module names, ``state_dict`` keys and hooks are unchanged; running
    statistics are updated once (see the module docstring). A block whose first op
    modifies its input in place cannot be checkpointed (PyTorch raises in backward).
    A :class:`UserError` if nothing matches.
    """
    if isinstance(types, type):
        types = (types,)
    if isinstance(names, str):
        names = [names]
    _check_module_types(types or ())
    for _, m in _outermost(model, _chosen_blocks(model, types, names)):
        if not _is_checkpointed(m):
            m.forward = _CheckpointedForward(m)
    return model


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of the repeated blocks of ``model`` (see :func:`checkpoint_blocks`),
    outermost only, in module order: the unit of activation checkpointing and of FSDP sharding."""
    return _outermost(model, default_blocks(model))


def checkpoint_sequential_sqrt(seq: nn.Sequential, segments: int | None = None) -> nn.Sequential:
    """Checkpoint ``seq`` in ``segments`` segments (default ``ceil(sqrt(len(seq)))``).

    Sublinear memory (Chen et al. 2016): only every segment's input is kept, and one
    segment's activations at a time are rebuilt in backward, so N layers cost about
    ``2*sqrt(N)`` activations instead of N. The last segment runs plainly (its
    activations are needed first in backward anyway), as in
    ``torch.utils.checkpoint.checkpoint_sequential``, which is not used because it
    cannot protect BatchNorm running statistics from the double update. A segment
    never starts at an inplace module (it would overwrite the saved segment input).
    The Sequential's forward is wrapped in place; it is returned.
    """
    if not isinstance(seq, nn.Sequential):
        raise UserError(
            f"checkpoint_sequential_sqrt needs an nn.Sequential, got {type(seq).__name__}: use checkpoint_blocks"
        )
    n = len(seq)
    if n == 0:
        raise UserError("checkpoint_sequential_sqrt: the Sequential is empty")
    if segments is None:
        segments = math.ceil(math.sqrt(n))
    if not 1 <= int(segments) <= n:
        raise UserError(f"checkpoint_sequential_sqrt: segments must be between 1 and {n}, got {segments}")
    seq.forward = _SegmentedForward(seq, _segment_bounds(seq, int(segments)))
    return seq


def checkpointed_names(model: nn.Module) -> list[str]:
    """Qualified names of the submodules of ``model`` whose forward is checkpointed here
    (``""`` for the model itself)."""
    return [
        n for n, m in model.named_modules()
        if isinstance(m.__dict__.get("forward"), (_CheckpointedForward, _SegmentedForward))
    ]


# -- internals: checkpointing ---------------------------------------------------------------

def _check_module_types(types: Sequence[Any]) -> None:
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise UserError(f"checkpoint_blocks: types must be nn.Module classes, got {t!r}")


def _chosen_blocks(model: nn.Module, types: Sequence[type[nn.Module]] | None,
                   names: Sequence[str] | None) -> set[int]:
    """ids of the submodules to checkpoint: those asked for, else the repeated blocks."""
    if types is None and names is None:
        return _default_blocks_or_raise(model)
    return _matching_blocks(model, tuple(types or ()), names)


def _is_checkpointed(m: nn.Module) -> bool:
    """Whether ``m``'s forward was wrapped by :func:`checkpoint_blocks` already."""
    return isinstance(m.__dict__.get("forward"), _CheckpointedForward)


class _CheckpointedForward:
    """Replaces ``module.forward``: the original forward under ``checkpoint`` in training
    with grad, plainly otherwise. A class, not a closure, so ``copy.deepcopy`` and
    pickling of the model carry it over to the copy."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.inner = module.__dict__.get("forward")  # an instance-level forward to keep, if any

    def _forward(self) -> Any:
        m = self.module
        return self.inner if self.inner is not None else type(m).forward.__get__(m)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fwd = self._forward()
        if not (self.module.training and torch.is_grad_enabled()):
            return fwd(*args, **kwargs)
        if kwargs:  # bound here, so they cannot clash with checkpoint's own keywords
            fwd = functools.partial(fwd, **kwargs)
        return _checkpoint(fwd, [self.module], *args)


class _SegmentedForward:
    """Replaces an ``nn.Sequential``'s forward with the segmented, checkpointed one."""

    def __init__(self, seq: nn.Sequential, bounds: list[tuple[int, int]]) -> None:
        self.seq = seq
        self.bounds = bounds

    def __call__(self, x: Any) -> Any:
        mods = list(self.seq)
        if not (self.seq.training and torch.is_grad_enabled()):
            return _run_range(mods, x)
        for i, (a, b) in enumerate(self.bounds):
            run = functools.partial(_run_range, mods[a:b])
            x = run(x) if i == len(self.bounds) - 1 else _checkpoint(run, mods[a:b], x)
        return x


def _run_range(mods: list[nn.Module], x: Any) -> Any:
    for m in mods:
        x = m(x)
    return x


def _checkpoint(fn: Any, modules: list[nn.Module], *args: Any) -> Any:
    # Under torch.compile the recompute is done by AOTAutograd on functionalised ops
    # (buffer updates applied once), and dynamo only accepts dispatch-mode context_fns.
    compiling = torch.compiler.is_compiling()
    extra = {} if compiling else {"context_fn": functools.partial(_buffer_contexts, modules)}
    return checkpoint(fn, *args, use_reentrant=False, **extra)


def _buffer_contexts(modules: list[nn.Module]) -> tuple[Any, Any]:
    """(forward context, recompute context) that make a recompute see the buffers as the
    original forward saw them, and leave them as they were before the recompute."""
    changed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, value before the forward)

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        bufs = list(_unique_buffers(modules))
        with torch.no_grad():
            before = [(b, b._version, b.clone(), norm) for b, norm in bufs]
        try:
            yield
        finally:
            # Norm layers update running stats inside the kernel without bumping the
            # version counter, so theirs are always kept; others only if they changed
            # (comparing values instead would cost a device sync per block).
            changed.extend((b, old) for b, v, old, norm in before if norm or b._version != v)

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        with torch.no_grad():
            now = [(b, b.clone()) for b, _ in changed]
            for b, old in changed:
                b.copy_(old)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, cur in now:
                    b.copy_(cur)

    return forward(), recompute()


def _unique_buffers(modules: Iterable[nn.Module]) -> Iterator[tuple[torch.Tensor, bool]]:
    """(buffer, belongs to a norm layer) for every buffer under ``modules``, once each."""
    seen: set[int] = set()
    for top in modules:
        for m in top.modules():
            norm = isinstance(m, nn.modules.batchnorm._NormBase)
            for b in m.buffers(recurse=False):
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    yield b, norm


def default_blocks(model: nn.Module) -> set[int]:
    """Children of Sequential/ModuleList stacks that have submodules, with a class (plain
    ``nn.Sequential`` children count as one class) occurring at least twice."""
    cands = _stack_children(model)
    counts = Counter(type(c) for c in cands)
    return {id(c) for c in cands if counts[type(c)] >= 2 and c is not model}


def _stack_children(model: nn.Module) -> list[nn.Module]:
    """The children that have submodules of every Sequential / ModuleList in ``model``, in module order."""
    cands = []
    for m in model.modules():
        if isinstance(m, (nn.Sequential, nn.ModuleList)):
            cands += [c for c in m.children() if _has_children(c)]
    return cands


def _has_children(m: nn.Module) -> bool:
    return any(True for _ in m.children())


def _outermost(model: nn.Module, chosen: set[int]) -> list[tuple[str, nn.Module]]:
    """The chosen modules that have no chosen ancestor (the root is never chosen)."""
    out: list[tuple[str, nn.Module]] = []

    def walk(m: nn.Module, prefix: str) -> None:
        for name, c in m.named_children():
            q = f"{prefix}.{name}" if prefix else name
            if id(c) in chosen:
                out.append((q, c))
            else:
                walk(c, q)

    walk(model, "")
    return out


def _default_blocks_or_raise(model: nn.Module) -> set[int]:
    chosen = default_blocks(model)
    if not chosen:
        raise UserError(
            f"checkpoint_blocks found no repeated blocks in {type(model).__name__}: "
            "pass types=(BlockClass,) or names=['pattern.*'], or use checkpoint_sequential_sqrt on an nn.Sequential"
        )
    return chosen


def _matching_blocks(model: nn.Module, tset: tuple[type, ...], names: Sequence[str] | None) -> set[int]:
    """ids of the submodules that are instances of ``tset`` or whose names match a glob of ``names``;
    a UserError naming what was asked for when none does."""
    chosen = {id(m) for n, m in model.named_modules() if n and _matches(n, m, tset, names or ())}
    if not chosen:
        raise UserError(
            f"checkpoint_blocks: no submodule of {type(model).__name__} matches {_asked_for(tset, names)}: "
            "check the names with model.named_modules()"
        )
    return chosen


def _asked_for(tset: tuple[type, ...], names: Sequence[str] | None) -> str:
    """The ``types=`` and ``names=`` given, as a message shows them."""
    what = [f"types={[t.__name__ for t in tset]}"] if tset else []
    what += [f"names={list(names)}"] if names else []
    return ", ".join(what)


def _matches(name: str, m: nn.Module, tset: tuple[type, ...], patterns: Sequence[str]) -> bool:
    """Whether the submodule ``m`` called ``name`` is an instance of ``tset`` or matches a glob of ``patterns``."""
    if tset and isinstance(m, tset):
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _segment_bounds(seq: nn.Sequential, segments: int) -> list[tuple[int, int]]:
    n = len(seq)
    mods = list(seq)
    starts = sorted({round(i * n / segments) for i in range(segments)})
    fixed = []
    for s in starts:
        s = _skip_inplace(mods, s)
        if s < n and (not fixed or s > fixed[-1]):
            fixed.append(s)
    ends = fixed[1:] + [n]
    return list(zip(fixed, ends))


def _skip_inplace(mods: list[nn.Module], s: int) -> int:
    """The first index from ``s`` on that is not an inplace module: never begin a checkpointed segment with an
    op that overwrites its input (index 0, the Sequential's own input, stays)."""
    while 0 < s < len(mods) and getattr(mods[s], "inplace", False):
        s += 1
    return s


@contextlib.contextmanager
def _flag(obj: Any, attr: str) -> Iterator[None]:
    old = getattr(obj, attr)
    setattr(obj, attr, True)
    try:
        yield
    finally:
        setattr(obj, attr, old)


# -- internals: inplace safety ----------------------------------------------------------------

# Producers that return a fresh tensor and do not need it for their own backward.
_FRESH_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd, nn.Linear, nn.Bilinear,
    nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
_FRESH_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.matmul, operator.neg,
    torch.add, torch.sub, torch.mul, torch.div, torch.matmul, torch.mm, torch.bmm, torch.cat,
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.batch_norm, F.layer_norm, F.group_norm,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
}
_FRESH_FUNCTIONS |= {  # what fx records when it traces through the F.* wrappers
    torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
    torch.conv_transpose3d, torch.batch_norm, torch.layer_norm, torch.group_norm,
    torch.max_pool1d, torch.max_pool2d, torch.max_pool3d, torch.avg_pool1d, torch.adaptive_avg_pool1d,
}
_FRESH_METHODS = {"add", "sub", "mul", "div", "matmul", "mm", "bmm", "neg"}


def _convert_sequential_pairs(model: nn.Module, uses: Counter) -> int:
    """Pattern 1 of :func:`memory_efficient_bn_act`: BN -> activation neighbours in plain Sequentials."""
    converted = 0
    for seq in [m for m in model.modules() if _is_plain_sequential(m)]:
        keys = list(seq._modules)
        for k0, k1 in zip(keys, keys[1:]):
            bn, act = seq._modules[k0], seq._modules[k1]
            if _is_bn_act_pair(bn, act, uses):
                seq._modules[k0] = MemoryEfficientBNAct.from_bn(bn, act)
                seq._modules[k1] = nn.Identity()
                converted += 1
    return converted


def _is_plain_sequential(m: nn.Module) -> bool:
    """An ``nn.Sequential`` that runs its children in order (its class keeps Sequential's forward)."""
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def _is_bn_act_pair(bn: Any, act: Any, uses: Counter) -> bool:
    """A plain BatchNorm and a parameter-free activation, each used at this one place only."""
    return type(bn) in _BN_TYPES and _is_param_free_act(act) and uses[id(bn)] == 1 and uses[id(act)] == 1


def _convert_traced_pairs(model: nn.Module, uses: Counter) -> int:
    """Pattern 2 of :func:`memory_efficient_bn_act`: on an fx trace, a BN whose only user is an inplace ReLU."""
    graph = _trace(model)
    if graph is None:
        return 0
    converted = 0
    for node in graph.nodes:
        bn = _bn_before_inplace_relu(node, model, uses)
        if bn is not None:
            parent, _, name = node.target.rpartition(".")
            setattr(model.get_submodule(parent), name, MemoryEfficientBNAct.from_bn(bn, nn.ReLU()))
            converted += 1
    return converted


def _bn_before_inplace_relu(node: torch.fx.Node, model: nn.Module, uses: Counter) -> nn.Module | None:
    """The BatchNorm ``node`` calls if its one user is an ``nn.ReLU(inplace=True)`` applied to it, else None."""
    if node.op != "call_module" or len(node.users) != 1:
        return None
    bn = model.get_submodule(node.target)
    user = next(iter(node.users))
    if type(bn) not in _BN_TYPES or uses[id(bn)] != 1 or user.op != "call_module":
        return None
    return bn if _is_inplace_relu_on(user, node, model) else None


def _is_inplace_relu_on(user: torch.fx.Node, node: torch.fx.Node, model: nn.Module) -> bool:
    """Whether ``user`` calls an ``nn.ReLU(inplace=True)`` with ``node``'s output as its input."""
    act = model.get_submodule(user.target)
    return type(act) is nn.ReLU and act.inplace and bool(user.args) and user.args[0] is node


def _inplace_capable(m: nn.Module) -> bool:
    if not isinstance(m, INPLACE_ACTIVATIONS) or not hasattr(m, "inplace"):
        return False
    if isinstance(m, nn.LeakyReLU) and m.negative_slope < 0:
        return False  # autograd refuses inplace leaky_relu with a negative slope
    if isinstance(m, (nn.ELU, nn.CELU)) and m.alpha < 0:
        return False
    return True


def _is_param_free_act(m: nn.Module) -> bool:
    return isinstance(m, _ELEMENTWISE_ACTS) and not any(True for _ in m.parameters())


class _Tracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, MemoryEfficientBNAct):
            return True
        return super().is_leaf_module(m, qualname)


def _trace(module: nn.Module) -> torch.fx.Graph | None:
    """The fx graph of ``module`` (submodules as leaves per fx's default), or None."""
    if checkpointed_names(module):
        return None  # checkpoint wrappers are not traceable; judge by structure instead
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _Tracer().trace(module)
    except Exception:
        return None


def _producer_is_fresh(node: torch.fx.Node, root: nn.Module) -> bool:
    if node.op == "call_module":
        return isinstance(root.get_submodule(node.target), _FRESH_MODULES + (MemoryEfficientBNAct,))
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    return False  # placeholders (the caller's tensor), attributes, outputs


def _activation_verdicts(model: nn.Module) -> dict[int, bool]:
    """id(activation module) -> safe to make inplace (absent: never seen called)."""
    verdict: dict[int, bool] = {}

    def judge(m: nn.Module, safe: bool) -> None:
        verdict[id(m)] = verdict.get(id(m), True) and safe

    def visit(mod: nn.Module) -> None:
        graph = _trace(mod)
        if graph is not None:
            for node in graph.nodes:
                if node.op != "call_module":
                    continue
                act = mod.get_submodule(node.target)
                if not _inplace_capable(act):
                    continue
                inp = node.args[0] if node.args else None
                safe = (
                    isinstance(inp, torch.fx.Node)
                    and len(node.args) == 1 and not node.kwargs
                    and len(inp.users) == 1
                    and _producer_is_fresh(inp, mod)
                )
                judge(act, safe)
            return
        # fx cannot trace this module: judge its direct children by structure.
        children = list(mod.children())
        plain_seq = _is_plain_sequential(mod)
        for i, c in enumerate(children):
            if _inplace_capable(c):
                judge(c, plain_seq and i > 0 and isinstance(children[i - 1], _FRESH_MODULES + (MemoryEfficientBNAct,)))
            elif _has_children(c) and not isinstance(c, MemoryEfficientBNAct):
                visit(c)

    visit(model)
    # A module registered at several places may also be called where no graph saw it.
    uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    return {k: v and uses[k] == 1 for k, v in verdict.items()}
