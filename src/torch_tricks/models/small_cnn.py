"""A small CNN for the 8x8 grayscale scikit-learn digits: the model that really trains.

The other reference models are measured on random inputs; this one is small enough to
train to high accuracy on CPU in seconds, so the tools can show that a trick kept the
accuracy (not only the speed), end to end, without any download.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_tricks.models.registry import register_model

__all__ = ["SmallCNN", "small_cnn"]


@register_model(
    "small_cnn",
    default_input="1x8x8",
    description="small CNN for 8x8 grayscale digits (scikit-learn load_digits)",
    tags=("vision", "conv", "small"),
)
def small_cnn(
    num_classes: int = 10, in_chans: int = 1, widths: tuple[int, ...] = (32, 64, 64)
) -> "SmallCNN":
    """Conv-BN-ReLU layers of ``widths`` channels, global average pool, linear."""
    return SmallCNN(num_classes=num_classes, in_chans=in_chans, widths=widths)


class SmallCNN(nn.Module):
    """3x3 conv-BN-ReLU layers, stride 2 at the second one, global average pool, linear.

    On 8x8 images one downsampling (to 4x4) is enough: the receptive field of three 3x3
    convs with one stride-2 step already covers the whole digit.
    """

    def __init__(
        self, num_classes: int = 10, in_chans: int = 1, widths: tuple[int, ...] = (32, 64, 64)
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        blocks: list[nn.Module] = []
        c_in = in_chans
        for i, c_out in enumerate(widths):
            stride = 2 if i == 1 else 1
            # One Sequential per conv-BN-ReLU block, so per-block tricks (checkpointing) find them.
            blocks.append(nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ))
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))
