"""Data: built-in data sets, packing, fast reading and loading (D1-D11)."""

from __future__ import annotations

from torch_tricks.data.digits import DATASETS, load_dataset

__all__ = ["DATASETS", "load_dataset"]
