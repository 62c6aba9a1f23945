"""Low-bit training-time quantization (I4): DoReFa k-bit, ternary (TWN) and binary (BNN/XNOR).

Below 8 bits, post-training quantization loses too much accuracy: the network has to be
*trained* with its weights (and, for DoReFa, activations) quantized in the forward pass,
so it learns weights that survive the rounding. Each module here keeps fp32 "latent"
weights that the optimizer updates and quantizes them on every forward; rounding has no
useful gradient, so the backward pass uses the straight-through estimator (STE): the
gradient of the rounded value is passed to its input unchanged (clipped to the range
where the quantizer is not saturated, for activations).

These are fake-quant modules: they show the accuracy a low-bit model keeps, and
:meth:`quantized_weight` gives the weights at their few levels for export; PyTorch has
no fast 2/3/4-bit CPU kernels, so they do not make the model faster here.

* DoReFa-Net (Zhou et al., 2016): weights ``w = 2 q_k(tanh(W) / (2 max|tanh W|) + 1/2) - 1``,
  activations ``q_k(clip(x, 0, 1))``, with ``q_k`` rounding to ``2^k`` levels in [0, 1].
* TWN (Li & Liu, 2016): ``W -> alpha * {-1, 0, +1}``, threshold ``0.7 * mean|W|``,
  ``alpha`` = mean |W| over the weights above the threshold (per layer).
* BNN / XNOR-Net (Courbariaux et al. 2016; Rastegari et al. 2016): ``W -> alpha * sign(W)``
  with ``alpha`` the mean |W| of each output channel (XNOR's scaling; 2 values per channel).

The first and last layers stay full precision by default, as in all three papers: they
hold few weights but lose the most accuracy when quantized.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = [
    "QuantConv2d",
    "QuantLinear",
    "TernaryConv2d",
    "TernaryLinear",
    "BinaryConv2d",
    "BinaryLinear",
    "convert_lowbit",
    "quantize_k",
    "dorefa_weight",
    "ternary_weight",
    "binary_weight",
]

MODES = ("dorefa", "ternary", "binary")


# -- quantizers (forward: quantized value; backward: straight-through) ---------------------------


def quantize_k(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round ``x`` in [0, 1] to ``2^bits`` evenly spaced levels; gradient passes straight through."""
    if bits >= 32:
        return x
    n = float(2**bits - 1)
    return _ste(x, torch.round(x * n) / n)


def _ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q`` in the forward pass, identity gradient to ``x`` in the backward pass.

    Written ``q + (x - x)`` rather than ``x + (q - x)``: the latter is not exactly ``q`` in
    floating point, so a layer's "few levels" would become many slightly different values.
    """
    return q.detach() + (x - x.detach())


def dorefa_weight(w: torch.Tensor, bits: int) -> torch.Tensor:
    """DoReFa weights: tanh-normalised to [0, 1], k-bit rounded, mapped back to [-1, 1]."""
    if bits >= 32:
        return w
    t = torch.tanh(w)
    t = t / (2 * t.abs().max().clamp_min(1e-12)) + 0.5
    return 2 * quantize_k(t, bits) - 1


def dorefa_activation(x: torch.Tensor, bits: int) -> torch.Tensor:
    """DoReFa activations: clipped to [0, 1] (no gradient outside), then k-bit rounded."""
    if bits >= 32:
        return x
    return quantize_k(torch.clamp(x, 0.0, 1.0), bits)


def ternary_weight(w: torch.Tensor) -> torch.Tensor:
    """TWN: ``alpha * {-1, 0, +1}``; threshold 0.7 mean|W|, alpha = mean |W| of the kept weights."""
    a = w.abs()
    delta = 0.7 * a.mean()
    keep = (a > delta).to(w.dtype)
    alpha = (a * keep).sum() / keep.sum().clamp_min(1.0)
    return _ste(w, alpha * torch.sign(w) * keep)


def binary_weight(w: torch.Tensor) -> torch.Tensor:
    """XNOR: ``sign(W)`` times the per-output-channel mean |W| (sign(0) taken as +1)."""
    alpha = w.abs().mean(dim=tuple(range(1, w.dim())), keepdim=True)
    sign = torch.where(w >= 0, torch.ones_like(w), -torch.ones_like(w))
    return _ste(w, alpha * sign)


# -- modules -------------------------------------------------------------------------------------


class _LowBitMixin:
    """Shared behaviour: ``quantized_weight()`` and an ``extra_repr`` naming the scheme."""

    scheme: str

    def quantized_weight(self) -> torch.Tensor:
        """The weight the forward pass uses, at its few levels (detached)."""
        with torch.no_grad():
            return self._qweight().detach()  # type: ignore[attr-defined]

    def _qweight(self) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError


class QuantConv2d(nn.Conv2d, _LowBitMixin):
    """Conv2d with DoReFa ``bits_w``-bit weights and ``bits_a``-bit inputs (32 = full precision).

    The input quantizer clips to [0, 1], which assumes the input comes out of a
    bounded activation (ReLU, or DoReFa's clipped ReLU); :func:`convert_lowbit` only
    quantizes the inputs of layers that follow a ReLU.
    """

    def __init__(self, *args: Any, bits_w: int = 4, bits_a: int = 4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bits_w, self.bits_a = _check_bits(bits_w), _check_bits(bits_a)

    def _qweight(self) -> torch.Tensor:
        return dorefa_weight(self.weight, self.bits_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(dorefa_activation(x, self.bits_a), self._qweight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits_w={self.bits_w}, bits_a={self.bits_a}"


class QuantLinear(nn.Linear, _LowBitMixin):
    """Linear with DoReFa ``bits_w``-bit weights and ``bits_a``-bit inputs (32 = full precision)."""

    def __init__(self, *args: Any, bits_w: int = 4, bits_a: int = 4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bits_w, self.bits_a = _check_bits(bits_w), _check_bits(bits_a)

    def _qweight(self) -> torch.Tensor:
        return dorefa_weight(self.weight, self.bits_w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(dorefa_activation(x, self.bits_a), self._qweight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits_w={self.bits_w}, bits_a={self.bits_a}"


class TernaryConv2d(nn.Conv2d, _LowBitMixin):
    """Conv2d with TWN ternary weights (3 values per layer); activations full precision."""

    def _qweight(self) -> torch.Tensor:
        return ternary_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self._qweight(), self.bias)


class TernaryLinear(nn.Linear, _LowBitMixin):
    """Linear with TWN ternary weights (3 values per layer); activations full precision."""

    def _qweight(self) -> torch.Tensor:
        return ternary_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._qweight(), self.bias)


class BinaryConv2d(nn.Conv2d, _LowBitMixin):
    """Conv2d with XNOR-scaled binary weights (2 values per output channel).

    Activations stay full precision (BWN / "binary-weight network"); binarising them too
    (full XNOR-Net) costs much more accuracy and only pays off with bit-op kernels.
    """

    def _qweight(self) -> torch.Tensor:
        return binary_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self._qweight(), self.bias)


class BinaryLinear(nn.Linear, _LowBitMixin):
    """Linear with XNOR-scaled binary weights (2 values per output row)."""

    def _qweight(self) -> torch.Tensor:
        return binary_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._qweight(), self.bias)


# -- conversion ----------------------------------------------------------------------------------


def convert_lowbit(
    model: nn.Module,
    mode: str = "dorefa",
    bits: int = 4,
    *,
    bits_a: int | None = None,
    skip_first_last: bool = True,
) -> nn.Module:
    """A copy of ``model`` with its Conv2d/Linear layers replaced by low-bit versions.

    ``mode``: ``"dorefa"`` (``bits``-bit weights, ``bits_a``-bit activations, default
    ``bits``), ``"ternary"`` (TWN) or ``"binary"`` (XNOR-scaled). The first and last
    quantizable layers (in registration order) keep full precision when
    ``skip_first_last``. DoReFa quantizes a layer's *input* only when the layer follows a
    ReLU (its [0, 1] clip would destroy signed inputs); activations elsewhere stay fp32.
    Weights and biases are copied, so a trained model can be fine-tuned from where it is.
    Train the result with :func:`torch_tricks.train.fit` as usual.
    """
    _check_lowbit_args(model, mode, bits, bits_a)
    work = copy.deepcopy(model)
    layers = _quantizable_layers(work)
    if not layers:
        raise UserError(f"convert_lowbit: {type(model).__name__} has no nn.Conv2d / nn.Linear layer to quantize")
    targets = layers[1:-1] if skip_first_last else layers
    if not targets:
        raise UserError(
            "convert_lowbit: only the first and last layers are quantizable and they are kept full "
            "precision: pass skip_first_last=False"
        )
    after_relu = _layers_after_relu(work)
    a_bits = bits if bits_a is None else bits_a
    for name, layer in targets:
        _set_submodule(work, name, _lowbit_like(layer, mode, bits, a_bits if name in after_relu else 32))
    return work


def _check_lowbit_args(model: Any, mode: str, bits: int, bits_a: int | None) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"convert_lowbit needs an nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise UserError(f"convert_lowbit: mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "dorefa":
        _check_bits(bits)
        if bits_a is not None:
            _check_bits(bits_a)


def _quantizable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m) in (nn.Conv2d, nn.Linear)]


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, new)


def _lowbit_like(layer: nn.Module, mode: str, bits: int, bits_a: int) -> nn.Module:
    bias = layer.bias is not None
    if isinstance(layer, nn.Conv2d):
        kw = dict(
            in_channels=layer.in_channels, out_channels=layer.out_channels, kernel_size=layer.kernel_size,
            stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups,
            bias=bias, padding_mode=layer.padding_mode,
        )
        cls = {"dorefa": QuantConv2d, "ternary": TernaryConv2d, "binary": BinaryConv2d}[mode]
    else:
        kw = dict(in_features=layer.in_features, out_features=layer.out_features, bias=bias)
        cls = {"dorefa": QuantLinear, "ternary": TernaryLinear, "binary": BinaryLinear}[mode]
    if mode == "dorefa":
        kw.update(bits_w=bits, bits_a=bits_a)
    new = cls(**kw, device=layer.weight.device, dtype=layer.weight.dtype)
    new.load_state_dict(layer.state_dict())
    new.train(layer.training)
    return new


def _layers_after_relu(model: nn.Module) -> set[str]:
    """Names of Conv2d/Linear layers whose input is a ReLU's output, from a torch.fx trace
    (or, when the model does not trace, from module order inside ``nn.Sequential``\\ s)."""
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception:
        return _after_relu_in_order(model)
    return _after_relu_traced(gm)


def _after_relu_traced(gm: torch.fx.GraphModule) -> set[str]:
    names: set[str] = set()
    mods = dict(gm.named_modules())
    relu_fns = {F.relu, torch.relu, torch.relu_}
    for node in gm.graph.nodes:
        if node.op != "call_module" or type(mods.get(node.target)) not in (nn.Conv2d, nn.Linear):
            continue
        src = _source(node, mods)
        if src is not None and _is_relu(src, mods, relu_fns):
            names.add(node.target)
    return names


def _source(node: Any, mods: dict[str, nn.Module]) -> Any:
    """The node ``node`` reads, looking through shape-only ops (flatten, pooling keeps the [0, inf) range)."""
    src = _first_arg(node)
    while src is not None and _is_range_preserving(src, mods):
        src = _first_arg(src)
    return src


def _first_arg(node: Any) -> Any:
    return node.args[0] if node.args else None


def _after_relu_in_order(model: nn.Module) -> set[str]:
    """The layers right after a ReLU in module registration order (what a plain ``nn.Sequential`` runs)."""
    names: set[str] = set()
    prev_relu = False
    for name, m in model.named_modules():
        if type(m) in (nn.Conv2d, nn.Linear):
            if prev_relu:
                names.add(name)
            prev_relu = False
        elif isinstance(m, (nn.ReLU, nn.ReLU6)):
            prev_relu = True
    return names


def _is_relu(node: Any, mods: dict[str, nn.Module], relu_fns: set[Any]) -> bool:
    if node.op == "call_module":
        return isinstance(mods.get(node.target), (nn.ReLU, nn.ReLU6))
    if node.op == "call_function":
        return node.target in relu_fns
    return node.op == "call_method" and node.target in ("relu", "relu_")


def _is_range_preserving(node: Any, mods: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(mods.get(node.target), (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Identity, nn.Dropout))
    if node.op == "call_function":
        return node.target in (torch.flatten, F.adaptive_avg_pool2d, F.max_pool2d, F.avg_pool2d)
    return node.op == "call_method" and node.target in ("flatten", "view", "reshape", "mean")


def _check_bits(bits: int) -> int:
    if not isinstance(bits, int) or not (1 <= bits <= 8 or bits == 32):
        raise UserError(f"low-bit quantization: bits must be an integer from 1 to 8 (or 32 = off), not {bits!r}")
    return bits


# -- registered tricks ----------------------------------------------------------------------------


@register_trick(
    "lowbit_dorefa",
    ids=("I4",),
    kind="train",
    trades="k-bit (8/4/2) weights and activations learned with fake-quant training, for some accuracy and slower training steps; no CPU speed-up without low-bit kernels",
    needs="training data and a model of Conv2d/Linear layers; activations after ReLU",
)
def lowbit_dorefa(model: nn.Module, bits: int = 4, **kwargs: Any) -> nn.Module:
    """:func:`convert_lowbit` with ``mode="dorefa"``."""
    return convert_lowbit(model, "dorefa", bits, **kwargs)


@register_trick(
    "ternary_weights",
    ids=("I4",),
    kind="train",
    trades="ternary {-a, 0, +a} weights (2 bits, ~16x smaller than fp32) for some accuracy; needs training with the quantizer in the loop",
    needs="training data and a model of Conv2d/Linear layers",
)
def ternary_weights(model: nn.Module, **kwargs: Any) -> nn.Module:
    """:func:`convert_lowbit` with ``mode="ternary"`` (TWN)."""
    return convert_lowbit(model, "ternary", **kwargs)


@register_trick(
    "binary_weights",
    ids=("I4",),
    kind="train",
    trades="1-bit weights with a per-channel scale (~32x smaller than fp32) for the largest accuracy loss of the low-bit schemes",
    needs="training data and a model of Conv2d/Linear layers",
)
def binary_weights(model: nn.Module, **kwargs: Any) -> nn.Module:
    """:func:`convert_lowbit` with ``mode="binary"`` (BNN weights with XNOR scaling)."""
    return convert_lowbit(model, "binary", **kwargs)
