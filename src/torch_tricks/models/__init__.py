"""Built-in reference models, written with plain ``torch.nn`` (no torchvision).

Each model is a small factory registered with :func:`register_model`, together with
the input it expects (``default_input``, in the CLI's input syntax, batch excluded),
so the inspector, the tuner and the tests can run any of them without being told
its shape. A user's own model is named ``package.module:factory`` instead, and a
transformers model ``hf:TYPE[:HEAD]`` or ``path/to/config.json[:HEAD]`` (see
:mod:`torch_tricks.models.hf`; needs the ``hf`` extra).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.models.registry import _REGISTRY, ModelSpec, register_model

__all__ = [
    "ModelSpec",
    "register_model",
    "list_models",
    "get_model",
    "model_spec",
    "load_model",
]


def list_models(tag: str | None = None) -> list[str]:
    """Names of the built-in models, sorted; only those carrying ``tag`` if given."""
    return sorted(n for n, s in _REGISTRY.items() if tag is None or tag in s.tags)


def model_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; a :class:`UserError` naming the choices if unknown."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(
            f"unknown model {name!r}: choose one of {', '.join(list_models())}, "
            "or name your own as package.module:factory"
        ) from None


def get_model(name: str, **kwargs: Any) -> nn.Module:
    """Build the built-in model ``name`` with the factory's keyword arguments."""
    return model_spec(name).factory(**kwargs)


def load_model(ref: str, *, hf_config: Any = None, **kwargs: Any) -> tuple[nn.Module, str | None]:
    """Build a model from a built-in name, a ``package.module:factory`` reference, or a
    transformers model (``hf:gpt2``, ``hf:bert:classification``, ``path/to/config.json``).

    Returns the model and its default input spec (``None`` for a user factory, unless
    the factory carries a ``default_input`` attribute). ``hf_config`` (a dict, or
    ``"n_layer=2,n_embd=64"``) overrides fields of a transformers model's config.
    """
    from torch_tricks.models import hf

    if ref not in _REGISTRY and hf.is_hf_ref(ref):
        if kwargs:
            raise UserError(f"--model {ref}: a transformers model takes hf_config, not {', '.join(kwargs)}")
        return hf.build(ref, hf_config)
    if hf_config:
        raise UserError(f"--hf-config applies only to transformers models (hf:TYPE or config.json), not {ref!r}")
    if ":" not in ref:
        spec = model_spec(ref)
        return spec.factory(**kwargs), spec.default_input
    return _load_reference(ref, kwargs)


def _load_reference(ref: str, kwargs: dict[str, Any]) -> tuple[nn.Module, str | None]:
    """A ``package.module:factory`` reference: the module imported, the factory (or module) found and called."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UserError(f"model reference {ref!r} must look like package.module:factory")
    factory = _import_user_module(module_name, ref)
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise UserError(f"module {module_name!r} has no attribute {attr!r} (from --model {ref})")
    model = _call_factory(factory, ref, kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(f"factory {ref} returned {type(model).__name__}, not an nn.Module")
    return model, getattr(factory, "default_input", None)


def _import_user_module(module_name: str, ref: str) -> Any:
    if os.getcwd() not in sys.path and "" not in sys.path:
        # as `python -m` would: the console script's sys.path has its own folder, not the user's
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's to fix
        raise UserError(
            f"cannot import {module_name!r} for --model {ref}: {type(exc).__name__}: {exc} "
            "(is it on PYTHONPATH, or run from its folder?)"
        ) from None


def _call_factory(factory: Any, ref: str, kwargs: dict[str, Any]) -> Any:
    """An ``nn.Module`` as it is, a callable called with ``kwargs``."""
    if isinstance(factory, nn.Module):
        return factory
    if not callable(factory):
        raise UserError(f"{ref} is neither a callable factory nor an nn.Module")
    try:
        return factory(**kwargs)
    except Exception as exc:
        raise UserError(f"factory {ref} raised {type(exc).__name__}: {exc}") from None


# Importing the model modules registers them.
from torch_tricks.models import (  # noqa: E402,F401
    lstm,
    mlp,
    mobilenet,
    repvgg,
    resnet,
    resnet_cifar,
    small_cnn,
    transformer,
)
