"""The one convention of model inputs: a dict is keyword arguments (``model(**inputs)``), a tuple or
list positional ones, anything else (a tensor) the one positional argument.

At the top level because :mod:`torch_tricks.batches`, which every training loop of the package
imports, takes a batch apart by it: kept in :mod:`torch_tricks.inspect.inputs` (which re-exports
all of it), it made the lowest floor import a higher one that imports it back.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from torch_tricks.errors import UserError

__all__ = ["split_inputs", "normalize_inputs", "as_input_tuple", "token_input_as_keyword", "is_causal_lm",
           "forward_params"]


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of model inputs (see the module doc for the convention)."""
    inputs = normalize_inputs(inputs)
    return ((), inputs) if isinstance(inputs, dict) else (inputs, {})


def normalize_inputs(inputs: Any) -> tuple[Any, ...] | dict[str, Any]:
    """``inputs`` in one of the two forms a call takes: a dict (keyword arguments) or a tuple
    (positional arguments; a lone tensor becomes a 1-tuple)."""
    if isinstance(inputs, Mapping):
        return dict(inputs)
    return as_input_tuple(inputs)


def as_input_tuple(inputs: Any) -> tuple[Any, ...]:
    """Normalise what a caller passes as *positional* model inputs to an args tuple.

    A dict means keyword arguments, which a tuple cannot carry: that is a UserError here
    (use :func:`split_inputs` where keyword inputs are welcome) rather than a silent
    1-tuple holding the dict.
    """
    if isinstance(inputs, Mapping):
        names = ", ".join(map(str, inputs)) or "none"
        raise UserError(f"keyword inputs ({names}) given where only positional inputs work: pass a tuple of "
                        "tensors (on the command line, --input SPEC without NAME=)")
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):  # a namedtuple is one input
        return inputs
    if isinstance(inputs, list):
        return tuple(inputs)
    return (inputs,)


def token_input_as_keyword(model: Any, inputs: Any) -> Any:
    """A causal LM's one positional token input as ``{"input_ids": ids}``; any other inputs as they are.

    Why: a causal LM trains with its own loss of ``model(input_ids=..., labels=...)``
    (shifted, ``-100`` ignored, and chunkable by ``chunked_lm_loss``); positional
    ``--input long:32:50257`` means the same ids, so it must not train differently.
    """
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    if isinstance(inputs, Mapping) or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return inputs
    ids = args[0]
    if ids.is_floating_point() or ids.dtype == torch.bool or not is_causal_lm(model):
        return inputs
    params = forward_params(getattr(model, "forward", model)) or []
    return {"input_ids": ids} if params and params[0].name == "input_ids" else inputs


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a transformers causal language model (``AutoModelForCausalLM``'s classes)."""
    if not type(model).__module__.startswith("transformers."):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def forward_params(forward: Any) -> list[inspect.Parameter] | None:
    """The forward's parameters; None where it has no Python signature."""
    try:
        try:
            return list(inspect.signature(forward, eval_str=True).parameters.values())
        except Exception:  # an annotation that does not evaluate here
            return list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
