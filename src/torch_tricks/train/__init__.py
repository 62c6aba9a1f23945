"""Training: one loop (:func:`fit`) where every trick is a switch, and the tricks themselves.

Each trick module can be used alone on a plain model / optimizer. The names below are
imported on first use (PEP 562 ``__getattr__``), so that ``torch_tricks.train.config``
(the CLI's flags, a static ``doctor`` lint) does not import torch; :func:`register_all`
imports every module that registers a trick (the registry calls it).
"""

from __future__ import annotations

import importlib
from typing import Any

# the modules whose import registers their tricks with torch_tricks.registry
TRICK_MODULES = ("attention", "checkpoint", "compile_modes", "distributed", "ema", "float8", "in_backward", "liger",
                 "lm_loss", "loop", "matmul_mode", "memory", "offload", "optim", "optim_state", "precision", "schedule",
                 "sharding", "speed", "syncbn")

_EXPORTS = {
    "fit": "loop", "History": "loop", "TrainingDiverged": "tricks", "Tricks": "tricks",
    "TrainConfig": "config", "load_config": "config",
}

__all__ = ["fit", "History", "TrainConfig", "TrainingDiverged", "Tricks", "load_config", "register_all"]


def register_all() -> None:
    """Import every module that registers a trick (idempotent)."""
    importlib.import_module("torch_tricks.seed")  # seeding is shared with data and tune: it lives a floor below
    for name in TRICK_MODULES:
        importlib.import_module(f"{__name__}.{name}")


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
