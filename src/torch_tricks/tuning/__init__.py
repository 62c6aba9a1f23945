"""Tune: measure every applicable trick on the user's model and hardware, recommend, and apply."""

from torch_tricks.tuning.report import Result, TuneReport
from torch_tricks.tuning.tuner import example_batch, parse_size, tune

__all__ = ["Result", "TuneReport", "example_batch", "parse_size", "tune"]
