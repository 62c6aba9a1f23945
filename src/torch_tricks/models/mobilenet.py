"""MobileNetV2 (Sandler et al., 2018) in torchvision's layout, with plain ``torch.nn``.

It is here as the depthwise-conv reference: its cost is dominated by memory traffic
rather than FLOPs, so tricks behave differently on it than on ResNet (channels_last
and fusion matter more, raw matmul speed less). Module indices (``features.N.conv.M``)
follow torchvision, so its state dicts load.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_tricks.models.registry import register_model

__all__ = ["InvertedResidual", "MobileNetV2", "mobilenet_v2"]


@register_model(
    "mobilenet_v2",
    default_input="3x224x224",
    description="MobileNetV2 1.0, torchvision layout (3.5M params)",
    tags=("vision", "conv", "depthwise"),
)
def mobilenet_v2(
    num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2
) -> "MobileNetV2":
    """MobileNetV2; ``width_mult`` scales every width (rounded to multiples of 8)."""
    return MobileNetV2(num_classes=num_classes, width_mult=width_mult, dropout=dropout)


def make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round a width to a multiple of ``divisor``, never more than 10% below ``v``.

    Widths that are multiples of 8 map well onto vector units and tensor cores; the
    rule is the one of the original TensorFlow code, kept so the counts match.
    """
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


class ConvBNReLU6(nn.Sequential):
    """Conv (no bias), BN, ReLU6 as a Sequential so the indices match torchvision's."""

    def __init__(
        self, in_ch: int, out_ch: int, kernel_size: int = 3, stride: int = 1, groups: int = 1
    ) -> None:
        padding = (kernel_size - 1) // 2
        super().__init__(
            nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise 3x3, linear projection (1x1, no activation).

    The projection has no ReLU because the narrow bottleneck would lose information
    through it; the shortcut joins the narrow ends, which keeps the saved tensors small.
    """

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride should be 1 or 2, got {stride}")
        self.stride = stride
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(inp, hidden, kernel_size=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


# expansion t, output channels c, repeats n, first stride s (Table 2 of the paper)
_SETTING = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class MobileNetV2(nn.Module):
    """Stem conv, 17 inverted residuals, 1x1 conv to 1280, average pool, dropout, linear."""

    def __init__(
        self,
        num_classes: int = 1000,
        width_mult: float = 1.0,
        dropout: float = 0.2,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        input_channel = make_divisible(32 * width_mult)
        # The last width never shrinks below 1280: the classifier needs the capacity.
        self.last_channel = make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [ConvBNReLU6(in_chans, input_channel, stride=2)]
        for t, c, n, s in _SETTING:
            output_channel = make_divisible(c * width_mult)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidual(input_channel, output_channel, stride, t))
                input_channel = output_channel
        features.append(ConvBNReLU6(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes)
        )
        for m in self.modules():
            _init_weights(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


def _init_weights(m: nn.Module) -> None:
    """torchvision's init."""
    if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out")
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0, 0.01)
        nn.init.zeros_(m.bias)
