"""T32: what the tune makes fit (``tune --fit``): a batch size, a sequence length, or the longest sequence.

``--fit batch=N`` tunes at batch ``N`` (the example batch tiled or cut to it): the recommendation
is the fastest configuration measured to fit under the memory limit there. ``--fit seq=N`` does
the same at sequence length ``N`` for a token model. ``--fit seq`` also searches the longest
sequence that fits under the limit, for plain and for the recommendation, each length a step
run at it with its peak measured: attention and the logits grow faster than linearly with the
sequence, so no straight line through two lengths is trusted.

A token batch is one whose inputs are integer tensors of shape (batch, sequence): ids, masks,
token type ids, labels. Changing its length tiles each of them along the sequence (the ids
repeat), which keeps masks and labels consistent with the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from torch_tricks import batches as B
from torch_tricks.errors import UserError
from torch_tricks.data.token_batches import max_positions

__all__ = ["FitTarget", "parse_fit", "apply_fit", "sequence_length", "with_sequence_length", "tiled",
           "max_positions"]


@dataclass(frozen=True)
class FitTarget:
    """``kind`` "batch" or "seq"; ``value`` the size to tune at, or None: search the longest (seq only)."""

    kind: str
    value: int | None = None

    @property
    def search_seq(self) -> bool:
        return self.kind == "seq" and self.value is None

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}={self.value}"


def parse_fit(text: str | FitTarget | None) -> FitTarget | None:
    """``"batch=N"``, ``"seq=N"`` or ``"seq"`` as a :class:`FitTarget`; anything else a one-line UserError."""
    if text is None or isinstance(text, FitTarget):
        return text
    kind, _, value = str(text).strip().partition("=")
    if kind not in ("batch", "seq") or (kind == "batch" and not value):
        raise UserError(f"--fit {text!r}: give batch=N (tune at batch N), seq=N (at sequence length N) or seq "
                        "(also search the longest sequence that fits)")
    if not value:
        return FitTarget(kind)
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"--fit {text!r}: {kind} must be a whole number >= 1")
    return FitTarget(kind, int(value))


def apply_fit(fit: FitTarget | None, batch: Any, model: nn.Module) -> Any:
    """``batch`` at the target's batch size or sequence length (unchanged for None or a search);
    a one-line UserError for a sequence target on a batch that is not a token batch, or longer than the
    model's positions."""
    if fit is None:
        return batch
    if fit.kind == "seq":
        seq = sequence_length(batch)
        if seq is None:
            raise UserError(f"--fit {fit}: the model's inputs are not token ids of shape (batch, sequence) "
                            f"({_describe_inputs(batch)}): a sequence length applies to token models; use "
                            "--fit batch=N")
        cap = max_positions(model)
        if fit.value is not None and cap is not None and fit.value > cap:
            raise UserError(f"--fit {fit}: the model has {cap} positions: give seq={cap} or less")
        return batch if fit.value is None else with_sequence_length(batch, fit.value)
    return tiled(batch, fit.value)


def sequence_length(batch: Any) -> int | None:
    """The sequence length T of a token batch (integer inputs all (batch, T)); None for any other batch."""
    b = B.unpack(batch)
    ints = [t for t in b.inputs if isinstance(t, torch.Tensor)]
    if not ints or any(t.is_floating_point() or t.dim() != 2 for t in ints):
        return None
    lengths = {int(t.shape[1]) for t in ints}
    return lengths.pop() if len(lengths) == 1 else None


def with_sequence_length(batch: Any, n: int) -> Any:
    """``batch`` with every (batch, T) integer tensor (inputs, masks, labels) tiled or cut to length ``n``."""
    seq = sequence_length(batch)

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() != 2 or t.is_floating_point() or t.shape[1] != seq:
            return t
        reps = -(-n // t.shape[1])
        return t.repeat(1, reps)[:, :n].contiguous()

    return B.map_tensors(batch, resize)


def tiled(batch: Any, n: int) -> Any:
    """``batch`` repeated along dim 0 to ``n`` samples (tensors without a batch dimension as they are)."""
    def tile(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        reps = -(-n // t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:n]
    return B.map_tensors(batch, tile)


def _describe_inputs(batch: Any) -> str:
    shapes = [f"{t.dtype} {tuple(t.shape)}" for t in B.unpack(batch).inputs if isinstance(t, torch.Tensor)]
    return ", ".join(shapes) or "no tensor inputs"
