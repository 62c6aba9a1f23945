"""ResNet-18/34/50 in torchvision's exact ImageNet layout, with plain ``torch.nn``.

The attribute names (``conv1``, ``bn1``, ``layer1``..``layer4``, ``downsample`` as
``Sequential(conv, bn)``, ``fc``) and the parameter counts match torchvision, so a
torchvision state dict loads with ``load_state_dict`` and measurements here compare
one to one with published numbers, without torchvision being installed.
"""

from __future__ import annotations

from typing import Type, Union

import torch
import torch.nn as nn

from torch_tricks.models.registry import register_model

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50"]


@register_model(
    "resnet18",
    default_input="3x224x224",
    description="ResNet-18, torchvision ImageNet layout (11.7M params)",
    tags=("vision", "conv"),
)
def resnet18(num_classes: int = 1000, **kwargs) -> "ResNet":
    """ResNet-18: BasicBlock, depths (2, 2, 2, 2)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes, **kwargs)


@register_model(
    "resnet34",
    default_input="3x224x224",
    description="ResNet-34, torchvision ImageNet layout (21.8M params)",
    tags=("vision", "conv"),
)
def resnet34(num_classes: int = 1000, **kwargs) -> "ResNet":
    """ResNet-34: BasicBlock, depths (3, 4, 6, 3)."""
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes=num_classes, **kwargs)


@register_model(
    "resnet50",
    default_input="3x224x224",
    description="ResNet-50 (v1.5, stride in the 3x3), torchvision ImageNet layout (25.6M params)",
    tags=("vision", "conv"),
)
def resnet50(num_classes: int = 1000, **kwargs) -> "ResNet":
    """ResNet-50: Bottleneck, depths (3, 4, 6, 3)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes, **kwargs)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3x3 conv without bias: the following BatchNorm makes a bias redundant."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 conv without bias (projection shortcut and bottleneck squeeze/expand)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN pairs plus the shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 squeeze, 3x3, 1x1 expand (ResNet-50).

    The stride sits on the 3x3 conv ("ResNet v1.5"), as in torchvision: it is what
    torchvision's weights were trained with, and it is slightly more accurate.
    """

    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """The ImageNet ResNet trunk: 7x7 stem, max pool, four stages, global average pool, fc.

    ``zero_init_residual`` zeroes the last BN gamma of every block so each block starts
    as the identity, which helps large-batch training (Goyal et al., 2017).
    """

    def __init__(
        self,
        block: Type[Union[BasicBlock, Bottleneck]],
        layers: tuple[int, int, int, int] | list[int],
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.inplanes = 64
        self.conv1 = nn.Conv2d(in_chans, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

        self._init_weights()
        if zero_init_residual:
            self._zero_init_residual()

    def _init_weights(self) -> None:
        """torchvision's init: Kaiming normal (fan_out) for convs, BN to identity;
        Linear keeps PyTorch's default init."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _zero_init_residual(self) -> None:
        """Each block's last BN gamma to 0: the block starts as the identity."""
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.constant_(m.bn3.weight, 0)
            elif isinstance(m, BasicBlock):
                nn.init.constant_(m.bn2.weight, 0)

    def _make_layer(
        self, block: Type[Union[BasicBlock, Bottleneck]], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers.extend(block(self.inplanes, planes) for _ in range(1, blocks))
        return nn.Sequential(*layers)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Stem and the four stages, before pooling."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        return self.layer4(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.forward_features(x))
        return self.fc(torch.flatten(x, 1))
