"""What every deploy step reports: agreement with the original, size, and latency.

A compression or export step is only worth keeping if its outputs still agree with the
original model and it is measurably smaller or faster; this module measures the three
the same way for every step, so the numbers can be compared side by side. Latencies
are medians of synchronised, warmed-up calls, interleaved across the candidates
(:func:`torch_tricks.inspect.timing.compare`) so drift on a noisy machine hits all alike.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from torch_tricks.inspect.inputs import as_input_tuple
from torch_tricks.inspect.timing import compare
from torch_tricks.outputs import primary_output

__all__ = ["Agreement", "StepReport", "agreement", "model_size_bytes", "param_count", "compare_latency", "report"]


@dataclass
class Agreement:
    """How close a candidate's outputs are to the reference's on the same inputs."""

    max_abs_diff: float
    max_rel_diff: float  # max |a - b| / max |b|
    top1_agreement: float | None  # share of rows whose argmax matches (2-D outputs only)


@dataclass
class StepReport:
    """One candidate model against the reference."""

    name: str
    agreement: Agreement | None
    params: int
    size_bytes: int
    latency_s: dict[int, float] = field(default_factory=dict)  # batch size -> median seconds
    latency_iqr_s: dict[int, float] = field(default_factory=dict)
    speedup: dict[int, float] = field(default_factory=dict)  # batch size -> reference / candidate
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def agreement(reference: Callable[..., Any], candidate: Callable[..., Any], inputs: Any) -> Agreement:
    """Compare the outputs of two models (or callables) on ``inputs`` under ``inference_mode``."""
    args = as_input_tuple(inputs)
    with torch.inference_mode():
        ref = _first_tensor(reference(*args)).float()
        out = _first_tensor(candidate(*args)).float()
    if ref.shape != out.shape:
        raise ValueError(f"output shapes differ: reference {tuple(ref.shape)}, candidate {tuple(out.shape)}")
    diff = (out - ref).abs()
    scale = ref.abs().max().clamp_min(1e-12)
    top1 = None
    if ref.dim() == 2 and ref.shape[1] > 1:
        top1 = float((ref.argmax(1) == out.argmax(1)).float().mean())
    return Agreement(float(diff.max()), float(diff.max() / scale), top1)


def param_count(model: nn.Module) -> int:
    """Parameters, each shared tensor once; packed int8 weights of quantized modules included."""
    n = sum(p.numel() for p in model.parameters())
    if n == 0 or _has_packed_params(model):
        n = sum(t.numel() for t in _state_tensors(model))
    return n


def model_size_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``: what the weights cost on disk."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.getbuffer().nbytes


def compare_latency(
    models: Mapping[str, Callable[..., Any]],
    inputs: Any,
    *,
    warmup: int = 3,
    repeats: int = 10,
) -> dict[str, Any]:
    """Median latency of each model on ``inputs``, interleaved (one :class:`Timing` each)."""
    args = as_input_tuple(inputs)

    def runner(m: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode():
                return m(*args)

        return run

    return compare({k: runner(m) for k, m in models.items()}, warmup=warmup, repeats=repeats)


def report(
    reference: nn.Module,
    candidates: Mapping[str, Callable[..., Any]],
    inputs_by_batch: Mapping[int, Any],
    *,
    agreement_inputs: Any | None = None,
    warmup: int = 3,
    repeats: int = 10,
    sizes: Mapping[str, int] | None = None,
) -> dict[str, StepReport]:
    """Reports for the reference (named ``"reference"``) and every candidate.

    ``inputs_by_batch`` maps a batch size to inputs of that batch (e.g. ``{1: x1, 32: x32}``);
    ``agreement_inputs`` (default: the largest batch) feed the output comparison;
    ``sizes`` overrides the on-disk size of candidates that are not modules (an ONNX file).
    """
    models: dict[str, Callable[..., Any]] = {"reference": reference, **candidates}
    agree_on = agreement_inputs if agreement_inputs is not None else inputs_by_batch[max(inputs_by_batch)]
    out = {name: _unmeasured(name, m, reference, agree_on, sizes or {}) for name, m in models.items()}
    for batch, inputs in inputs_by_batch.items():
        timings = compare_latency(models, inputs, warmup=warmup, repeats=repeats)
        _record_latency(out, timings, batch)
    return out


def _unmeasured(name: str, m: Callable[..., Any], reference: nn.Module, agree_on: Any,
                sizes: Mapping[str, int]) -> StepReport:
    """The report of one model before timing: its agreement with the reference, parameters and size."""
    is_module = isinstance(m, nn.Module)
    return StepReport(
        name=name,
        agreement=None if name == "reference" else agreement(reference, m, agree_on),
        params=param_count(m) if is_module else 0,
        size_bytes=sizes.get(name, model_size_bytes(m) if is_module else 0),
    )


def _record_latency(out: dict[str, StepReport], timings: Mapping[str, Any], batch: int) -> None:
    """Each model's median, spread and speed-up over the reference at ``batch``."""
    base = timings["reference"].median_s
    for name, t in timings.items():
        out[name].latency_s[batch] = t.median_s
        out[name].latency_iqr_s[batch] = t.iqr_s
        out[name].speedup[batch] = base / t.median_s if t.median_s > 0 else float("inf")


def _first_tensor(out: Any) -> torch.Tensor:
    """The output compared: :func:`torch_tricks.outputs.primary_output` (a ModelOutput's or dict's
    logits, else the first floating-point tensor), with ONNX Runtime's numpy arrays as tensors."""
    def tensor(o: Any) -> Any:
        return torch.as_tensor(o) if hasattr(o, "__array__") and not isinstance(o, torch.Tensor) else o

    return primary_output([tensor(o) for o in out] if isinstance(out, (list, tuple)) else tensor(out))


def _has_packed_params(model: nn.Module) -> bool:
    return any("packed_params" in k or "_packed" in k for k in model.state_dict())


def _state_tensors(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for v in model.state_dict().values():
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, tuple):  # packed (weight, bias) of quantized linear layers
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out
