"""The scikit-learn digits images as a built-in data set (no download: they ship with it).

1,797 grayscale 8x8 images of the digits 0-9, split into a fixed stratified train and
validation part, scaled to [0, 1] and normalised with the training mean and std, so a
newcomer can watch a real model learn in seconds on a laptop CPU.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch.utils.data import TensorDataset

from torch_tricks._optional import require
from torch_tricks.errors import UserError

__all__ = ["DATASETS", "load_dataset", "digits"]


def digits(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) TensorDatasets of (image (1, 8, 8) float32, label int64)."""
    load_digits = require("sklearn.datasets", "digits", "--data digits").load_digits
    bunch = load_digits()
    images = bunch.images.astype(np.float32) / 16.0
    labels = bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    val_idx = []
    for c in range(10):  # stratified: the same share of every class in validation
        idx = np.flatnonzero(labels == c)
        val_idx.extend(rng.choice(idx, size=int(round(len(idx) * val_fraction)), replace=False))
    is_val = np.zeros(len(labels), dtype=bool)
    is_val[val_idx] = True
    mean, std = images[~is_val].mean(), images[~is_val].std()
    x = torch.from_numpy((images - mean) / std).unsqueeze(1)
    y = torch.from_numpy(labels)
    train_mask = torch.from_numpy(~is_val)
    return TensorDataset(x[train_mask], y[train_mask]), TensorDataset(x[~train_mask], y[~train_mask])


DATASETS: dict[str, Callable[..., tuple[TensorDataset, TensorDataset]]] = {"digits": digits}


def load_dataset(name: str, **kwargs) -> tuple[TensorDataset, TensorDataset]:
    """A built-in (train, val) pair by name."""
    try:
        factory = DATASETS[name]
    except KeyError:
        raise UserError(f"unknown data set {name!r}: choose one of {', '.join(DATASETS)}") from None
    return factory(**kwargs)
