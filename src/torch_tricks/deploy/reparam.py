"""Structural re-parameterization: train with branches, deploy one conv (catalogue I2).

A block made of parallel *linear* branches (convs, each followed by a BN, summed) is in
eval mode one linear map, so it folds into a single convolution with bias and gives the
same outputs. The branches help optimisation while training (RepVGG: a 3x3 + 1x1 +
identity, ACNet: a kxk + 1xk + kx1 that strengthens the kernel's skeleton); the single
conv is what runs fast at inference: one kernel, no branch outputs kept, no adds.

* :class:`~torch_tricks.models.repvgg.RepVGGBlock` lives with the built-in RepVGG net,
  which is built from it; :class:`ACBlock` is here.
* :func:`reparameterize_model` folds every block of a model that has a
  ``reparameterize()`` method (duck-typed, so a user's own blocks join in), on a copy.

Re-parameterize *before* :func:`torch_tricks.deploy.fuse.fuse`: the folds need the BNs.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.fusion import fuse_conv_bn_weights

from torch_tricks.errors import UserError
from torch_tricks.models.repvgg import RepVGGBlock
from torch_tricks.deploy.steps import EXACT, StepContext, StepResult, deploy_step

__all__ = ["ACBlock", "RepVGGBlock", "ReparamReport", "reparameterize_model", "reparameterize_with_report"]


@dataclass
class ReparamReport:
    """Which blocks :func:`reparameterize_with_report` folded (module name -> block type)."""

    folded: dict[str, str] = field(default_factory=dict)
    already_folded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ACBlock(nn.Module):
    """ACNet's asymmetric convolution block (Ding et al., 2019): kxk + 1xk + kx1, each with BN.

    A drop-in replacement for ``Conv2d(in_ch, out_ch, kernel_size, stride, padding,
    groups=groups, bias=False) + BatchNorm2d`` (no activation: put one after it). The
    horizontal ``1 x k`` kernel is the middle row of a ``k x k`` kernel and the vertical
    ``k x 1`` its middle column, so after :meth:`reparameterize` the three become one
    ``k x k`` conv with bias (``fused``), exact in eval mode.

    Alignment: the square conv's output pixel ``i`` reads input rows
    ``i*stride - padding + [0, k)``; the 1xk conv reads one row, which must be the middle
    one, ``i*stride - padding + k//2``, so its row padding is ``padding - k//2`` (and
    likewise for the kx1 conv's columns). A negative value (``padding < k//2``) means
    cropping that many rows/columns off the input instead, as ACNet does.
    """

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        kernel_size: int = 3,
        stride: int = 1,
        padding: int = 1,
        groups: int = 1,
    ) -> None:
        super().__init__()
        _check_acblock_args(in_ch, out_ch, kernel_size, stride, padding, groups)
        self.in_ch, self.out_ch, self.kernel_size = in_ch, out_ch, kernel_size
        self.stride, self.padding, self.groups = stride, padding, groups
        k, p = kernel_size, padding
        self.crop = max(0, k // 2 - p)  # rows (cols) to cut off the input for the 1xk (kx1) conv
        side = max(0, p - k // 2)
        self.square = _conv_bn(in_ch, out_ch, (k, k), stride, (p, p), groups)
        self.hor = _conv_bn(in_ch, out_ch, (1, k), stride, (side, p), groups)
        self.ver = _conv_bn(in_ch, out_ch, (k, 1), stride, (p, side), groups)

    @property
    def deployed(self) -> bool:
        """True once the branches have been folded into ``fused``."""
        return hasattr(self, "fused")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deployed:
            return self.fused(x)
        c = self.crop
        xh = x[:, :, c: x.shape[2] - c, :] if c else x
        xv = x[:, :, :, c: x.shape[3] - c] if c else x
        return self.square(x) + self.hor(xh) + self.ver(xv)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Replace the three branches by one ``k x k`` conv with bias (no-op if already done).

        Each conv+BN is folded with PyTorch's :func:`~torch.nn.utils.fusion.fuse_conv_bn_weights`
        (in float64, so the sum is exact to float32 rounding); the 1xk and kx1 kernels are
        zero-padded onto the centre row / column of the square kernel and all are summed.
        """
        if self.deployed:
            return
        k = self.kernel_size
        ws, bs = _fold(self.square)
        wh, bh = _fold(self.hor)
        wv, bv = _fold(self.ver)
        weight = ws + F.pad(wh, [0, 0, k // 2, k // 2]) + F.pad(wv, [k // 2, k // 2, 0, 0])
        ref = self.square.conv.weight
        conv = nn.Conv2d(
            self.in_ch, self.out_ch, k, self.stride, self.padding, groups=self.groups,
            bias=True, device=ref.device, dtype=ref.dtype,
        )
        conv.weight.copy_(weight)
        conv.bias.copy_(bs + bh + bv)
        self.fused = conv
        del self.square, self.hor, self.ver


def _check_acblock_args(in_ch: int, out_ch: int, kernel_size: int, stride: int, padding: int, groups: int) -> None:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise UserError(f"ACBlock needs an odd kernel_size (the 1xk/kx1 kernels sit on the centre), got {kernel_size}")
    if padding < 0 or stride < 1 or groups < 1 or in_ch % groups or out_ch % groups:
        raise UserError(
            f"ACBlock: bad stride={stride}, padding={padding} or groups={groups} for {in_ch}->{out_ch} channels"
        )


def reparameterize_model(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """``model`` in eval mode with every block that has a ``reparameterize()`` method folded.

    Works on a copy unless ``inplace``. Blocks are found by duck typing (a callable
    ``reparameterize`` attribute), outermost first, so a user's own block that folds its
    children is called before them. The result equals the eval-mode original up to float
    rounding. A model with no such block comes back unchanged, with a warning
    (:func:`reparameterize_with_report` returns that as data).
    """
    out, rep = reparameterize_with_report(model, inplace=inplace)
    if not rep.folded:
        warnings.warn(f"reparameterize_model: nothing folded ({'; '.join(rep.notes)})", stacklevel=2)
    return out


def reparameterize_with_report(model: nn.Module, *, inplace: bool = False) -> tuple[nn.Module, ReparamReport]:
    """:func:`reparameterize_model`, returning ``(model, ReparamReport)``.

    Without ``inplace`` the input model is never touched, even if a block's fold raises.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"reparameterize_model needs an nn.Module, got {type(model).__name__}")
    target = model if inplace else copy.deepcopy(model)
    target.eval()  # the folds use BN running statistics, which only eval mode uses
    rep = ReparamReport()
    _fold_blocks(target, rep)
    if not rep.folded:
        rep.notes.append(
            "all blocks were already folded" if rep.already_folded
            else "the model has no block with a reparameterize() method (RepVGGBlock, ACBlock)"
        )
    return target, rep


def _fold_blocks(target: nn.Module, rep: ReparamReport) -> None:
    """Call every block's ``reparameterize()``, outermost first (a folded block's insides are skipped)."""
    done: list[str] = []
    for name, m in list(target.named_modules()):
        if _inside_any(name, done):
            continue  # inside a block already folded: its fold took care of it
        fold = getattr(m, "reparameterize", None)
        if not _takes_no_arguments(fold):
            continue  # not a block (a VAE's reparameterize(mu, logvar) is something else)
        if getattr(m, "deployed", False):
            rep.already_folded.append(name)
            continue
        fold()
        rep.folded[name] = type(m).__name__
        done.append(name)


def _inside_any(name: str, blocks: list[str]) -> bool:
    """Whether the module ``name`` is inside one of ``blocks`` (everything is inside the root, ``""``)."""
    return any(name.startswith(d + ".") or not d for d in blocks)


# -- the deploy step --------------------------------------------------------------------------


@deploy_step(
    "reparam",
    summary="fold multi-branch blocks (RepVGG, ACNet) into one conv each (same outputs)",
    tolerance=EXACT,
    order=20,
    # its folds need the BatchNorms and channel counts these change
    before={"fuse": "fusing removes the BatchNorms that re-parameterization folds",
            "prune": "pruning changes the channel counts the multi-branch blocks fold with"},
    ids=("I2",),
    earlier_name="reparameterize",
    fn=reparameterize_model,
    trades="one conv per block at inference (faster, no branch outputs kept) for a multi-branch training-time block",
    needs="blocks with a reparameterize() method (RepVGGBlock, ACBlock); eval-mode BN statistics",
    measured_in="benchmarks/deploy.py",
)
def reparam_step(model: nn.Module, ctx: StepContext) -> tuple[nn.Module, StepResult]:
    """The ``reparam`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: :func:`reparameterize_with_report`."""
    new, rep = reparameterize_with_report(model)
    return new, ctx.result(
        backend="reparameterize()", changed=bool(rep.folded), notes=list(rep.notes),
        details={"folded": len(rep.folded), "block_types": sorted(set(rep.folded.values())),
                 "already_folded": len(rep.already_folded)})


def _takes_no_arguments(fn: Any) -> bool:
    if not callable(fn):
        return False
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in sig.parameters.values())


def _conv_bn(in_ch: int, out_ch: int, k: tuple[int, int], stride: int, padding: tuple[int, int],
             groups: int) -> nn.Sequential:
    seq = nn.Sequential()
    seq.add_module("conv", nn.Conv2d(in_ch, out_ch, k, stride, padding, groups=groups, bias=False))
    seq.add_module("bn", nn.BatchNorm2d(out_ch))
    return seq


def _fold(branch: nn.Sequential) -> tuple[torch.Tensor, torch.Tensor]:
    conv, bn = branch.conv, branch.bn
    w, b = fuse_conv_bn_weights(
        conv.weight.double(), None, bn.running_mean.double(), bn.running_var.double(), bn.eps,
        bn.weight.double() if bn.weight is not None else None,
        bn.bias.double() if bn.bias is not None else None,
    )
    return w.detach(), b.detach()
