"""A plain multilayer perceptron: the smallest reference model.

Nothing but Linear and ReLU, so it isolates the cost of matmuls and of the framework
overhead around them (for tiny batches the overhead dominates, which is exactly what
tricks such as CUDA graphs or compile address).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_tricks.models.registry import register_model

__all__ = ["MLP", "mlp"]


@register_model(
    "mlp",
    default_input="784",
    description="MLP 784-512-512-10 for flattened 28x28 images",
    tags=("mlp",),
)
def mlp(num_classes: int = 10, in_features: int = 784, hidden: int = 512, depth: int = 2) -> "MLP":
    """``depth`` hidden layers of width ``hidden``, each Linear + ReLU, then a Linear."""
    return MLP(num_classes=num_classes, in_features=in_features, hidden=hidden, depth=depth)


class MLP(nn.Module):
    """Flatten, then (Linear, ReLU) x depth, then Linear to ``num_classes``.

    Flattening first lets it take (batch, 784) or (batch, 1, 28, 28) alike.
    """

    def __init__(
        self, num_classes: int = 10, in_features: int = 784, hidden: int = 512, depth: int = 2
    ) -> None:
        super().__init__()
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.num_classes = num_classes
        self.in_features = in_features
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
