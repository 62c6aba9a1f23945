"""Example inputs from short specs such as ``3x224x224`` or ``long:128:1000``.

Grammar (one input; several are separated by commas or given as a list)::

    [DTYPE:]D1xD2x...[:HIGH]

``DTYPE`` is a torch dtype name (``float32`` by default; ``long``/``int64``/``int`` and
the other integer types give token-like ids). ``HIGH`` bounds integer values to
``[0, HIGH)`` (default: the model's ``vocab_size`` attribute, else 2). The batch
dimension is *not* part of the spec: it is prepended from ``batch``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from torch_tricks.errors import UserError

__all__ = ["InputSpec", "parse_input_specs", "make_inputs", "describe_inputs", "as_input_tuple"]

_DTYPES = {
    "float": torch.float32, "float32": torch.float32, "fp32": torch.float32,
    "half": torch.float16, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64,
    "double": torch.float64, "long": torch.int64, "int64": torch.int64, "int": torch.int64,
    "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_DIMS = re.compile(r"^\d+(x\d+)*$")


@dataclass(frozen=True)
class InputSpec:
    """One model input, batch dimension excluded."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None  # exclusive upper bound for integer inputs

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        if self.dtype == torch.float32:
            return dims
        name = str(self.dtype).removeprefix("torch.")
        return f"{name}:{dims}" + (f":{self.high}" if self.high is not None else "")


def parse_input_specs(text: str | Sequence[str]) -> list[InputSpec]:
    """Parse one spec string (comma-separated for several inputs) or a list of them."""
    parts: list[str] = []
    for item in [text] if isinstance(text, str) else list(text):
        parts.extend(p.strip() for p in item.split(",") if p.strip())
    if not parts:
        raise UserError("empty --input: give a shape such as 3x224x224 (batch excluded)")
    return [_parse_one(p) for p in parts]


def _parse_one(part: str) -> InputSpec:
    fields = part.split(":")
    dtype = torch.float32
    if fields[0].lower() in _DTYPES:
        dtype = _DTYPES[fields.pop(0).lower()]
    if not fields or not _DIMS.match(fields[0]):
        raise UserError(
            f"bad input spec {part!r}: expected [dtype:]D1xD2...[:high], e.g. 3x224x224 or long:128:1000"
        )
    shape = tuple(int(d) for d in fields[0].split("x"))
    if any(d == 0 for d in shape):
        raise UserError(f"bad input spec {part!r}: dimensions must be positive")
    high = None
    if len(fields) == 2:
        if not fields[1].isdigit() or int(fields[1]) < 1:
            raise UserError(f"bad input spec {part!r}: the bound after the shape must be a positive integer")
        if dtype.is_floating_point:
            raise UserError(f"bad input spec {part!r}: a value bound only applies to integer inputs")
        high = int(fields[1])
    elif len(fields) > 2:
        raise UserError(f"bad input spec {part!r}: too many ':' fields")
    return InputSpec(shape, dtype, high)


def make_inputs(
    specs: Sequence[InputSpec] | str,
    batch: int = 1,
    *,
    model: torch.nn.Module | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random tensors for ``specs`` with ``batch`` prepended, reproducible from ``seed``."""
    if isinstance(specs, str):
        specs = parse_input_specs(specs)
    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        shape = (batch, *spec.shape)
        if spec.dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(spec.dtype)
        elif spec.dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            high = spec.high or int(getattr(model, "vocab_size", 0) or 2)
            t = torch.randint(0, high, shape, generator=gen, dtype=torch.int64).to(spec.dtype)
        out.append(t.to(device))
    return tuple(out)


def as_input_tuple(inputs: Any) -> tuple[Any, ...]:
    """Normalise what a caller passes as model inputs to a positional-args tuple."""
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):  # a namedtuple is one input
        return inputs
    if isinstance(inputs, list):
        return tuple(inputs)
    return (inputs,)


def describe_inputs(inputs: Sequence[Any]) -> str:
    """Short human form of concrete inputs, e.g. ``(1, 3, 224, 224) float32``."""
    parts = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            parts.append(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        else:
            parts.append(type(t).__name__)
    return ", ".join(parts)
