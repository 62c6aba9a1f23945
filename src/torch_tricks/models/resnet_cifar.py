"""ResNet-9 for CIFAR-10, the DAWNBench / Myrtle.ai network (David Page, 2018).

It is the classic "fast CIFAR" baseline: shallow, wide, with max pooling in place of
strided convs and only two residual blocks, so it reaches 94% in a few epochs and is
a realistic small target for speed tricks (channels_last, AMP, compile).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_tricks.models.registry import register_model

__all__ = ["ResNet9", "resnet9"]


@register_model(
    "resnet9",
    default_input="3x32x32",
    description="ResNet-9, the DAWNBench/Myrtle.ai fast CIFAR-10 network (6.6M params)",
    tags=("vision", "conv"),
)
def resnet9(num_classes: int = 10, scale: float | None = 0.125, in_chans: int = 3) -> "ResNet9":
    """ResNet-9 with Myrtle's 0.125 output scale by default (``scale=None`` to drop it)."""
    return ResNet9(num_classes=num_classes, scale=scale, in_chans=in_chans)


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 conv (no bias: BN follows), BN, ReLU: the only layer type the net uses."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class Residual(nn.Module):
    """``x + f(x)``; the branch keeps the channel count, so no projection is needed."""

    def __init__(self, branch: nn.Module) -> None:
        super().__init__()
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


class ResNet9(nn.Module):
    """prep(64) -> layer1(128, pool, res) -> layer2(256, pool) -> layer3(512, pool, res) -> head.

    The logits are multiplied by ``scale`` (0.125 in Myrtle's recipe), which tames the
    softmax at the start of training instead of a special init of the last layer.
    """

    def __init__(
        self, num_classes: int = 10, scale: float | None = 0.125, in_chans: int = 3
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.scale = scale
        self.prep = conv_bn(in_chans, 64)
        self.layer1 = nn.Sequential(
            conv_bn(64, 128),
            nn.MaxPool2d(2),
            Residual(nn.Sequential(conv_bn(128, 128), conv_bn(128, 128))),
        )
        self.layer2 = nn.Sequential(conv_bn(128, 256), nn.MaxPool2d(2))
        self.layer3 = nn.Sequential(
            conv_bn(256, 512),
            nn.MaxPool2d(2),
            Residual(nn.Sequential(conv_bn(512, 512), conv_bn(512, 512))),
        )
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(512, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.prep(x))))
        x = self.fc(self.flatten(self.pool(x)))
        if self.scale is not None:
            x = x * self.scale
        return x
