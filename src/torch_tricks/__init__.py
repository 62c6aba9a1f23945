"""torch-tricks: measure which PyTorch speed and memory tricks help your model, then apply them."""

from __future__ import annotations

__version__ = "0.1.0"

from torch_tricks.errors import UserError  # noqa: E402

__all__ = ["UserError", "__version__"]
