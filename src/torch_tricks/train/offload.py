"""T31: activation offload: the tensors backward needs wait in pinned host memory, not on the GPU.

Under ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` every tensor the forward saves
for backward is copied to page-locked host memory as it is saved and copied back when
backward needs it, so the device holds the weights, the optimizer state and the activations
of the op being computed, not the whole graph's. With activation checkpointing on, only the
blocks' inputs are saved (the rest is recomputed), so only they travel: the combination
torchtune ships. The copies cost PCIe bandwidth on every step; on a CPU there is no device
memory to spare, so it is refused there (the tune skips it with that reason).

Written here only as the switch: the offload is PyTorch's own ``save_on_cpu``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["offload_activations", "available", "check_device"]


def available(device: torch.device) -> tuple[bool, str]:
    """A CUDA device: activations move from its memory to the host's."""
    if torch.device(device).type != "cuda":
        return False, ("moves saved activations from GPU memory to pinned host memory: on a CPU they are in host "
                       "memory already")
    return True, ""


def check_device(device: torch.device) -> None:
    """A one-line :class:`UserError` where the switch cannot help (not a CUDA device)."""
    ok, why = available(device)
    if not ok:
        raise UserError(f"offload_activations {why}: switch it off")


@register_trick(
    "offload_activations",
    ids=("T31",),
    kind="train",
    trades="the activations saved for backward wait in pinned host memory, not on the GPU, for two PCIe copies "
           "of each per step (with checkpointing: of the blocks' inputs only)",
    needs="a CUDA device (host memory to spare); best with checkpointing",
    config_key="offload_activations",
    measured_in="benchmarks/memory.py",
    available=available,
)
def offload_activations(pin_memory: bool = True) -> contextlib.AbstractContextManager[Any]:
    """The forward's context: every tensor saved for backward goes to (pinned) host memory until backward."""
    return torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
