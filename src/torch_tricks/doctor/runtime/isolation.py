"""Keep the caller's state as it was: the check trains copies, but the global random stream and the
``.grad`` tensors of the caller's parameters are shared, so both are set aside while it runs and put
back after."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class _parked_grads:
    """Detach the caller's ``.grad`` tensors for the duration of the check and put the same
    objects back afterwards: a loss function or hook that closes over the caller's model
    (an L2 term on ``model.parameters()``) would otherwise accumulate into them."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads: list[torch.Tensor | None] = []

    def __enter__(self) -> None:
        self.grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc: Any) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g


class _forked_rng:
    """Fork the global RNG (CPU and this CUDA device) and seed it, so the check is
    reproducible and the caller's random stream continues as if nothing ran."""

    def __init__(self, device: torch.device) -> None:
        self.devices = [device.index] if device.type == "cuda" else []
        self._ctx = None

    def __enter__(self) -> None:
        self._ctx = torch.random.fork_rng(devices=self.devices)
        self._ctx.__enter__()
        torch.random.default_generator.manual_seed(0)
        for i in self.devices:
            torch.cuda.default_generators[i].manual_seed(0)

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
