"""Memory that explains itself (issue 21): the largest share of a training step's memory, the trick
that attacks it, and that trick's saving, measured.

:func:`torch_tricks.inspect.memory.memory_report` splits a step into parameters, gradients,
optimizer state and the activations saved for backward (by module). For a causal LM, the
activations saved at the model's own level are the loss's: cross-entropy keeps its log-softmax of
the whole batch x sequence x vocabulary logits, so they count as "loss and logits" apart.
:func:`advise_memory` names the largest of those shares and the switch that cuts it (checkpointing
for activations, the chunked LM-head loss for the logits, 8-bit optimizer state, the optimizer
step in backward for gradients; parameters only shrink by sharding across ranks), then runs a
training step as the tune does, plain and with that switch, each on a fresh copy, and reports
both peaks. Here rather than in ``inspect``: the measured step is the tune's
(:func:`torch_tricks.tuning.measure.measure_memory`), and ``inspect`` stays below ``tuning``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_tricks._format import human_bytes
from torch_tricks.errors import one_line
from torch_tricks.inspect.memory import MemoryReport
from torch_tricks.train.lm_loss import lm_head_of
from torch_tricks.train.memory import default_blocks
from torch_tricks.tuning.measure import measure_memory

__all__ = ["MemoryAdvice", "advise_memory", "shares"]


@dataclass
class MemoryAdvice:
    """The largest share of the step's memory, the trick for it, and both measured step peaks."""

    share: str
    share_bytes: int
    shares: dict[str, int]
    trick: str | None  # the switch's name (None: no switch of one process cuts this share)
    ids: tuple[str, ...]
    changes: dict[str, Any]
    plain_peak_bytes: int | None = None
    trick_peak_bytes: int | None = None
    note: str = ""

    @property
    def saving(self) -> float | None:
        """The fraction of the plain step's peak the trick saved (measured), None where not measured."""
        if self.plain_peak_bytes and self.trick_peak_bytes is not None:
            return 1.0 - self.trick_peak_bytes / self.plain_peak_bytes
        return None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "saving": self.saving}

    def to_text(self) -> str:
        total = sum(self.shares.values())
        head = (f"largest share: {self.share}, {human_bytes(self.share_bytes)} of the {human_bytes(total)} "
                "counted above")
        if self.trick is None:
            return f"{head}; {self.note}"
        ids = f" ({', '.join(self.ids)})" if self.ids else ""
        switch = ", ".join(f"{k} = {v!r}" if not isinstance(v, bool) else k for k, v in self.changes.items())
        if self.saving is None:
            return f"{head}; the trick for it: {self.trick}{ids} [{switch}]: {self.note}"
        return (f"{head}; the trick for it: {self.trick}{ids} [{switch}]: a training step's peak "
                f"{human_bytes(self.plain_peak_bytes)} -> {human_bytes(self.trick_peak_bytes)} "
                f"({self.saving:.0%} saved, measured: plain and with it, each a fresh copy)"
                + (f"; {self.note}" if self.note else ""))


def shares(report: MemoryReport, model: nn.Module) -> dict[str, int]:
    """The step's memory by share: parameters, gradients, optimizer state, activations saved for backward,
    and for a causal LM the loss and logits (what its own level saves) apart from the other activations."""
    logits = report.activation_by_module.get("", 0) if lm_head_of(model) is not None else 0
    out = {"parameters": report.param_bytes, "gradients": report.grad_bytes,
           "optimizer state": report.optimizer_state_bytes,
           "activations saved for backward": report.activation_bytes - logits}
    if logits:
        out["loss and logits"] = logits
    return out


def advise_memory(model: nn.Module, report: MemoryReport, batch: Any,
                  loss_fn: Callable[..., torch.Tensor] | None = None, *, device: str = "cpu",
                  optimizer: str = "adamw") -> MemoryAdvice:
    """The largest share of ``report`` (:func:`shares`), the trick that attacks it, and a training step on
    ``batch`` measured plain and with it (``measure_memory``: a fresh copy of ``model`` each)."""
    parts = shares(report, model)
    share = max(parts, key=parts.get)
    trick, ids, changes, why_not = _trick_for(share, model, optimizer)
    advice = MemoryAdvice(share, parts[share], parts, trick, ids, changes, note=why_not)
    if trick is None or why_not:
        return advice
    base = {"device": device, "optimizer": optimizer, "fused_optimizer": False}
    try:
        plain = measure_memory(model, base, batch, loss_fn=loss_fn, optimizer_fn=None, per_sample=False)
        with_it = measure_memory(model, {**base, **changes}, batch, loss_fn=loss_fn, optimizer_fn=None,
                                 per_sample=False)
    except Exception as exc:  # the switch cannot serve this model after all: say why, keep the breakdown
        advice.note = f"not measured: {one_line(exc, with_type=True)}"
        return advice
    advice.plain_peak_bytes, advice.trick_peak_bytes = plain.peak_bytes, with_it.peak_bytes
    if trick == "low_precision_optimizer_state":
        advice.note = _LOW_BIT
    return advice


_LOW_BIT = ("8bit / 4bit state (torchao) holds 2 / 1 bytes a parameter instead of bf16's 4; its step is compiled, "
            "and a compiled step does not run inside this measure's tensor counter: benchmarks/memory.py measures it "
            "in a fresh process")


def _trick_for(share: str, model: nn.Module, optimizer: str) -> tuple[str | None, tuple[str, ...], dict[str, Any], str]:
    """(trick, ids, TrainConfig changes, why it cannot be measured here: '' if it can) for a share."""
    if share == "loss and logits":
        return "chunked_lm_loss", ("T28",), {"chunked_lm_loss": True}, ""
    if share == "activations saved for backward":
        if not default_blocks(model):
            return ("checkpointing", ("T12",), {"checkpointing": "blocks"},
                    "the model has no repeated blocks to checkpoint: name them (checkpointing = 'glob')")
        return "checkpointing", ("T12",), {"checkpointing": "blocks"}, ""
    if share == "optimizer state":
        if optimizer.lower() not in ("adam", "adamw"):
            return None, (), {}, f"low-bit state is for Adam/AdamW, not {optimizer}"
        return "low_precision_optimizer_state", ("T29",), {"optimizer_state": "bf16"}, ""
    if share == "gradients":
        return "optimizer_in_backward", ("T30",), {"optimizer_in_backward": True}, ""
    return None, (), {}, ("parameters shrink only when sharded across processes: measure fsdp with "
                          "torch-tricks tune --processes N")
