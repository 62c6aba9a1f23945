"""Operator-level cost counting, attributed to the modules that ran each operator.

Conventions (the ones every table of torch-tricks uses):

* **MACs** are multiply-accumulates of the matmul-like operators: convolutions, linear
  layers (``addmm``/``mm``), ``bmm``/``matmul``/``einsum`` (they reach ATen as ``bmm``/``mm``),
  scaled-dot-product attention, and the recurrent matmuls of ``nn.RNN``/``nn.GRU``/``nn.LSTM``.
* **FLOPs = 2 × MACs**, exactly: normalisation, activations and other element-wise ops
  are memory-bound, so they are *not* counted as FLOPs; they show up in the memory
  access cost instead.
* **Memory access cost** (bytes, the ShuffleNetV2 sense) of an operator is the bytes of
  its tensor inputs read (weights included) plus the bytes of its outputs written; views
  and other metadata-only operators cost nothing. A module's cost is the sum over the
  operators it ran.

Why not ``FlopCounterMode`` alone: with torch 2.13 it counts 0 for ``nn.LSTM`` (the
CPU kernel is ``mkldnn_rnn_layer``, cuDNN's is ``_cudnn_rnn``; neither has a formula),
0 for CPU attention (``_scaled_dot_product_flash_attention_for_cpu``) and 0 for
``nn.TransformerEncoderLayer`` under ``no_grad`` (the fused fast path is one opaque
operator), and it does not measure memory traffic. We reuse its formula registry for
everything it knows, add the missing formulas, count recurrent layers analytically from
their shapes, and switch the attention fast path off while counting (the same matmuls
run, unfused).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count, shape_wrapper

__all__ = ["OpStats", "ModuleRecord", "OpCounter", "rnn_macs"]

_aten = torch.ops.aten


@dataclass
class OpStats:
    """Costs of a set of operators."""

    macs: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    pointwise_bytes: int = 0  # memory traffic of element-wise operators (ShuffleNetV2 G4)
    ops: int = 0
    by_op: dict[str, int] = field(default_factory=dict)  # MACs per operator name

    @property
    def flops(self) -> int:
        return 2 * self.macs

    @property
    def mac_bytes(self) -> int:
        """Memory access cost: bytes read plus bytes written."""
        return self.read_bytes + self.write_bytes

    def add(self, other: "OpStats") -> None:
        self.macs += other.macs
        self.read_bytes += other.read_bytes
        self.write_bytes += other.write_bytes
        self.pointwise_bytes += other.pointwise_bytes
        self.ops += other.ops
        for k, v in other.by_op.items():
            self.by_op[k] = self.by_op.get(k, 0) + v


@dataclass
class ModuleRecord:
    """What happened inside one module, over all of its calls."""

    name: str
    module: nn.Module
    calls: int = 0
    total: OpStats = field(default_factory=OpStats)  # this module and everything it called
    self_: OpStats = field(default_factory=OpStats)  # operators run directly by this module
    input_shapes: list[Any] | None = None
    output_shapes: Any = None
    output_bytes: int = 0
    branches: int = 0  # most distinct compute ops reading one call's input (G3)


def rnn_macs(module: nn.RNNBase, args: tuple[Any, ...]) -> int:
    """Multiply-accumulates of one call of ``nn.RNN``/``nn.GRU``/``nn.LSTM``.

    Per time step, layer and direction: ``gates × hidden × (input + recurrent)`` for the
    input and recurrent matmuls, plus ``hidden × proj`` for an LSTM projection. A
    ``PackedSequence`` counts only its real (unpadded) steps.
    """
    steps = _rnn_steps(args[0])
    gates = {"LSTM": 4, "GRU": 3}.get(module.mode, 1)
    dirs = 2 if module.bidirectional else 1
    hidden = module.hidden_size
    proj = getattr(module, "proj_size", 0) or 0
    out = proj or hidden
    macs = 0
    for layer in range(module.num_layers):
        inp = module.input_size if layer == 0 else out * dirs
        per_step = gates * hidden * (inp + out) + hidden * proj  # proj is 0 without a projection
        macs += per_step * dirs * steps
    return macs


def _rnn_steps(x: Any) -> int:
    """Time steps summed over the batch: a PackedSequence's real ones, else ``T`` (unbatched) or ``B·T``."""
    if isinstance(x, nn.utils.rnn.PackedSequence):
        return int(x.batch_sizes.sum())
    if x.dim() == 2:  # unbatched (T, F)
        return x.shape[0]
    return x.shape[0] * x.shape[1]


def _sdpa_cpu_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


# Formulas ``flop_registry`` lacks (torch 2.13), by operator packet.
_EXTRA_FORMULAS = {}
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable"):
    if hasattr(_aten, _name):
        _EXTRA_FORMULAS[getattr(_aten, _name)] = _sdpa_cpu_flops


# Operators whose first input is a table they read only a few rows of.
_GATHERS = {_aten.embedding, _aten.embedding_bag, _aten._embedding_bag, _aten.index_select}


def _trilinear_flops(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1, *, out_shape=None, **kw) -> int:
    """``nn.Bilinear`` runs as ``_trilinear``: each output element sums one product per
    element of the contracted (``sumdim``) dims of the broadcast inputs."""

    def expanded(shape, dims):
        shape = list(shape)
        for d in sorted(dims):
            shape.insert(d, 1)
        return shape

    shapes = [expanded(i1, expand1), expanded(i2, expand2), expanded(i3, expand3)]
    summed = math.prod(max(sh[d] for sh in shapes) for d in sumdim)
    return 2 * math.prod(out_shape) * summed


_EXTRA_FORMULAS[_aten._trilinear] = shape_wrapper(_trilinear_flops)


def _op_flops(func, args, kwargs, out) -> int:
    packet = func._overloadpacket
    formula = flop_registry.get(packet, _EXTRA_FORMULAS.get(packet))
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except AssertionError:
        # torch before 2.13 counts attention only with as many key/value heads as query heads: grouped-query
        # attention (Llama, Mistral, Qwen ...) broadcasts its fewer K/V heads, so it is counted as if expanded
        gqa = _kv_heads_expanded(args) if "attention" in packet.__name__ else None
        if gqa is None:
            raise
        return int(formula(*gqa, **kwargs, out_val=out))


def _kv_heads_expanded(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``args`` with each 4-d tensor of fewer heads (dim 1) than the most, a divisor of it, replaced by a
    shape-only (meta) tensor of that many heads; None when no head count differs."""
    heads = [a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    h = max(heads, default=0)
    if not heads or all(n == h for n in heads):
        return None

    def widen(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != h and h % a.shape[1] == 0:
            return torch.empty((a.shape[0], h, *a.shape[2:]), dtype=a.dtype, device="meta")
        return a

    return tuple(widen(a) for a in args)


def _flat_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of ``tree`` (args, kwargs, outputs)."""
    flat, _ = tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses, sparse, meta without storage
        return None


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an operator touches for ``t``: its elements, but never more than its storage
    (a broadcast ``expand`` reads each stored element once)."""
    n = t.numel() * t.element_size()
    try:
        st = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    except Exception:
        return n
    return min(n, max(st, 0))


class _Frame:
    __slots__ = ("rec", "inputs", "branch_ops", "is_rnn")

    def __init__(self, rec: ModuleRecord, inputs: set[int], is_rnn: bool):
        self.rec = rec
        self.inputs = inputs
        self.branch_ops = 0
        self.is_rnn = is_rnn


class OpCounter(TorchDispatchMode):
    """Counts every ATen operator of the code run inside it (see module docstring).

    Use :func:`count_ops` unless you need the raw records. Module attribution uses
    global forward hooks, so only modules of ``model`` (named by their first registered
    name) get records; operators outside any of them go to the root record ``""``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.records: dict[str, ModuleRecord] = {}
        self.order: list[str] = []  # first-call order
        self.stack: list[_Frame] = []
        self.failed_in: _Frame | None = None
        self._hooks: list[Any] = []
        self._rnn_depth = 0

    # -- module tracking ------------------------------------------------------------
    def _record(self, module: nn.Module) -> ModuleRecord | None:
        name = self.names.get(id(module))
        if name is None:
            return None
        rec = self.records.get(name)
        if rec is None:
            rec = self.records[name] = ModuleRecord(name, module)
            self.order.append(name)
        return rec

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        rec = self._record(module)
        if rec is None:
            return
        tensors = _flat_tensors(args)
        if rec.input_shapes is None:
            rec.input_shapes = [tuple(t.shape) for t in tensors]
        keys = {k for k in map(_storage_key, tensors) if k is not None}
        is_rnn = isinstance(module, nn.RNNBase)
        self.stack.append(_Frame(rec, keys, is_rnn))
        if is_rnn:
            self._enter_rnn(module, args)

    def _enter_rnn(self, module: nn.RNNBase, args: tuple[Any, ...]) -> None:
        """A recurrent layer's MACs, counted from its shapes; its own operators are not counted again."""
        self._rnn_depth += 1
        macs = rnn_macs(module, args)
        self._attribute(OpStats(macs=macs, by_op={f"rnn.{module.mode.lower()}": macs}))

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.stack or self.stack[-1].rec.module is not module:
            return
        frame = self.stack.pop()
        rec = frame.rec
        rec.calls += 1
        rec.branches = max(rec.branches, frame.branch_ops)
        if frame.is_rnn:
            self._rnn_depth -= 1
        tensors = _flat_tensors(output)
        rec.output_bytes += sum(t.numel() * t.element_size() for t in tensors)
        if rec.output_shapes is None:
            rec.output_shapes = _shapes_of(output)

    def __enter__(self):
        self.records.clear()
        self.order.clear()
        root = self._record(self.model)
        if root is not None:
            root.calls = 0
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post),
        ]
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if exc_type is not None and self.stack:
            self.failed_in = self.stack[-1]
        self.stack.clear()
        self._rnn_depth = 0
        return super().__exit__(exc_type, exc, tb)

    # -- operator accounting -------------------------------------------------------
    def _attribute(self, stats: OpStats) -> None:
        """Add ``stats`` to the total of every open module (each once) and of the root, and to the
        innermost one's own costs (the root's where no module is open)."""
        root = self.records.get("")
        if not self.stack:
            if root is not None:
                root.total.add(stats)
                root.self_.add(stats)
            return
        seen: set[int] = set()
        for frame in self.stack:
            if id(frame.rec) not in seen:
                seen.add(id(frame.rec))
                frame.rec.total.add(stats)
        self.stack[-1].rec.self_.add(stats)
        if root is not None and id(root) not in seen:
            root.total.add(stats)

    def _op_name(self, func) -> str:
        """Operator name for the per-operator MACs; matmuls inside recurrent cells and
        attention modules are named for what they compute."""
        name = func._overloadpacket.__name__
        for frame in reversed(self.stack):
            m = frame.rec.module
            if isinstance(m, nn.RNNCellBase):
                return f"rnn.{type(m).__name__.lower()}"
            if isinstance(m, nn.MultiheadAttention) and name in ("bmm", "baddbmm"):
                return "attention.bmm"
        return name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = _flat_tensors((args, kwargs))
        outs = _flat_tensors(out)
        in_keys = [_storage_key(t) for t in ins]
        stats = OpStats(ops=1)
        if not (func.is_view or _aliases_inputs(func, outs, in_keys)):
            pointwise = torch.Tag.pointwise in func.tags
            stats.read_bytes, stats.write_bytes = _traffic(func, ins, outs)
            if pointwise:
                stats.pointwise_bytes = stats.mac_bytes
            if self._rnn_depth == 0:
                self._count_macs(stats, func, args, kwargs, out)
            if not pointwise:  # G3: compute operators (not views, not element-wise) reading a block's input.
                self._count_branch(in_keys)
        self._attribute(stats)
        return out

    def _count_macs(self, stats: OpStats, func, args, kwargs, out) -> None:
        macs = _op_flops(func, args, kwargs, out) // 2
        if macs:
            stats.macs = macs
            stats.by_op[self._op_name(func)] = macs

    def _count_branch(self, in_keys: list[int | None]) -> None:
        """One more compute operator for every open block whose input it reads."""
        for frame in self.stack:
            if frame.inputs and any(k in frame.inputs for k in in_keys):
                frame.branch_ops += 1


def _aliases_inputs(func, outs: list[torch.Tensor], in_keys: list[int | None]) -> bool:
    """A non-mutating operator whose outputs all share storage with its inputs: a view in all but name."""
    return not func._schema.is_mutable and bool(outs) and all(_storage_key(t) in in_keys for t in outs)


def _traffic(func, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[int, int]:
    """``(bytes read, bytes written)`` by an operator that is not a view."""
    if func._overloadpacket in _GATHERS:  # reads the gathered rows, not the whole table
        read = sum(_nbytes(t) for t in ins[1:]) + sum(_nbytes(t) for t in outs)
    else:
        read = sum(_nbytes(t) for t in ins)
    return read, sum(_nbytes(t) for t in outs)


def _shapes_of(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return tuple(obj.shape)
    if isinstance(obj, dict):
        return {k: _shapes_of(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # a namedtuple's shapes are a plain tuple
        shapes = (_shapes_of(v) for v in obj)
        return tuple(shapes) if hasattr(obj, "_fields") else type(obj)(shapes)
    if isinstance(obj, nn.utils.rnn.PackedSequence):
        return ("packed", tuple(obj.data.shape))
    return type(obj).__name__


@contextlib.contextmanager
def _unfused_attention() -> Iterator[None]:
    """Switch off the fused MHA / encoder-layer fast path so its matmuls are visible."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)
