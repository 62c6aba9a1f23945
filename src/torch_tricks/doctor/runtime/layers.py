"""What single layers of the recorded forward cost: BatchNorm normalising over a per-device batch
too small for stable statistics (TT204), activations that could run inplace and save a tensor
(TT205), and Linear / conv / RNN dims that are not multiples of 8, which tensor cores want in
fp16/bf16 (TT206; the dims the data fixes are not the author's to change and are left out)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import BN_SMALL_BATCH, DIMS, INPLACE, MIN_BN_BATCH
from torch_tricks.doctor.runtime.recorder import _Call, _Recorder
from torch_tricks.doctor.runtime.util import _count, _finding, _short, _tensors
from torch_tricks.errors import one_line
from torch_tricks.train.memory import INPLACE_ACTIVATIONS, inplace_activations


def _small_batch_findings(bn_batch: dict[str, int]) -> list[Finding]:
    """TT204: one finding per batch size below MIN_BN_BATCH, naming the BatchNorm layers that saw it."""
    by_batch: dict[int, list[str]] = {}
    for name, n in bn_batch.items():
        if n < MIN_BN_BATCH:
            by_batch.setdefault(n, []).append(name)
    return [_finding(
        BN_SMALL_BATCH, names[0],
        f"{_count(names, 'BatchNorm layer')} {'normalise' if len(names) > 1 else 'normalises'} "
        f"over a per-device batch of {n} in training ({_short(names)}): statistics from fewer than "
        f"{MIN_BN_BATCH} samples are noisy; use a larger batch, SyncBatchNorm or GroupNorm",
        modules=names, batch=n,
    ) for n, names in sorted(by_batch.items())]


def _inplace_candidates(model: nn.Module, called: set[str], skipped: dict[str, str]) -> list[Finding]:
    """TT205: activations of ``model`` that ran (are in ``called``) and that the T9 trick would make
    inplace (judged safe); when the model cannot be analysed, ``skipped`` says why."""
    not_inplace = _not_inplace(model)
    if not not_inplace:
        return []
    ran = not_inplace & called
    try:
        inplace_activations(model)
    except Exception as exc:
        skipped["activation-could-be-inplace"] = f"the model could not be analysed: {one_line(exc)}"
        return []
    return [_finding(
        INPLACE, name,
        f"'{name}' ({type(m).__name__}) could run inplace: its input is a fresh tensor nothing else reads; "
        "set inplace=True",
    ) for name, m in model.named_modules() if name in ran and m.inplace]


_MATMUL_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.RNNBase)


def _dim_findings(rec: _Recorder, out: Any) -> list[Finding]:
    """Linear / conv / RNN dims that are not multiples of 8 (TT206), data-fixed dims excepted."""
    layer_calls = [c for c in rec.calls if isinstance(c.module, _MATMUL_LAYERS)]
    if not layer_calls:
        return []
    first_layer, heads = _data_fixed_layers(layer_calls, out)
    findings = []
    for c in _first_call_of_each(layer_calls):
        bad = _not_multiples_of_8(_free_dims(_tensor_core_dims(c.module), c.name in first_layer, c.name in heads))
        if bad:
            findings.append(_dim_finding(c, bad))
    return findings


# -- helpers ---------------------------------------------------------------------------------

def _not_inplace(model: nn.Module) -> set[str]:
    """The activations of ``model`` that have an ``inplace`` switch, off."""
    return {n for n, m in model.named_modules()
            if isinstance(m, INPLACE_ACTIVATIONS) and hasattr(m, "inplace") and not m.inplace}


def _not_multiples_of_8(dims: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(k, v) for k, v in dims if v % 8]


def _first_call_of_each(calls: list[_Call]) -> list[_Call]:
    """The first call of each module (a module called several times is judged once)."""
    first: dict[str, _Call] = {}
    for c in calls:
        first.setdefault(c.name, c)
    return list(first.values())


def _dim_finding(c: _Call, bad: list[tuple[str, int]]) -> Finding:
    return _finding(
        DIMS, c.name,
        f"'{c.name}' ({type(c.module).__name__}): {', '.join(f'{k}={v}' for k, v in bad)} "
        f"{'is not a multiple' if len(bad) == 1 else 'are not multiples'} of 8 "
        "(tensor cores want multiples of 8 in fp16/bf16)",
        dims=dict(bad),
    )


def _data_fixed_layers(layer_calls: list, out: Any) -> tuple[set[str], set[str]]:
    """The names of the layers whose input the data fixes (fed the model's input) and of those
    whose output it fixes (the last layer, and any whose output the model returns)."""
    outs = {id(t) for t in _tensors(out)}
    heads = {layer_calls[-1].name} | {c.name for c in layer_calls if _returns_any(c, outs)}
    return {c.name for c in layer_calls if c.takes_model_input}, heads


def _returns_any(call: _Call, ids: set[int]) -> bool:
    """One of the outputs of ``call`` is among the tensors ``ids``."""
    return any(id(t) in ids for t in call.outputs)


def _free_dims(dims: list[tuple[str, int]], takes_input: bool, gives_output: bool) -> list[tuple[str, int]]:
    """The dims the model's author chose: not the input size of a layer fed the model's input, nor
    the output size of a head (the data fixes those)."""
    if takes_input:
        dims = [d for d in dims if not d[0].startswith(("in_", "input_"))]
    if gives_output:
        dims = [d for d in dims if not d[0].startswith("out_")]
    return dims


def _tensor_core_dims(m: nn.Module) -> list[tuple[str, int]]:
    """(name, size) of the dimensions of a layer's matrix multiply: none for a depthwise conv, and
    not a conv's image-like input channels (RGB, RGBA, grey)."""
    if isinstance(m, nn.Linear):
        return [("in_features", m.in_features), ("out_features", m.out_features)]
    if isinstance(m, nn.modules.conv._ConvNd):
        return _conv_dims(m)
    if isinstance(m, nn.RNNBase):
        return [("input_size", m.input_size), ("hidden_size", m.hidden_size)]
    return []


def _conv_dims(m: nn.modules.conv._ConvNd) -> list[tuple[str, int]]:
    if m.groups > 1 and m.groups == m.in_channels:
        return []  # depthwise: no matrix multiply to feed tensor cores
    per = " per group" if m.groups > 1 else ""
    dims = [(f"in_channels{per}", m.in_channels // m.groups),
            (f"out_channels{per}", m.out_channels // m.groups)]
    return dims[1:] if dims[0][1] <= 4 else dims  # image-like input channels (RGB, RGBA, grey)
