"""RepVGG (Ding et al., 2021): a multi-branch net for training, a plain 3x3 stack for inference.

It is the reference for structural re-parameterization: in training each block sums a
3x3 conv+BN, a 1x1 conv+BN and an identity BN; since all three are linear in eval mode
they fold into one 3x3 conv with bias, which is faster (one kernel, no extra reads of
the input, no branch outputs kept). :func:`reparameterize_model` does that fold, so the
tools can measure the speed-up and check that the outputs did not change.

Attribute names (``rbr_dense.conv``, ``rbr_1x1.bn``, ``rbr_identity``, ``rbr_reparam``)
follow the official code, so its checkpoints load.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_tricks.models.registry import register_model

__all__ = ["RepVGGBlock", "RepVGG", "repvgg", "reparameterize_model"]


@register_model(
    "repvgg",
    default_input="3x224x224",
    description="RepVGG-A0 (multi-branch blocks that fold into plain 3x3 convs)",
    tags=("vision", "conv", "multibranch"),
)
def repvgg(num_classes: int = 1000, width_mult: float = 1.0, deploy: bool = False) -> "RepVGG":
    """RepVGG-A0: widths 48, 48, 96, 192, 1280 and depths 1 (stem), 2, 4, 14, 1.

    ``width_mult`` scales every width (A0 is 0.75x / 2.5x of the base 64..512);
    ``deploy=True`` returns it already re-parameterized (untrained weights).
    """
    model = RepVGG(
        widths=tuple(max(8, int(round(w * width_mult))) for w in (48, 48, 96, 192, 1280)),
        depths=(2, 4, 14, 1),
        num_classes=num_classes,
    )
    return reparameterize_model(model) if deploy else model


def reparameterize_model(model: nn.Module) -> nn.Module:
    """Fold every :class:`RepVGGBlock` in ``model`` into its single-conv form, in place.

    Uses the BN running statistics, so the result equals the model in eval mode.
    Returns ``model`` for chaining. Blocks already folded are left alone.
    """
    for m in model.modules():
        if isinstance(m, RepVGGBlock):
            m.reparameterize()
    return model


def _conv_bn(in_ch: int, out_ch: int, kernel_size: int, stride: int, padding: int) -> nn.Sequential:
    seq = nn.Sequential()
    seq.add_module("conv", nn.Conv2d(in_ch, out_ch, kernel_size, stride, padding, bias=False))
    seq.add_module("bn", nn.BatchNorm2d(out_ch))
    return seq


def _fold_bn(kernel: torch.Tensor, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel and bias of ``bn(conv(x))`` as one conv; in float64 to keep the fold exact."""
    std = (bn.running_var.double() + bn.eps).sqrt()
    scale = bn.weight.double() / std
    return kernel * scale.reshape(-1, 1, 1, 1), bn.bias.double() - bn.running_mean.double() * scale


class RepVGGBlock(nn.Module):
    """3x3 conv+BN + 1x1 conv+BN (+ identity BN when shapes allow), summed, then ReLU.

    After :meth:`reparameterize` the three branches are gone and ``rbr_reparam``, one
    3x3 conv with bias, computes the same function (of the eval-mode block).
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.in_ch, self.out_ch, self.stride = in_ch, out_ch, stride
        self.nonlinearity = nn.ReLU(inplace=True)
        self.rbr_identity = nn.BatchNorm2d(in_ch) if in_ch == out_ch and stride == 1 else None
        self.rbr_dense = _conv_bn(in_ch, out_ch, 3, stride, 1)
        # The 1x1 has no padding: at stride 2 it samples the same pixels as the 3x3 centre.
        self.rbr_1x1 = _conv_bn(in_ch, out_ch, 1, stride, 0)

    @property
    def deployed(self) -> bool:
        """True once the branches have been folded into ``rbr_reparam``."""
        return hasattr(self, "rbr_reparam")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deployed:
            return self.nonlinearity(self.rbr_reparam(x))
        out = self.rbr_dense(x) + self.rbr_1x1(x)
        if self.rbr_identity is not None:
            out = out + self.rbr_identity(x)
        return self.nonlinearity(out)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Replace the branches by one equivalent 3x3 conv with bias (no-op if already done)."""
        if self.deployed:
            return
        w3 = self.rbr_dense.conv.weight
        kernel, bias = _fold_bn(w3.double(), self.rbr_dense.bn)
        k1, b1 = _fold_bn(self.rbr_1x1.conv.weight.double(), self.rbr_1x1.bn)
        kernel = kernel + nn.functional.pad(k1, [1, 1, 1, 1])
        bias = bias + b1
        if self.rbr_identity is not None:
            # The identity is a 3x3 conv whose kernel is 1 at the centre of its own channel.
            eye = torch.zeros_like(kernel)
            idx = torch.arange(self.in_ch, device=eye.device)
            eye[idx, idx, 1, 1] = 1.0
            k_id, b_id = _fold_bn(eye, self.rbr_identity)
            kernel = kernel + k_id
            bias = bias + b_id
        conv = nn.Conv2d(
            self.in_ch, self.out_ch, 3, self.stride, 1, bias=True, device=w3.device, dtype=w3.dtype
        )
        conv.weight.copy_(kernel)
        conv.bias.copy_(bias)
        self.rbr_reparam = conv
        del self.rbr_dense, self.rbr_1x1
        self.rbr_identity = None


class RepVGG(nn.Module):
    """A stride-2 stem block, then stages whose first block has stride 2, pool, linear.

    No pooling layers and no shortcuts that survive deployment: after the fold the net
    is a VGG-like chain of 3x3 convs and ReLUs, the friendliest shape for hardware.
    ``widths`` gives the stem then each stage; ``depths`` the blocks of each stage.
    Stages are ``stage1``..``stageN`` as in the official code.
    """

    def __init__(
        self,
        widths: tuple[int, ...] = (48, 48, 96, 192, 1280),
        depths: tuple[int, ...] = (2, 4, 14, 1),
        num_classes: int = 1000,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        if len(widths) != len(depths) + 1:
            raise ValueError("widths needs one entry for the stem plus one per stage in depths")
        self.num_classes = num_classes
        self.num_stages = len(depths)
        self.stage0 = RepVGGBlock(in_chans, widths[0], stride=2)
        in_ch = widths[0]
        for s, (width, depth) in enumerate(zip(widths[1:], depths), start=1):
            blocks = []
            for i in range(depth):
                blocks.append(RepVGGBlock(in_ch, width, stride=2 if i == 0 else 1))
                in_ch = width
            self.add_module(f"stage{s}", nn.Sequential(*blocks))
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage0(x)
        for s in range(1, self.num_stages + 1):
            x = getattr(self, f"stage{s}")(x)
        return self.linear(torch.flatten(self.gap(x), 1))
