"""Optional dependencies: the one place that names a pip extra.

:func:`require` imports a module that only some features need, or raises a
:class:`~torch_tricks.errors.UserError` whose single line says which extra installs it;
:func:`available` is the quiet probe for code that skips a trick when a package is missing.
Both import lazily, at the call, so importing torch_tricks never pulls optional packages in.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from torch_tricks.errors import UserError

__all__ = ["EXTRAS", "available", "install_hint", "require"]

# the extras declared in pyproject.toml's [project.optional-dependencies]
EXTRAS = frozenset({"data", "deploy", "digits", "plot", "onnx", "tensorboard", "hf", "lightning", "peers", "float8",
                    "liger", "text", "lora", "dev"})


def install_hint(extra: str) -> str:
    """``pip install "torch-tricks[EXTRA]"``: the command that installs an extra."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; known: {', '.join(sorted(EXTRAS))}")
    return f'pip install "torch-tricks[{extra}]"'


def require(module: str, extra: str, purpose: str | None = None) -> ModuleType:
    """Import ``module`` and return it, or raise a one-line UserError naming ``extra``.

    ``purpose`` says what needs it ("HDF5 support"); the message reads
    ``HDF5 support needs h5py: pip install "torch-tricks[data]"``.
    """
    hint = install_hint(extra)
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        what = purpose or "this feature"
        raise UserError(f"{what} needs {top}: {hint}") from None


def available(module: str) -> bool:
    """Whether ``module`` imports (a probe: no message, no exception)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
