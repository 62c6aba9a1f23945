"""torch-tricks: measure which PyTorch speed and memory tricks help your model, then apply them.

One import gives the verbs::

    import torch, torch_tricks as tt
    model = tt.get_model("resnet18")
    tt.summary(model, torch.randn(1, 3, 64, 64)).totals["macs"]

They are imported on first use (PEP 562 ``__getattr__``), so ``import torch_tricks``
stays as cheap as importing :mod:`torch_tricks.errors`: torch itself is loaded only
when a verb is first touched. No submodule is named like a verb it would shadow
(``torch_tricks.tuning`` holds :func:`tune`, ``torch_tricks.inspect.summarize``
holds :func:`summary`), so ``tt.tune`` stays the function after any import.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from torch_tricks.errors import UserError  # noqa: E402

# public name -> module that defines it
_EXPORTS = {
    # inspect: what the model costs
    "summary": "torch_tricks.inspect.summarize",
    "memory_report": "torch_tricks.inspect.memory",
    "leak_check": "torch_tricks.inspect.memory",
    "benchmark": "torch_tricks.inspect.timing",
    "profile_step": "torch_tricks.inspect.profile",
    # train: one loop, every trick a switch
    "fit": "torch_tricks.train.loop",
    "Tricks": "torch_tricks.train.tricks",
    "TrainConfig": "torch_tricks.train.config",
    "load_config": "torch_tricks.train.config",
    "seed_everything": "torch_tricks.seed",
    # tune: which tricks help here
    "tune": "torch_tricks.tuning.tuner",
    "TuneReport": "torch_tricks.tuning.report",
    # deploy: fuse, quantize, export ... verified
    "optimize": "torch_tricks.deploy.pipeline",
    # doctor: pitfalls in code and in a running model
    "lint_paths": "torch_tricks.doctor.static",
    "lint_source": "torch_tricks.doctor.static",
    "check_model": "torch_tricks.doctor.runtime",
    # models and the trick registry
    "get_model": "torch_tricks.models",
    "load_model": "torch_tricks.models",
    "list_models": "torch_tricks.models",
    "list_tricks": "torch_tricks.registry",
}

__all__ = sorted([*_EXPORTS, "UserError", "__version__"])


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'torch_tricks' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
