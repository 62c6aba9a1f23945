"""Helpers shared by the deploy tests (not a test module)."""

from __future__ import annotations

import torch
import torch.nn as nn


def randomize_bn(model: nn.Module, seed: int = 1) -> nn.Module:
    """Give every BatchNorm non-trivial statistics and affine parameters, so a fold that
    ignored any of them would change the outputs (a fresh BN is the identity in eval mode)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                if m.weight is not None:
                    m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(n, generator=g) * 0.2)
    return model


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(model: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))
