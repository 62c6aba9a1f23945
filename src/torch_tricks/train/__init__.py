"""Training: one loop (:func:`fit`) where every trick is a switch, and the tricks themselves.

Each trick module can be used alone on a plain model / optimizer; importing this package
registers them all with :mod:`torch_tricks.registry`.
"""

from __future__ import annotations

from torch_tricks.train import (  # noqa: F401  (imported to register their tricks)
    checkpoint,
    distributed,
    ema,
    memory,
    optim,
    precision,
    schedule,
    seed,
    speed,
    syncbn,
)
from torch_tricks.train.config import TrainConfig, load_config
from torch_tricks.train.loop import History, TrainingDiverged, fit
from torch_tricks.train.tricks import Tricks

__all__ = ["fit", "History", "TrainConfig", "TrainingDiverged", "Tricks", "load_config"]
