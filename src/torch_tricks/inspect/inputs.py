"""Example inputs from short specs such as ``3x224x224``, ``long:128:1000`` or ``attention_mask=ones:128``.

Grammar (one input; several are separated by commas or given as a list)::

    [NAME=][DTYPE:]D1xD2...[:HIGH]
    [NAME=]ones:D1xD2...        [NAME=]zeros:D1xD2...

``DTYPE`` is a torch dtype name (``float32`` by default; ``long``/``int64``/``int`` and
the other integer types give token-like ids). ``HIGH`` bounds integer values to
``[0, HIGH)`` (default: the model's ``vocab_size`` attribute, else 2). ``ones`` and
``zeros`` are int64 tensors of ones or zeros (attention masks, token type ids). The batch
dimension is *not* part of the spec: it is prepended from ``batch``.

``NAME=`` makes the input a keyword argument of the forward (``input_ids=long:128:50257``):
either every spec of a command is named or none is. The convention everywhere in
torch-tricks: model inputs that are a dict are keyword arguments (``model(**inputs)``), a
tuple or list positional ones, anything else (a tensor) the one positional argument;
:func:`call_model` is that convention.
"""

from __future__ import annotations

import difflib
import inspect
import keyword
import re
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from torch_tricks._inputs import (  # the convention lives at the top level, which batches reads it from
    as_input_tuple,
    forward_params,
    is_causal_lm,
    normalize_inputs,
    split_inputs,
    token_input_as_keyword,
)
from torch_tricks.errors import UserError

__all__ = [
    "InputSpec", "parse_input_specs", "make_inputs", "describe_inputs", "as_input_tuple", "normalize_inputs",
    "split_inputs", "input_tensors", "call_model", "check_input_names", "is_causal_lm", "token_input_as_keyword",
    "keyword_as_positional",
]

_DTYPES = {
    "float": torch.float32, "float32": torch.float32, "fp32": torch.float32,
    "half": torch.float16, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64,
    "double": torch.float64, "long": torch.int64, "int64": torch.int64, "int": torch.int64,
    "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_FILLS = {"ones": 1, "zeros": 0}
_DIMS = re.compile(r"^\d+(x\d+)*$")
_GRAMMAR = "expected [NAME=][dtype:]D1xD2...[:high] or [NAME=]ones|zeros:D1xD2..., e.g. 3x224x224, long:128:1000 " \
           "or attention_mask=ones:128"


@dataclass(frozen=True)
class InputSpec:
    """One model input, batch dimension excluded; ``name`` makes it a keyword argument."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None  # exclusive upper bound for integer inputs
    name: str | None = None  # keyword argument of the forward; None: positional
    fill: int | None = None  # 1 / 0: every value is this (``ones`` / ``zeros``, int64)

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape))
        prefix = f"{self.name}=" if self.name else ""
        if self.fill is not None:
            return f"{prefix}{'ones' if self.fill else 'zeros'}:{dims}"
        if self.dtype == torch.float32:
            return prefix + dims
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{prefix}{dtype}:{dims}" + (f":{self.high}" if self.high is not None else "")


def parse_input_specs(text: str | Sequence[str]) -> list[InputSpec]:
    """Parse one spec string (comma-separated for several inputs) or a list of them."""
    parts = _split_specs(text)
    if not parts:
        raise UserError("empty --input: give a shape such as 3x224x224 (batch excluded)")
    specs = [_parse_one(p) for p in parts]
    _check_spec_names(parts, specs)
    return specs


def _split_specs(text: str | Sequence[str]) -> list[str]:
    parts: list[str] = []
    for item in [text] if isinstance(text, str) else list(text):
        parts.extend(p.strip() for p in item.split(",") if p.strip())
    return parts


def _check_spec_names(parts: list[str], specs: list[InputSpec]) -> None:
    """Every spec named or none, and no name twice."""
    named = [s.name for s in specs if s.name]
    if named and len(named) != len(specs):
        first = next(p for p, s in zip(parts, specs) if not s.name)
        raise UserError(f"input {first!r} has no name while others do: name every input (NAME=SPEC, "
                        "keyword arguments of the forward) or none (positional)")
    twice = _duplicates(named)
    if twice:
        raise UserError(f"input name {twice[0]!r} is given twice: give each keyword input once")


def _duplicates(names: list[str]) -> list[str]:
    """The names given more than once, sorted."""
    return sorted({n for n in names if names.count(n) > 1})


def _parse_one(part: str) -> InputSpec:
    name, body = _split_name(part)
    fields = body.split(":")
    if fields[0].lower() in _FILLS:
        return _parse_fill(fields, part, name)
    dtype = torch.float32
    if fields[0].lower() in _DTYPES:
        dtype = _DTYPES[fields.pop(0).lower()]
    if not fields or not _DIMS.match(fields[0]):
        raise UserError(f"bad input spec {part!r}: {_GRAMMAR}")
    shape = _shape(fields[0], part)
    return InputSpec(shape, dtype, _parse_high(fields[1:], part, dtype), name)


def _split_name(part: str) -> tuple[str | None, str]:
    """``NAME=SPEC`` -> (NAME, SPEC); a spec without ``=`` has no name."""
    name, eq, body = part.partition("=")
    if not eq:
        return None, part
    name = name.strip()
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UserError(f"bad input name {name!r} in {part!r}: NAME=SPEC needs a Python identifier, "
                        "the forward's argument name (e.g. input_ids=long:128:50257)")
    return name, body.strip()


def _parse_fill(fields: list[str], part: str, name: str | None) -> InputSpec:
    fill = fields[0].lower()
    if len(fields) != 2 or not _DIMS.match(fields[1]):
        raise UserError(f"bad input spec {part!r}: {fill} takes the shape only, e.g. {fill}:128")
    return InputSpec(_shape(fields[1], part), torch.int64, None, name, _FILLS[fill])


def _parse_high(rest: list[str], part: str, dtype: torch.dtype) -> int | None:
    """The optional ``:HIGH`` bound, ``rest`` being the fields after the shape."""
    if len(rest) > 1:
        raise UserError(f"bad input spec {part!r}: too many ':' fields")
    if not rest:
        return None
    if not rest[0].isdigit() or int(rest[0]) < 1:
        raise UserError(f"bad input spec {part!r}: the bound after the shape must be a positive integer")
    if dtype.is_floating_point:
        raise UserError(f"bad input spec {part!r}: a value bound only applies to integer inputs")
    return int(rest[0])


def _shape(dims: str, part: str) -> tuple[int, ...]:
    shape = tuple(int(d) for d in dims.split("x"))
    if any(d == 0 for d in shape):
        raise UserError(f"bad input spec {part!r}: dimensions must be positive")
    return shape


def make_inputs(
    specs: Sequence[InputSpec] | str,
    batch: int = 1,
    *,
    model: torch.nn.Module | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """Random tensors for ``specs`` with ``batch`` prepended, reproducible from ``seed``:
    a dict ``{name: tensor}`` (keyword inputs) when the specs are named, else a tuple."""
    if isinstance(specs, str):
        specs = parse_input_specs(specs)
    if batch < 1:
        raise UserError(f"--batch must be >= 1, got {batch}")
    gen = torch.Generator().manual_seed(seed)
    out = [_random_tensor(spec, batch, gen, model).to(device) for spec in specs]
    if specs and specs[0].name:
        return {s.name: t for s, t in zip(specs, out)}
    return tuple(out)


def _random_tensor(spec: InputSpec, batch: int, gen: torch.Generator, model: Any) -> torch.Tensor:
    shape = (batch, *spec.shape)
    if spec.fill is not None:
        return torch.full(shape, spec.fill, dtype=torch.int64)
    if spec.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(spec.dtype)
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    high = spec.high or int(getattr(model, "vocab_size", 0) or 2)
    return torch.randint(0, high, shape, generator=gen, dtype=torch.int64).to(spec.dtype)


# -- inputs as the forward takes them ------------------------------------------------------------

def call_model(model: Any, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple or list, else ``model(inputs)``."""
    args, kwargs = split_inputs(inputs)
    return model(*args, **kwargs)


def input_tensors(inputs: Any) -> list[torch.Tensor]:
    """The top-level input tensors, positional then keyword (for shapes, bytes and devices)."""
    args, kwargs = split_inputs(inputs)
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def describe_inputs(inputs: Sequence[Any] | Mapping[str, Any]) -> str:
    """Short human form of concrete inputs, e.g. ``(1, 3, 224, 224) float32`` or, for
    keyword inputs, ``input_ids=(1, 32) int64, attention_mask=(1, 32) int64``."""
    if isinstance(inputs, Mapping):
        return ", ".join(f"{k}={_describe_one(v)}" for k, v in inputs.items())
    return ", ".join(_describe_one(t) for t in inputs)


def _describe_one(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return type(t).__name__


# -- input names against the forward -------------------------------------------------------------

def check_input_names(model: Any, names: Iterable[str]) -> None:
    """A UserError for a keyword input the model's forward does not take.

    The forward's own parameters are accepted; a ``**kwargs`` takes every name, except
    where its names are declared: ``**kwargs: Unpack[SomeTypedDict]`` takes that TypedDict's
    keys, and a transformers model's ``**kwargs`` (typed or not) are its
    ``TransformersKwargs`` (``output_attentions``...), which the model passes down and
    ignores when unknown, so a misspelt ``attention_mak`` would be dropped silently.
    """
    params = forward_params(getattr(model, "forward", model))
    if params is None:
        return  # a builtin or C++ forward: nothing to check against
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    extra = _var_keyword_names(params, model)
    if extra is None:
        return
    unknown = next((name for name in names if name not in takes and name not in extra), None)
    if unknown is not None:
        raise _unknown_input_error(model, unknown, takes, extra)


def _unknown_input_error(model: Any, name: str, takes: list[str], extra: list[str]) -> UserError:
    close = difflib.get_close_matches(name, takes + extra, n=1)
    shown = ", ".join(takes[:12]) + (", ..." if len(takes) > 12 else "")
    return UserError(f"model {type(model).__name__}'s forward takes no input named {name!r}: "
                     + (f"did you mean {close[0]!r}? " if close else "")
                     + f"it takes {shown or 'no keyword inputs'}")


def _var_keyword_names(params: list[inspect.Parameter], model: Any) -> list[str] | None:
    """Names taken through the forward's ``**kwargs``: none without one; None: any name."""
    var_kw = next((p for p in params if p.kind == p.VAR_KEYWORD), None)
    if var_kw is None:
        return []
    return _declared_kwargs(var_kw.annotation, model)


def _declared_kwargs(annotation: Any, model: Any) -> list[str] | None:
    """Names a ``**kwargs`` is declared to take (see :func:`check_input_names`); None: any."""
    if typing.get_origin(annotation) is typing.Unpack:
        (td,) = typing.get_args(annotation) or (None,)
        keys = getattr(td, "__annotations__", None)
        if isinstance(keys, dict):
            return list(keys)
    if type(model).__module__.startswith("transformers."):
        try:
            from transformers.utils.generic import TransformersKwargs
        except ImportError:
            return None
        return list(getattr(TransformersKwargs, "__annotations__", {}))
    return None


# -- keyword inputs where only positional ones work ---------------------------------------------------

def keyword_as_positional(model: Any, inputs: Mapping[str, Any], what: str) -> tuple[Any, ...]:
    """Keyword inputs as the positional arguments they bind to, for code that calls ``model(*args)``.

    The names must be the forward's first parameters in some order, none left between
    them (``input_ids, attention_mask`` for BERT): then ``model(*args)`` is exactly
    ``model(**inputs)``. Otherwise a UserError naming ``what`` and the parameter in the way.
    """
    if not inputs:
        return ()
    params = [p for p in (forward_params(getattr(model, "forward", model)) or [])
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params]
    unknown = next((n for n in inputs if n not in names), None)
    if unknown is not None:
        raise UserError(f"{what} calls the model with positional inputs, and {type(model).__name__}'s forward has "
                        f"no positional argument {unknown!r}: give the inputs it takes first, in order "
                        f"({', '.join(names[:4]) or 'none'})")
    last = max(names.index(n) for n in inputs)
    gap = [n for n in names[: last + 1] if n not in inputs]
    if gap:
        raise UserError(f"{what} calls the model with positional inputs, and {type(model).__name__}'s forward "
                        f"takes {gap[0]!r} before {names[last]!r}, so {names[last]} cannot go by position: leave it "
                        f"out (its default), or name the inputs up to it ({', '.join(names[: last + 1])})")
    return tuple(inputs[n] for n in names[: last + 1])
