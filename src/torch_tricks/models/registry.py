"""The built-in models' registry: a name, its factory and the input it expects.

Apart from the package ``__init__`` so that each model module registers itself without
importing the package that imports it (no import circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

__all__ = ["ModelSpec", "register_model"]


@dataclass(frozen=True)
class ModelSpec:
    """What the registry knows about a built-in model."""

    name: str
    factory: Callable[..., nn.Module]
    default_input: str
    description: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(
    name: str, *, default_input: str, description: str = "", tags: tuple[str, ...] = ()
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator: register ``factory`` under ``name`` (once; a second name clash is a bug)."""

    def deco(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = ModelSpec(name, factory, default_input, description, tuple(tags))
        return factory

    return deco
