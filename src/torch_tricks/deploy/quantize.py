"""Half precision and int8 quantization for inference (I3): dynamic, static, and QAT.

Each step works on a deep copy (the model you pass is never changed) and returns the
new model plus a :class:`QuantReport` saying *which* implementation ran and why the
others did not, because with torch >= 2.10 the answer depends on the stack installed:

* **Dynamic int8** (:func:`quantize_dynamic_int8`): weights of ``nn.Linear`` / LSTM / GRU
  stored as int8, activations quantized on the fly per batch. No calibration, good for
  linear-heavy models (transformers, RNNs) on CPU. ``transformers``' ``Conv1D`` (GPT-2's
  attention and MLP: ``y = x @ W + b``, ``W`` stored [in, out]) is first replaced by the
  equivalent ``nn.Linear`` (``W`` transposed) so it is quantized too, and a head whose weight
  is tied to the input embedding stays fp32 (an int8 copy beside the fp32 embedding would make
  the file larger, not smaller); the report's ``coverage`` says how many matmul layers were
  quantized and why any were not. It uses ``torch.ao``'s
  ``quantize_dynamic`` (fbgemm/x86 kernels): torchao's ``Int8DynamicActivationInt8Weight``
  was measured *slower* than fp32 eager here without ``torch.compile`` (tensor-subclass
  dispatch) and only on par with it. ``nn.TransformerEncoderLayer`` is first rewritten
  into an equivalent layer without the fused "fast path" — that path reads
  ``linear1.weight`` directly and crashes on quantized linears (pytorch#109987) — and
  whose attention projections are plain ``nn.Linear`` so they get quantized too.
* **Static int8** (:func:`quantize_static_int8`): weights *and* activations int8, with
  activation ranges calibrated on sample batches. First choice is the recommended stack,
  torchao PT2E (``torch.export`` -> ``X86InductorQuantizer`` -> ``torch.compile`` with
  weight freezing); it falls back to FX graph mode (``prepare_fx``/``convert_fx``, x86
  qconfig) when torchao is missing or the export / compile fails.
* **Int8 range**: on x86 CPUs without VNNI, oneDNN's and fbgemm's u8*s8 kernels add pairs
  of products in a saturating int16 (see :mod:`torch_tricks.deploy.cpu_int8`). PT2E then
  quantizes activations to 7 bits (``reduce_range``), chosen per CPU or forced; FX's x86
  qconfig and torch.ao's dynamic kernels always do. Each report's ``int8_setting`` says
  which range ran and why.
* **QAT** (:func:`quantize_qat`, :func:`convert_qat`): fake-quant modules inserted for
  fine-tuning with :func:`torch_tricks.train.fit`, then converted to a real int8 model.
* **Half precision** (:func:`cast_half`): bf16 / fp16 weights and inputs.

Agreement, size and latency of any result are measured with
:func:`torch_tricks.deploy.step_report.report`, the same way as for every other deploy step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.deploy.cpu_int8 import Int8Setting, int8_setting
from torch_tricks.deploy.cpu_int8 import torch_cpu_flag as _cpu_flag
from torch_tricks.deploy.step_report import Agreement, agreement, model_size_bytes
from torch_tricks._optional import install_hint
from torch_tricks.device import module_device
from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.inputs import as_input_tuple
from torch_tricks.deploy.steps import (INT8, Coverage, StepContext, StepResult, Tolerance, deploy_step, quiet_torch,
                                       report_details)
from torch_tricks.registry import register_trick

__all__ = [
    "QuantReport",
    "PT2EInt8Model",
    "quantize_dynamic_int8",
    "quantize_static_int8",
    "quantize_qat",
    "convert_qat",
    "cast_half",
    "without_mha_fastpath",
]

TORCHAO_REQUIREMENT = "torchao>=0.18"


@dataclass
class QuantReport:
    """What a quantization / casting step did: which implementation ran, and why.

    ``size_bytes`` / ``new_size_bytes`` are bytes of ``torch.save(state_dict)`` (see
    ``size_method``); agreement is measured on ``example_inputs`` when the step had any.
    Latency is not measured here: use :func:`torch_tricks.deploy.step_report.report`.
    """

    step: str  # int8_dynamic | int8_static | qat_prepare | qat_convert | half
    backend: str  # the implementation that ran: "torch.ao dynamic", "pt2e", "fx", "cast"
    dtype: str  # int8 | bfloat16 | float16
    quantized: dict[str, int] = field(default_factory=dict)  # layer / weight kind -> count
    size_bytes: int = 0  # the original model
    new_size_bytes: int = 0  # the returned model
    size_method: str = "torch.save(state_dict()) bytes"
    agreement: Agreement | None = None
    seconds: float = 0.0  # time the step took (prepare, calibrate, convert, first compile)
    notes: list[str] = field(default_factory=list)
    # int8 steps: the range / types the kernels got and why (Int8Setting.to_dict())
    int8_setting: dict[str, Any] | None = None
    coverage: Coverage | None = None  # how many of the layers it targets it changed, and why not the others

    @property
    def size_ratio(self) -> float:
        """Original size / new size (> 1 means smaller)."""
        return self.size_bytes / self.new_size_bytes if self.new_size_bytes else float("nan")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["size_ratio"] = self.size_ratio
        return d


# -- dynamic int8 ------------------------------------------------------------------------------


def quantize_dynamic_int8(model: nn.Module, *, quantize_tied: bool = False) -> tuple[nn.Module, QuantReport]:
    """Int8 weights for ``nn.Linear``/``nn.LSTM``/``nn.GRU``, activations quantized per call.

    ``nn.TransformerEncoderLayer``\\ s are first replaced by an equivalent layer that
    never takes PyTorch's fused fast path (which crashes on quantized linears,
    pytorch#109987) and whose attention uses ``nn.Linear`` q/k/v and output projections,
    so those are quantized too; ``nn.MultiheadAttention`` elsewhere keeps fp32
    projections. ``transformers``' ``Conv1D`` layers (GPT-2) become the equivalent
    ``nn.Linear`` and are quantized. A linear layer whose weight is shared with another
    module (a head tied to the input embedding) stays fp32 unless ``quantize_tied``: its
    int8 copy would be stored beside the fp32 weight, so the file grows (while the head's
    matmul gets faster). The report's ``coverage`` counts the matmul layers quantized and
    says why the others were not. Inference only (the result has no trainable int8 weights).
    """
    _check_module(model, "quantize_dynamic_int8")
    _check_cpu(model, "int8 dynamic quantization")
    t0 = time.perf_counter()
    work = copy.deepcopy(model).eval()
    rewritten = _rewrite_encoder_layers(work)
    converted = _conv1d_to_linear(work)
    if not any(type(m) in _DYNAMIC_TARGETS for m in work.modules()):
        raise UserError(
            f"int8 dynamic: {type(model).__name__} has no nn.Linear/LSTM/GRU layer to quantize: "
            "use quantize_static_int8 for convolutional models"
        )
    layers = _matmul_layers(work)
    kept = {} if quantize_tied else _tied_layers(work, layers)
    spec: dict[Any, Any] = {t: torch.ao.quantization.default_dynamic_qconfig for t in _DYNAMIC_TARGETS}
    spec.update({name: None for name in kept})  # a name's entry overrides its type's
    with quiet_torch():
        qmodel = torch.ao.quantization.quantize_dynamic(work, spec, dtype=torch.qint8, inplace=True)
    coverage = _dynamic_coverage(qmodel, layers, kept)
    notes = _dynamic_notes(rewritten, converted)
    if any(isinstance(m, nn.TransformerEncoderLayer) for m in qmodel.modules()):
        qmodel = without_mha_fastpath(qmodel)
        notes.append("some encoder layers could not be rewritten: the model runs with the MHA fast path off")
    setting = _dynamic_setting()
    notes.append(f"int8 setting: {setting.describe()}")
    return qmodel, QuantReport(
        step="int8_dynamic",
        backend="torch.ao dynamic",
        dtype="int8",
        quantized=_count_quantized(qmodel),
        size_bytes=model_size_bytes(model),
        new_size_bytes=model_size_bytes(qmodel),
        seconds=time.perf_counter() - t0,
        notes=notes,
        int8_setting=setting.to_dict(),
        coverage=coverage,
    )


_DYNAMIC_TARGETS = (nn.Linear, nn.LSTM, nn.GRU)  # exact types: torch.ao swaps these and no subclass


def _dynamic_notes(rewritten: int, converted: int) -> list[str]:
    """What :func:`quantize_dynamic_int8` rewrote before quantizing, and which implementation ran."""
    notes = []
    if rewritten:
        notes.append(
            f"{rewritten} nn.TransformerEncoderLayer(s) rewritten without the fused fast path "
            "(it crashes on quantized linears, pytorch#109987); attention projections quantized too"
        )
    if converted:
        notes.append(f"{converted} transformers Conv1D layer(s) (weight stored [in, out], GPT-2 style) replaced by "
                     "the equivalent nn.Linear (weight transposed), so they are quantized too")
    notes.append(
        "torch.ao quantize_dynamic used: torchao's Int8DynamicActivationInt8Weight measured slower "
        "than fp32 eager on CPU without torch.compile"
    )
    return notes


def _is_hf_conv1d(m: nn.Module) -> bool:
    """``transformers``' ``Conv1D`` itself (checked by name: transformers is not imported here;
    a subclass may change ``forward``, so only the class itself)."""
    cls = type(m)
    return cls.__name__ == "Conv1D" and cls.__module__ in ("transformers.pytorch_utils", "transformers.modeling_utils")


def _conv1d_to_linear(model: nn.Module) -> int:
    """Replace (in place) each ``transformers`` ``Conv1D`` whose weight is its own by the equivalent
    ``nn.Linear``: ``Conv1D`` computes ``x @ W + b`` with ``W`` [in, out], ``nn.Linear``
    ``x @ W.T + b`` with ``W`` [out, in], so the weight is transposed. A shared weight stays (a
    copy would untie it)."""
    shared = _shared_parameters(model)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_hf_conv1d(child) and id(child.weight) not in shared:
                setattr(parent, name, _linear_of_conv1d(child))
                count += 1
    return count


def _linear_of_conv1d(conv: nn.Module) -> nn.Linear:
    w, b = conv.weight, conv.bias
    linear = torch.nn.utils.skip_init(nn.Linear, w.shape[0], w.shape[1], bias=b is not None,
                                      device=w.device, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w.t())
        if b is not None:
            linear.bias.copy_(b)
    return linear.train(conv.training)


def _shared_parameters(model: nn.Module) -> set[int]:
    """The ids of parameters that more than one module holds (tied weights)."""
    owners: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {k for k, n in owners.items() if n > 1}


def _matmul_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers int8-dynamic targets: every ``nn.Linear`` (subclasses too: they count, even
    where torch.ao leaves them), LSTM, GRU and ``transformers`` ``Conv1D`` left unconverted."""
    return {n: m for n, m in model.named_modules()
            if isinstance(m, _DYNAMIC_TARGETS) or _is_hf_conv1d(m)}


def _tied_layers(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, str]:
    """Layer -> why it stays fp32, for the layers whose weight another module holds too."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            holders.setdefault(id(p), []).append((name, mod))
    out = {}
    for name, m in layers.items():
        weight = getattr(m, "weight", None)
        others = [(n, o) for n, o in holders.get(id(weight), []) if n != name] if weight is not None else []
        if others:
            out[name] = _tied_why(*others[0])
    return out


def _tied_why(name: str, other: nn.Module) -> str:
    if isinstance(other, nn.Embedding):
        return (f"tied to the input embedding ({name}): an int8 copy would be stored beside its fp32 weight "
                "and the file would grow (quantize_dynamic_int8(model, quantize_tied=True) quantizes it anyway)")
    return f"its weight is shared with {name} (an int8 copy would be stored beside it)"


def _dynamic_coverage(qmodel: nn.Module, layers: dict[str, nn.Module], kept: dict[str, str]) -> Coverage:
    """How many of ``layers`` (named as in ``qmodel``) torch.ao quantized, and why not the others."""
    missed = {}
    done = 0
    for name, before in layers.items():
        if _is_quantized_layer(qmodel.get_submodule(name)):
            done += 1
        elif name not in kept:
            missed[name] = _why_not_dynamic(name, before, qmodel)
    return Coverage("quantized", done, len(layers), "matmul layers", left_as="fp32", kept=kept, missed=missed)


def _why_not_dynamic(name: str, layer: nn.Module, qmodel: nn.Module) -> str:
    parent = qmodel.get_submodule(name.rpartition(".")[0]) if "." in name else qmodel
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads its projection weights itself, so torch.ao leaves them fp32"
    if _is_hf_conv1d(layer):
        return "a transformers Conv1D whose weight is shared (converting it would untie it)"
    return f"{type(layer).__name__} is not a type torch.ao's dynamic quantization converts (exact nn.Linear/LSTM/GRU)"


def _is_quantized_layer(m: nn.Module) -> bool:
    """A ``torch.ao`` int8 layer holding weights (a quantized conv / linear, or a dynamic LSTM/GRU)."""
    if type(m).__name__.endswith(("PackedParams", "PackedParameter")):
        return False
    return ".quantized" in type(m).__module__ and (callable(getattr(m, "_weight_bias", None))
                                                  or hasattr(m, "_all_weight_values"))


def _dynamic_setting() -> Int8Setting:
    """torch.ao's dynamic kernels fix the range themselves: ``DynamicQuantizedLinear.forward``
    calls ``quantized::linear_dynamic(..., reduce_range=True)`` and the dynamic LSTM/GRU
    build their cells with ``make_quantized_cell_params_dynamic(..., True)``: activations
    0..127 on every CPU, so |u7 * s8 + u7 * s8| <= 32512 never saturates."""
    auto = int8_setting("torch")
    return Int8Setting(
        runtime="torch", for_vnni=False, reduce_range=True, weight_type="int8", activation_type="uint8",
        vnni=auto.vnni, forced=False, reason="torch.ao's dynamic Linear/LSTM/GRU kernels always quantize activations with "
        "reduce_range=True (0..127): saturation-free on any x86 CPU, with or without VNNI",
    )


class _NoMHAFastPath(nn.Module):
    """Runs the wrapped model with ``torch.backends.mha`` fast path off (restored after)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        prev = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            return self.model(*args, **kwargs)
        finally:
            torch.backends.mha.set_fastpath_enabled(prev)


def without_mha_fastpath(model: nn.Module) -> nn.Module:
    """Wrap ``model`` so its forward runs with the fused MHA / encoder fast path disabled.

    The state-dict keys gain a ``model.`` prefix; prefer the layer rewrite that
    :func:`quantize_dynamic_int8` does, which needs no wrapper.
    """
    return _NoMHAFastPath(model)


class _SelfAttention(nn.Module):
    """Self-attention with ``nn.Linear`` projections and SDPA: the math of ``nn.MultiheadAttention``
    for ``query is key is value``, in a form ``quantize_dynamic`` can quantize.

    Keeps ``batch_first``/``num_heads``/``embed_dim`` because ``nn.TransformerEncoder``
    reads ``layers[0].self_attn.batch_first``.
    """

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        e = mha.embed_dim
        self.embed_dim, self.num_heads, self.batch_first = e, mha.num_heads, mha.batch_first
        self.dropout = mha.dropout
        bias = mha.in_proj_bias is not None
        self.in_proj = nn.Linear(e, 3 * e, bias=bias)
        self.out_proj = nn.Linear(e, e, bias=mha.out_proj.bias is not None)
        with torch.no_grad():
            self.in_proj.weight.copy_(mha.in_proj_weight)
            if bias:
                self.in_proj.bias.copy_(mha.in_proj_bias)
            self.out_proj.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                self.out_proj.bias.copy_(mha.out_proj.bias)
        self.to(mha.in_proj_weight.device)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if not self.batch_first:
            x = x.transpose(0, 1)
        b, n, e = x.shape
        h = self.num_heads
        q, k, v = self.in_proj(x).view(b, n, 3, h, e // h).permute(2, 0, 3, 1, 4).unbind(0)
        mask = _sdpa_mask(attn_mask, key_padding_mask, x.dtype, b, n)
        causal = bool(is_causal) and mask is None
        p = self.dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        o = self.out_proj(o.transpose(1, 2).reshape(b, n, e))
        return o if self.batch_first else o.transpose(0, 1)


def _sdpa_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, dtype: torch.dtype,
               b: int, n: int) -> torch.Tensor | None:
    """MHA's attention mask and key padding mask as one additive mask for SDPA (None without either)."""
    mask = _additive_mask(attn_mask, dtype)
    pad = _additive_mask(key_padding_mask, dtype)
    if pad is None:
        return mask
    pad = pad.view(b, 1, 1, n)
    return pad if mask is None else mask + pad


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """MHA masks (bool: True = masked out, or float: added) as an additive float mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


class _EncoderLayerNoFastPath(nn.Module):
    """``nn.TransformerEncoderLayer``'s slow-path math (same parameters and outputs),
    without its fused fast path, with :class:`_SelfAttention`."""

    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        self.self_attn = _SelfAttention(layer.self_attn)
        self.linear1, self.dropout, self.linear2 = layer.linear1, layer.dropout, layer.linear2
        self.norm1, self.norm2 = layer.norm1, layer.norm2
        self.dropout1, self.dropout2 = layer.dropout1, layer.dropout2
        self.norm_first = layer.norm_first
        self.activation = layer.activation

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff(x))

    def _sa(self, x, mask, pad, is_causal) -> torch.Tensor:
        return self.dropout1(self.self_attn(x, mask, pad, is_causal))

    def _ff(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear1(x)
        # in place: the linear's output is fresh, and an extra activation buffer costs
        # as much as the relu itself on CPU
        h = torch.relu_(h) if self.activation is F.relu else self.activation(h)
        return self.dropout2(self.linear2(self.dropout(h)))


def _rewrite_encoder_layers(model: nn.Module) -> int:
    """Replace every self-attention ``nn.TransformerEncoderLayer`` in ``model`` (in place)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.TransformerEncoderLayer and _rewritable(child.self_attn):
                setattr(parent, name, _EncoderLayerNoFastPath(child).train(child.training))
                count += 1
        if isinstance(parent, nn.TransformerEncoder):
            parent.use_nested_tensor = False  # the nested path reads fused-layer weights
    return count


def _rewritable(mha: nn.MultiheadAttention) -> bool:
    return (
        mha._qkv_same_embed_dim
        and mha.bias_k is None
        and not mha.add_zero_attn
        and mha.in_proj_weight is not None
    )


# -- static int8 -------------------------------------------------------------------------------


def quantize_static_int8(
    model: nn.Module,
    calibration_batches: Iterable[Any],
    example_inputs: Any,
    *,
    backend: str = "auto",
    cpp_wrapper: bool = True,
    reduce_range: bool | None = None,
) -> tuple[nn.Module, QuantReport]:
    """Post-training static int8: calibrate activation ranges, then convert.

    ``calibration_batches`` yields inputs like ``example_inputs`` (a tensor or a tuple of
    positional args); ``(inputs, target)`` pairs from a DataLoader are accepted when the
    model takes one tensor. Calibrate on data from the distribution the model will see:
    the int8 activation ranges come from it.

    ``backend``: ``"pt2e"`` (torchao: export, ``X86InductorQuantizer``, ``torch.compile``
    with freezing), ``"fx"`` (``torch.ao`` FX graph mode, x86 qconfig, eager int8
    kernels, any input shape), or ``"auto"`` = PT2E, falling back to FX when torchao is
    missing or export / compile fails; the report's ``backend`` and ``notes`` say which
    ran and why. The PT2E model is exported with a dynamic batch dimension when the model
    allows it, the other dimensions fixed to ``example_inputs``'s (a mismatch is a
    :class:`UserError`); see :class:`PT2EInt8Model`. ``cpp_wrapper`` (PT2E only) has
    inductor generate the graph's launcher in C++ instead of Python: measured here on
    ResNet-18 at batch 1 with 2 threads it was ~9% faster (no change with 1 thread), for
    about twice the compile time (~20 s instead of ~10 s at 224x224).

    ``reduce_range`` (PT2E): None picks it for this CPU with
    :func:`~torch_tricks.deploy.cpu_int8.int8_setting` — 7-bit activations where oneDNN
    has no VNNI (its u8*s8 pair sums would saturate), full 8 bits where it has —; True /
    False force it. FX always uses torch.ao's x86 qconfig, whose activation observer
    reduces the range on every CPU (``reduce_range=False`` with ``backend="fx"`` is
    refused). The report's ``int8_setting`` and ``notes`` say what ran and why.
    """
    _check_module(model, "quantize_static_int8")
    _check_cpu(model, "int8 static quantization")
    _check_static_options(backend, reduce_range)
    example = as_input_tuple(example_inputs)
    batches = [_calibration_args(b, len(example)) for b in calibration_batches]
    if not batches:
        raise UserError("int8 static: calibration_batches is empty: pass a few batches of real inputs")
    notes: list[str] = []
    t0 = time.perf_counter()
    if backend in ("auto", "pt2e"):
        done = _try_pt2e(model, batches, example, backend, cpp_wrapper, reduce_range, notes, t0)
        if done is not None:
            return done
    return _fx_int8(model, batches, example, reduce_range, notes, t0)


def _check_static_options(backend: str, reduce_range: Any) -> None:
    if backend not in ("auto", "pt2e", "fx"):
        raise UserError(f"int8 static: backend must be auto, pt2e or fx, not {backend!r}")
    _check_reduce_range(reduce_range)
    if backend == "fx" and reduce_range is False:
        raise UserError("int8 static (fx): torch.ao's x86 qconfig always quantizes activations to 7 bits; "
                        "the full range is PT2E's (backend='pt2e')")


def _try_pt2e(
    model: nn.Module, batches: list[tuple[Any, ...]], example: tuple[Any, ...], backend: str, cpp_wrapper: bool,
    reduce_range: bool | None, notes: list[str], t0: float,
) -> tuple[nn.Module, QuantReport] | None:
    """The PT2E int8 model and its report; None (and a note why) where PT2E failed and FX may run instead."""
    try:
        setting = int8_setting("torch", None if reduce_range is None else not reduce_range)
        qmodel, quantized, pt2e_notes = _static_pt2e(model, batches, example, cpp_wrapper, setting.reduce_range)
    except _PT2EFailed as exc:
        if backend == "pt2e":
            raise UserError(f"int8 static (pt2e): {exc}; try backend='fx'") from None
        notes.append(f"pt2e not used: {exc}")
        return None
    notes.extend(pt2e_notes)
    notes.append(f"int8 setting: {setting.describe()}")
    return qmodel, _static_report(model, qmodel, "pt2e", quantized, example, t0, notes, setting)


def _fx_int8(
    model: nn.Module, batches: list[tuple[Any, ...]], example: tuple[Any, ...], reduce_range: bool | None,
    notes: list[str], t0: float,
) -> tuple[nn.Module, QuantReport]:
    """The FX int8 model and its report (``notes`` says why PT2E did not run, if it was tried)."""
    try:
        qmodel, quantized, setting = _static_fx(model, batches, example)
    except _FXFailed as exc:
        why_pt2e = f" ({notes[0]})" if notes else ""
        raise UserError(f"int8 static cannot apply: {exc}{why_pt2e}") from None
    notes.append(
        "fx ran: torch.ao FX graph mode (deprecated in favour of torchao PT2E but still supported), "
        "x86 qconfig, eager int8 kernels, any input shape"
    )
    if reduce_range is False:
        notes.append("the full range asked for applies to PT2E only: FX ran with torch.ao's 7-bit activations")
    elif reduce_range is True:
        setting = dataclasses.replace(setting, forced=True)
    notes.append(f"int8 setting: {setting.describe()}")
    return qmodel, _static_report(model, qmodel, "fx", quantized, example, t0, notes, setting)


def _check_reduce_range(reduce_range: Any) -> None:
    if reduce_range is not None and not isinstance(reduce_range, bool):
        raise UserError(f"reduce_range must be True, False or None (chosen for this CPU), not {reduce_range!r}")


class PT2EInt8Model(nn.Module):
    """A PT2E-quantized, inductor-compiled int8 model; inference only.

    ``quantized`` is the converted ``torch.export`` graph (int8 weights folded in; its
    state dict is what :func:`model_size_bytes` measures). Calls run the
    ``torch.compile``\\ d version of it (weights frozen into the compiled code) under
    ``inference_mode`` (outputs are inference tensors: ``.clone()`` them to use them in
    autograd). The export fixes every input dimension except the batch dimension
    (when ``dynamic_batch``): inductor specialises on each new batch size it sees, so
    the first call at a new batch size compiles (seconds) and later calls reuse that
    compiled graph — one compiled model per batch size, up to
    ``torch._dynamo.config.recompile_limit`` (8) of them. Other shapes raise a
    :class:`UserError`.

    Inductor bakes ``torch.get_num_threads()`` into the kernels it generates: run the
    model with the thread count it was compiled under (``compiled_threads``). Measured
    here, ResNet-18 compiled with 2 threads and run with 1 was 4.5x slower than when
    compiled with 1.
    """

    def __init__(
        self, quantized: nn.Module, example: tuple[Any, ...], dynamic_batch: bool, *, cpp_wrapper: bool = True
    ) -> None:
        super().__init__()
        self.quantized = quantized
        self.dynamic_batch = dynamic_batch
        self.cpp_wrapper = cpp_wrapper
        self._spec = [_arg_spec(a) for a in example]
        self._batch = _batch_of(example)
        self.compiled_threads = torch.get_num_threads()
        self._compile()

    def _compile(self) -> None:
        """A fresh ``torch.compile`` of a *copy* of ``quantized``.

        The copy keeps ``quantized`` pristine: after a ``torch._dynamo.reset()`` (a strict
        ``torch.export`` anywhere in the process does one) the cached graphs are gone, and
        re-freezing a module that was compiled before can fail in inductor, while a fresh
        copy compiles fine.
        """
        with quiet_torch():
            work = copy.deepcopy(self.quantized)
        compiled = torch.compile(work, dynamic=False)
        # Kept out of the module tree: it would duplicate the state dict.
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_seen", set())
        self.compiled_threads = torch.get_num_threads()

    def forward(self, *args: Any) -> Any:
        self._check(args)
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        # Always under inference_mode: dynamo guards on the grad mode, so a call under
        # no_grad after one under inference_mode would compile the graph again. Freezing
        # is switched on around every call (about 15 us), not only the first: a recompile
        # can happen at any call after a dynamo reset, and without freezing it silently
        # gives a 5x slower graph; torch.compile(options={"freezing": True}) alone does
        # not work here (inductor then sees the int8 weights as graph inputs and fails).
        # Warnings are silenced around every call for the same reason (inductor's
        # lowering warns while it compiles); no user code runs inside.
        with torch.inference_mode(), _freezing(self.cpp_wrapper), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if key in self._seen:
                try:
                    return self._compiled(*args)
                except Exception as exc:
                    if not _is_compile_error(exc):
                        raise
                    self._compile()  # the cache was reset and the recompile failed: start fresh
            with quiet_torch():  # the first call at a shape compiles: keep its log lines in too
                out = self._compiled(*args)
            self._seen.add(key)
            return out

    def _check(self, args: tuple[Any, ...]) -> None:
        got = [_arg_spec(a) for a in args]
        batch_ok = self.dynamic_batch or _batch_of(args) == self._batch
        if got != self._spec or not batch_ok:
            raise self._mismatch(args, got)

    def _mismatch(self, args: tuple[Any, ...], got: list[Any]) -> UserError:
        want = ", ".join(_describe(s, self._batch, self.dynamic_batch) for s in self._spec)
        have = ", ".join(_describe(s, _batch_of(args), False) for s in got)
        return UserError(
            f"this int8 PT2E model was exported for inputs {want}, got {have}: "
            "quantize again with example_inputs of that shape, or use backend='fx' (any shape)"
        )


class _PT2EFailed(Exception):
    pass


class _FXFailed(Exception):
    pass


def _static_pt2e(
    model: nn.Module, batches: list[tuple[Any, ...]], example: tuple[Any, ...], cpp_wrapper: bool = True,
    reduce_range: bool = False,
) -> tuple[nn.Module, dict[str, int], list[str]]:
    ao = _import_torchao_pt2e()
    if ao is None:
        raise _PT2EFailed(f"torchao is not installed ({install_hint('deploy')})")
    notes = []
    exported, dynamic_batch, why = _export_for_pt2e(copy.deepcopy(model).eval(), example)
    if not dynamic_batch:
        notes.append(f"exported at a fixed batch size {_batch_of(example)} (a dynamic batch dimension failed: {why})")
    try:
        converted = _calibrate_pt2e(ao, exported, batches, example, dynamic_batch, reduce_range)
        _drop_unused_attributes(converted)
        qmodel = PT2EInt8Model(converted, example, dynamic_batch, cpp_wrapper=cpp_wrapper)
        with torch.inference_mode():
            qmodel(*example)  # compile now, so a failure falls back instead of surfacing later
    except (UserError, _PT2EFailed):
        raise
    except Exception as exc:
        raise _PT2EFailed(f"quantize / compile failed: {one_line(exc, with_type=True)}") from None
    int8 = sum(1 for t in converted.state_dict().values() if t.dtype == torch.int8)
    if int8 == 0:
        raise _PT2EFailed("the X86InductorQuantizer found no conv/linear to quantize")
    notes.append(_pt2e_ran(cpp_wrapper, dynamic_batch))
    return qmodel, {"int8 weight tensors": int8}, notes


def _calibrate_pt2e(
    ao: tuple[Callable[..., Any], Callable[..., Any], Any], exported: nn.Module, batches: list[tuple[Any, ...]],
    example: tuple[Any, ...], dynamic_batch: bool, reduce_range: bool,
) -> nn.Module:
    """Insert the X86InductorQuantizer's observers, run the calibration batches, convert."""
    prepare_pt2e, convert_pt2e, xiq = ao
    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config(reduce_range=reduce_range))
    with quiet_torch():
        prepared = prepare_pt2e(exported, quantizer)
        used = [a for a in batches if dynamic_batch or _batch_of(a) == _batch_of(example)]
        if not used:
            raise _PT2EFailed(f"fixed-shape export: no calibration batch has batch size {_batch_of(example)}")
        with torch.no_grad():
            for args in used:
                prepared(*args)
        return convert_pt2e(prepared)


def _pt2e_ran(cpp_wrapper: bool, dynamic_batch: bool) -> str:
    return (
        "pt2e ran: torchao X86InductorQuantizer, torch.export (strict), torch.compile with freezing"
        + (" and the C++ wrapper; " if cpp_wrapper else "; ")
        + ("dynamic batch, one compiled graph per batch size" if dynamic_batch else "fixed input shape")
        + f"; compiled for {torch.get_num_threads()} threads (run it with the same torch.set_num_threads)"
    )


def _export_for_pt2e(work: nn.Module, example: tuple[Any, ...]) -> tuple[nn.Module, bool, str]:
    """Strict ``torch.export`` of ``work``, batch dim dynamic if it can be: (module, dynamic, why not dynamic)."""
    # strict (dynamo) export: torch 2.13's default non-strict export leaves no
    # source_fn_stack, and torchao 0.18 then groups every call of a reused module (one
    # nn.ReLU called twice, as in ResNet blocks) into one partition and fails.
    doubled = _at_least_two_rows(example)
    why = ""
    for dynamic in (True, False):
        try:
            with quiet_torch():
                shapes = _batch_dynamic_shapes(example) if dynamic else None
                args = doubled if dynamic else example
                return torch.export.export(work, args, dynamic_shapes=shapes, strict=True).module(), dynamic, why
        except Exception as exc:  # torch.export raises many kinds; all mean "not exportable"
            why = one_line(exc, with_type=True)
    raise _PT2EFailed(f"torch.export failed: {why}")


def _at_least_two_rows(example: tuple[Any, ...]) -> tuple[Any, ...]:
    """A batch of 1 would be specialised (export treats size-1 dims as constants), so the
    dynamic-batch export traces a batch of 2 made of the example repeated."""
    if _batch_of(example) != 1:
        return example
    return tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) and a.dim() else a for a in example)


def _static_fx(
    model: nn.Module, batches: list[tuple[Any, ...]], example: tuple[Any, ...]
) -> tuple[nn.Module, dict[str, int], Int8Setting]:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    work = copy.deepcopy(model).eval()
    engine = torch.backends.quantized.engine
    mapping = get_default_qconfig_mapping(engine)
    setting = _fx_setting(mapping, engine)
    try:
        with quiet_torch():
            prepared = prepare_fx(work, mapping, example)
    except Exception as exc:
        raise _FXFailed(f"torch.fx cannot trace {type(model).__name__}: {one_line(exc, with_type=True)}") from None
    try:
        with quiet_torch(), torch.no_grad():
            for args in batches:
                prepared(*args)
            qmodel = convert_fx(prepared)
            qmodel(*example)
    except Exception as exc:
        raise _FXFailed(f"FX int8 conversion failed: {one_line(exc, with_type=True)}") from None
    return qmodel, _count_quantized(qmodel), setting


def _fx_setting(mapping: Any, engine: str) -> Int8Setting:
    """The range FX uses, read from the qconfig it runs with (not assumed): torch.ao's
    ``x86`` / ``fbgemm`` qconfigs observe activations with ``reduce_range=True``."""
    with quiet_torch():
        observer = mapping.global_qconfig.activation()
    reduced = bool(getattr(observer, "reduce_range", False))
    auto = int8_setting("torch")
    if reduced:
        why = (f"torch.ao's {engine} qconfig observes activations with reduce_range=True (0..127) on every CPU: "
               "saturation-free with or without VNNI")
    else:
        why = f"torch.ao's {engine} qconfig keeps the full activation range; " + auto.reason
    return Int8Setting(runtime="torch", for_vnni=not reduced, reduce_range=reduced, weight_type="int8",
                       activation_type="uint8", vnni=auto.vnni, forced=False, reason=why)


def _static_report(
    model: nn.Module,
    qmodel: nn.Module,
    backend: str,
    quantized: dict[str, int],
    example: tuple[Any, ...],
    t0: float,
    notes: list[str],
    setting: Int8Setting | None = None,
) -> QuantReport:
    seconds = time.perf_counter() - t0
    reference = _eval_copy(model) if model.training else model
    with quiet_torch():
        agree = agreement(reference, qmodel, example)
    method = "torch.save(state_dict()) bytes"
    if backend == "pt2e":
        method = (
            "torch.save of the converted export graph's live state: int8 weights, fp32 per-channel "
            "scales and biases, int64 zero points (unused fp32 originals dropped)"
        )
    return QuantReport(
        step="int8_static",
        backend=backend,
        dtype="int8",
        quantized=quantized,
        size_bytes=model_size_bytes(model),
        new_size_bytes=model_size_bytes(qmodel),
        size_method=method,
        agreement=agree,
        seconds=seconds,
        notes=notes,
        int8_setting=setting.to_dict() if setting is not None else None,
        coverage=_static_coverage(model, qmodel, backend, quantized),
    )


_STATIC_TARGETS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def _static_coverage(model: nn.Module, qmodel: nn.Module, backend: str, quantized: dict[str, int]) -> Coverage:
    """How many of the model's conv / linear layers have int8 weights after static quantization.

    FX keeps the module names, so the layers left fp32 are named; the PT2E graph holds one int8
    weight per quantized conv / linear (BatchNorms folded in), so only their count is known.
    """
    layers = [n for n, m in model.named_modules() if isinstance(m, _STATIC_TARGETS)]
    kind, why = "conv/linear layers", "left fp32 by the quantizer (no int8 pattern matched it)"
    if backend == "pt2e":
        done = quantized.get("int8 weight tensors", 0)
        left = len(layers) - done
        missed = {f"{left} layer(s)": why} if left > 0 else {}
        return Coverage("quantized", done, max(len(layers), done), kind, left_as="fp32", missed=missed)
    missed = {n: why for n in layers if not _is_quantized_layer(_submodule_or_none(qmodel, n))}
    return Coverage("quantized", len(layers) - len(missed), len(layers), kind, left_as="fp32", missed=missed)


def _submodule_or_none(model: nn.Module, name: str) -> Any:
    try:
        return model.get_submodule(name)
    except AttributeError:  # FX drops the modules its graph no longer calls
        return None


def _eval_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).eval()


def _drop_unused_attributes(gm: nn.Module) -> None:
    """Delete parameters / buffers the converted graph no longer reads (the fp32 weights
    that PT2E folded into int8 constants), so the state dict is the int8 model's."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return
    used = {n.target for n in graph.nodes if n.op == "get_attr"}
    names = [n for n, _ in gm.named_parameters()] + [n for n, _ in gm.named_buffers()]
    for name in names:
        if not _is_read(name, used):
            _drop_attribute(gm, name)
    with contextlib.suppress(Exception):
        gm.delete_all_unused_submodules()


def _is_read(name: str, used: set[str]) -> bool:
    """Whether the graph reads the attribute ``name``, itself, inside it or around it."""
    return name in used or any(u.startswith(name + ".") or name.startswith(u + ".") for u in used)


def _drop_attribute(gm: nn.Module, name: str) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    owner._parameters.pop(attr, None)
    owner._buffers.pop(attr, None)


def _batch_dynamic_shapes(example: tuple[Any, ...]) -> tuple[Any, ...]:
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    return tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in example)


def _arg_spec(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (str(a.dtype).removeprefix("torch."), tuple(a.shape[1:]))
    return type(a).__name__


def _batch_of(args: tuple[Any, ...]) -> int | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
    return None


def _describe(spec: Any, batch: int | None, dynamic: bool) -> str:
    if isinstance(spec, tuple):
        dtype, rest = spec
        b = "N" if dynamic else str(batch)
        return f"({', '.join([b, *map(str, rest)])}) {dtype}"
    return str(spec)


def _calibration_args(batch: Any, n_example: int) -> tuple[Any, ...]:
    """One calibration item as positional args; ``(x, y)`` loader pairs give ``(x,)``."""
    args = as_input_tuple(batch)
    if n_example == 1 and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args):
        return args[:1]
    if len(args) != n_example:
        raise UserError(
            f"int8 static: a calibration batch has {len(args)} inputs, example_inputs has {n_example}: "
            "pass calibration batches shaped like example_inputs"
        )
    return args


# -- quantization-aware training ----------------------------------------------------------------


@register_trick(
    "qat",
    ids=("I3",),
    kind="deploy",
    trades="a few epochs of fine-tuning with fake-quant (slower steps) for int8 accuracy closer to fp32 than post-training quantization",
    needs="training data and a model torch.fx can trace; the int8 result runs on CPU",
)
def quantize_qat(model: nn.Module, example_inputs: Any) -> tuple[nn.Module, QuantReport]:
    """Insert fake-quant (and fuse conv-BN-ReLU) for quantization-aware fine-tuning.

    The returned model trains with :func:`torch_tricks.train.fit` like any model (a few
    epochs at a low learning rate); then :func:`convert_qat` makes the int8 model.
    FX graph mode (``prepare_qat_fx``, x86 qconfig) is used rather than PT2E QAT because
    an exported PT2E graph ignores ``model.train()``/``model.eval()`` (torchao needs
    ``move_exported_model_to_eval``), so the loop's validation would run BN in training mode.
    Common refinements: freeze BN statistics and observers for the last epoch
    (``torch.ao.nn.intrinsic.qat.freeze_bn_stats``, ``torch.ao.quantization.disable_observer``).
    """
    _check_module(model, "quantize_qat")
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    t0 = time.perf_counter()
    example = as_input_tuple(example_inputs)
    work = copy.deepcopy(model).train()
    try:
        with quiet_torch():
            prepared = prepare_qat_fx(work, get_default_qat_qconfig_mapping(torch.backends.quantized.engine), example)
    except Exception as exc:
        raise UserError(f"qat cannot apply: torch.fx cannot trace {type(model).__name__}: {one_line(exc, with_type=True)}") from None
    fq = sum(1 for m in prepared.modules() if isinstance(m, torch.ao.quantization.FakeQuantizeBase))
    return prepared, QuantReport(
        step="qat_prepare",
        backend="fx",
        dtype="int8 (fake-quant)",
        quantized={"fake-quant modules": fq},
        size_bytes=model_size_bytes(model),
        new_size_bytes=model_size_bytes(prepared),
        seconds=time.perf_counter() - t0,
        notes=["fx QAT (prepare_qat_fx): PT2E QAT graphs ignore .train()/.eval(), which fit() relies on"],
    )


def convert_qat(model: nn.Module, example_inputs: Any | None = None) -> tuple[nn.Module, QuantReport]:
    """The int8 model (FX ``convert_fx``) of a :func:`quantize_qat` model after fine-tuning.

    With ``example_inputs``, the report holds the agreement of the int8 model with the
    fake-quant model it came from.
    """
    from torch.ao.quantization.quantize_fx import convert_fx

    if not isinstance(model, torch.fx.GraphModule) or not any(
        isinstance(m, torch.ao.quantization.FakeQuantizeBase) for m in model.modules()
    ):
        raise UserError("convert_qat needs the model returned by quantize_qat (after fine-tuning)")
    _check_cpu(model, "int8 conversion")
    t0 = time.perf_counter()
    work = copy.deepcopy(model).eval()
    with quiet_torch():
        qmodel = convert_fx(work)
    agree = None
    if example_inputs is not None:
        with quiet_torch():
            agree = agreement(_eval_copy(model), qmodel, example_inputs)
    return qmodel, QuantReport(
        step="qat_convert",
        backend="fx",
        dtype="int8",
        quantized=_count_quantized(qmodel),
        size_bytes=model_size_bytes(model),
        new_size_bytes=model_size_bytes(qmodel),
        agreement=agree,
        seconds=time.perf_counter() - t0,
        notes=["agreement is with the fake-quant model"] if agree is not None else [],
    )


# -- half precision ------------------------------------------------------------------------------


def cast_half(
    model: nn.Module,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> tuple[nn.Module, QuantReport]:
    """A copy of ``model`` with floating-point weights in ``dtype`` on ``device``.

    A forward pre-hook casts floating-point inputs to ``dtype`` and a forward hook casts
    floating-point outputs back to float32, so callers need no change. fp16 on CPU is
    refused: CPU fp16 convolutions and matmuls have no native kernels without AMX-FP16
    (they convert to fp32 and back) — ResNet-18 at batch 1 measured 23x *slower* than
    fp32 here. bf16 on CPU is allowed: fast only with AVX512-BF16 or AMX (measured 1.5x
    faster than fp32 here, on an AVX512-BF16 CPU); the report notes which this CPU has.
    """
    _check_module(model, "cast_half")
    if dtype not in (torch.bfloat16, torch.float16):
        raise UserError(f"cast_half: dtype must be torch.bfloat16 or torch.float16, not {dtype}")
    dev = torch.device(device) if device is not None else module_device(model)
    notes = _fp16_notes(dev) if dtype == torch.float16 else _bf16_notes(dev)
    t0 = time.perf_counter()
    work = copy.deepcopy(model).eval().to(device=dev, dtype=dtype)
    work.register_forward_pre_hook(functools.partial(_cast_inputs, dtype=dtype))
    work.register_forward_hook(functools.partial(_cast_outputs, dtype=torch.float32))
    name = str(dtype).removeprefix("torch.")
    notes.append("inputs are cast to " + name + " and outputs back to float32 by hooks")
    cast = sum(1 for t in work.state_dict().values() if t.dtype == dtype)
    floating = [t.dtype for t in model.state_dict().values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return work, QuantReport(
        step="half",
        backend="cast",
        dtype=name,
        quantized={"floating tensors": cast},
        size_bytes=model_size_bytes(model),
        new_size_bytes=model_size_bytes(work),
        seconds=time.perf_counter() - t0,
        notes=notes,
        coverage=Coverage(f"cast to {name}", sum(d != dtype for d in floating), len(floating),
                          "floating-point weight and buffer tensors"),
    )


def _fp16_notes(dev: torch.device) -> list[str]:
    """fp16 is refused on a CPU without AMX-FP16 (no native kernels)."""
    if dev.type != "cpu":
        return []
    if not _cpu_flag("_is_amx_fp16_supported"):
        raise UserError(
            "fp16 inference on CPU is slower than fp32 (no native fp16 matmul/conv kernels without "
            "AMX-FP16, they are emulated through fp32): use dtype=torch.bfloat16, int8, or a GPU"
        )
    return ["fp16 on CPU: this CPU has AMX-FP16"]


def _bf16_notes(dev: torch.device) -> list[str]:
    """bf16 is refused on a GPU without it; on a CPU, whether it has native bf16 kernels."""
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("this GPU has no native bf16 (needs compute capability >= 8.0): use dtype=torch.float16")
    if dev.type != "cpu":
        return []
    native = _cpu_flag("_is_avx512_bf16_supported") or _cpu_flag("_is_amx_tile_supported")
    return [
        "bf16 on CPU: "
        + ("this CPU has AVX512-BF16/AMX, so oneDNN runs native bf16 convs and matmuls; "
           if native else "this CPU has no AVX512-BF16/AMX, so bf16 is emulated and likely slower than fp32; ")
        + "measure it with report() before keeping it"
    ]


def _cast_inputs(module: nn.Module, args: tuple[Any, ...], *, dtype: torch.dtype) -> tuple[Any, ...]:
    return tuple(_cast_floating(a, dtype) for a in args)


def _cast_outputs(module: nn.Module, args: Any, out: Any, *, dtype: torch.dtype) -> Any:
    return _cast_floating(out, dtype)


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_cast_floating(v, dtype) for v in x)
    if isinstance(x, list):
        return [_cast_floating(v, dtype) for v in x]
    if isinstance(x, dict):
        return {k: _cast_floating(v, dtype) for k, v in x.items()}
    return x


# -- the deploy steps ---------------------------------------------------------------------------


@deploy_step(
    "int8",
    summary="static int8 weights and activations, calibrated; int8:pt2e / int8:fx picks the backend (default "
            "auto: PT2E, else FX); :vnni / :no-vnni forces the int8 setting (default: chosen for this CPU)",
    args=("auto", "pt2e", "fx"),
    final=True,
    cpu_only=True,
    tolerance=INT8,
    targets=True,
    needs_calib=True,
    check_needs=lambda mode: _check_torchao(mode),
    order=40,
    ids=("I3",),
    earlier_name="int8_static",
    fn=quantize_static_int8,
    trades="int8 weights and activations (about 4x smaller, 2-4x faster on x86 CPUs) for a calibration pass and a small accuracy loss",
    needs="calibration batches from the real input distribution; a model torch.export (PT2E) or torch.fx (fallback) can trace; CPU",
    available=lambda d: (d.type == "cpu", "" if d.type == "cpu" else "x86 int8 kernels (inductor / fbgemm) run on CPU only"),
    measured_in="benchmarks/deploy.py",
)
def int8_step(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """The ``int8`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: :func:`quantize_static_int8`."""
    new, rep = quantize_static_int8(model, ctx.calib, ctx.example, backend=ctx.mode or "auto",
                                    reduce_range=None if ctx.for_vnni is None else not ctx.for_vnni)
    return new, ctx.result(backend=rep.backend, size_method=rep.size_method, details=report_details(rep),
                           notes=list(rep.notes), int8_setting=rep.int8_setting, coverage=rep.coverage)


@deploy_step(
    "int8-dynamic",
    summary="int8 Linear/LSTM/GRU weights (transformers' Conv1D too; a head tied to the embedding stays fp32), "
            "activations quantized per call (transformers, RNNs)",
    final=True,
    cpu_only=True,
    tolerance=Tolerance(max_rel_diff=0.1, min_top1=0.9),
    one_int8_setting="int8-dynamic has one setting: torch.ao's dynamic kernels always quantize activations "
                     "to 7 bits (exact with or without VNNI); use onnx-int8:dynamic:vnni",
    order=50,
    ids=("I3",),
    earlier_name="int8_dynamic",
    fn=quantize_dynamic_int8,
    trades="int8 weights (about 4x smaller Linear/LSTM layers) and faster matmuls for a small output error; activations are quantized per batch at run time",
    needs="a model with nn.Linear / LSTM / GRU layers, run on CPU (x86 fbgemm or ARM qnnpack kernels)",
    available=lambda d: (d.type == "cpu", "" if d.type == "cpu" else "torch.ao int8 kernels run on CPU only"),
    measured_in="benchmarks/deploy.py",
)
def int8_dynamic_step(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """The ``int8-dynamic`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: :func:`quantize_dynamic_int8`."""
    new, rep = quantize_dynamic_int8(model)
    return new, ctx.result(backend=rep.backend, details=report_details(rep), notes=list(rep.notes),
                           int8_setting=rep.int8_setting, coverage=rep.coverage)


@deploy_step(
    "fp16",
    summary="float16 weights and inputs (GPU; refused on CPU, where it is slower than fp32)",
    final=True,
    tolerance=Tolerance(max_rel_diff=1e-2),
    check_device=lambda dev: _check_fp16_device(dev),
    order=60,
    ids=("I3",),
    fn=cast_half,
    trades="half the weight memory and faster matmuls on a GPU for about 3 significant digits of output "
           "(fp16's range: large activations can overflow where bf16's do not)",
    needs="a GPU; fp16 on a CPU without AMX-FP16 is refused (slower than fp32 there)",
)
def fp16_step(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """The ``fp16`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: :func:`cast_half` to float16."""
    return _half_step(model, ctx, torch.float16)


@deploy_step(
    "bf16",
    summary="bfloat16 weights and inputs (GPU, or a CPU with AVX512-BF16/AMX)",
    final=True,
    tolerance=Tolerance(max_rel_diff=5e-2),
    check_device=lambda dev: _check_bf16_device(dev),
    order=70,
    ids=("I3",),
    earlier_name="half_precision_inference",
    fn=cast_half,
    trades="half the weight memory and faster matmuls where the hardware has native bf16 for about 3 significant "
           "digits of output",
    needs="a GPU with bf16 (compute capability 8.0+), or a CPU with AVX512-BF16/AMX",
)
def bf16_step(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """The ``bf16`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: :func:`cast_half` to bfloat16."""
    return _half_step(model, ctx, torch.bfloat16)


def _half_step(model: nn.Module, ctx: StepContext, dtype: torch.dtype) -> tuple[nn.Module, StepResult]:
    new, rep = cast_half(model, dtype, ctx.device)
    return new, ctx.result(backend=rep.backend, details=report_details(rep), notes=list(rep.notes),
                           coverage=rep.coverage)


def _check_torchao(mode: str) -> None:
    if mode == "pt2e" and _import_torchao_pt2e() is None:
        raise UserError(f"step 'int8:pt2e' needs torchao: {install_hint('deploy')}, or use int8:fx")


def _check_fp16_device(dev: torch.device) -> None:
    if dev.type == "cpu" and not _cpu_flag("_is_amx_fp16_supported"):
        raise UserError("fp16 on CPU is slower than fp32 (no native fp16 kernels without AMX-FP16): "
                        "use bf16 or int8, or run on cuda")


def _check_bf16_device(dev: torch.device) -> None:
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("this GPU has no native bf16 (needs compute capability >= 8.0): use fp16")


# -- helpers --------------------------------------------------------------------------------------


def _check_module(model: Any, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"{what} needs an nn.Module, got {type(model).__name__}")


def _check_cpu(model: nn.Module, what: str) -> None:
    dev = module_device(model)
    if dev.type != "cpu":
        raise UserError(f"{what} runs on CPU kernels, the model is on {dev}: move it with model.cpu() first")


def _count_quantized(model: nn.Module) -> dict[str, int]:
    """Quantized modules by class name (``torch.ao`` quantized / dynamic quantized layers)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        mod = type(m).__module__
        name = type(m).__name__
        if ".quantized" in mod and not name.endswith(("PackedParams", "PackedParameter")):
            counts[name] = counts.get(name, 0) + 1
    return counts


def _freezing(cpp_wrapper: bool = False) -> Any:
    """Inductor weight freezing (constant-folds the int8 weights and prepacks them for
    oneDNN), and optionally the C++ wrapper: patched in for the call and restored after,
    so the global config is unchanged."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=True, cpp_wrapper=cpp_wrapper)


def _is_compile_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith(("torch._inductor", "torch._dynamo"))


_TORCHAO_CACHE: list[Any] = []


def _import_torchao_pt2e() -> tuple[Callable[..., Any], Callable[..., Any], Any] | None:
    """torchao's PT2E entry points, imported lazily and quietly; ``None`` if not installed."""
    if _TORCHAO_CACHE:
        return _TORCHAO_CACHE[0]
    try:
        with quiet_torch():
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    except ImportError:
        return None
    _TORCHAO_CACHE.append((prepare_pt2e, convert_pt2e, xiq))
    return _TORCHAO_CACHE[0]
