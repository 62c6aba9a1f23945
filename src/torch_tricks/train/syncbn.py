"""Synchronised BatchNorm on every backend, gloo/CPU included (catalogue T19).

With a few samples per device (detection, segmentation, 3-D), BatchNorm's per-device
statistics are noisy and training suffers. SyncBN normalises with the statistics of the
*global* batch. :class:`torch.nn.SyncBatchNorm` does this on CUDA (and XPU/HPU), but its
forward raises on CPU tensors, so it cannot run under gloo on CPU machines, where
multi-process training is tested and sometimes run.

:func:`convert_sync_batchnorm` therefore uses PyTorch's class where it works and falls
back to :class:`CPUSyncBatchNorm`, written here because nothing in PyTorch covers it. It
follows the seed's one-communication scheme: each rank sums ``x`` and ``x²`` per channel,
and a *single* all-reduce of ``(Σx, Σx², count)`` gives the global mean and variance
(``var = E[x²] − E[x]²``) instead of one all-reduce for the mean and a second for the
variance. The backward likewise all-reduces ``(Σdy, Σdy·x̂)`` in one call. Sums are taken
in float64 (where the device has it) because ``E[x²] − E[x]²`` cancels badly in float32
when the mean is large relative to the spread.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["CPUSyncBatchNorm", "convert_sync_batchnorm"]

_TORCH_SYNCBN_DEVICES = ("cuda", "xpu", "hpu")


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every rank of ``process_group``; works on any device and backend.

    * Training, with a process group of more than one rank: global mean and (biased)
      variance from one all-reduce; running stats updated with the unbiased global
      variance, as BatchNorm does; every rank must call forward (and backward) together.
    * Eval mode, or no process group / one rank: exactly :class:`nn.BatchNorm{1,2,3}d`
      (running stats in eval, no communication).

    The weight and bias gradients it returns are this rank's share, as with
    :class:`torch.nn.SyncBatchNorm`: DDP's gradient all-reduce combines them. Parameters and
    buffers are BatchNorm's (``weight``, ``bias``, ``running_mean``, ``running_var``,
    ``num_batches_tracked``), so checkpoints load into either class.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = self._sync_group()
        if group is None:  # eval, or nothing to synchronise with: plain BatchNorm
            return super().forward(input)
        if input.shape[1] == 0:
            raise ValueError("CPUSyncBatchNorm got an input with 0 channels")

        factor = self._count_batch()
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        return _SyncBatchNormFn.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group
        )

    def _count_batch(self) -> float:
        """Count the batch (when tracking running statistics); the exponential average factor, as BatchNorm's."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm
                factor = 1.0 / float(self.num_batches_tracked.item())
        return factor

    def _sync_group(self) -> Any | None:
        """The process group to synchronise over in this call, or None for plain BatchNorm."""
        if not self.training or not _has_group():
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None


@register_trick(
    "sync_batchnorm",
    ids=("T19",),
    kind="train",
    trades="one small all-reduce per BatchNorm layer per step, for batch statistics over the global batch",
    needs="torch.distributed initialised (DDP); helps when the per-device batch is small (< ~16)",
    config_key="sync_bn",
)
def convert_sync_batchnorm(model: nn.Module, process_group: Any | None = None, *, impl: str = "auto") -> nn.Module:
    """Replace every BatchNorm layer of ``model`` by a synchronised one; returns the (new) model.

    ``impl="auto"`` uses :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm` when the
    model lives (or, on a CPU-built model with CUDA present, will live) on an accelerator
    PyTorch's SyncBN supports and the backend is not gloo; otherwise :class:`CPUSyncBatchNorm`,
    since PyTorch's raises on CPU tensors. ``impl="torch"`` / ``"cpu"`` force one.
    Our conversion keeps the original parameter and buffer objects, so an optimizer built
    before the conversion still updates them. Convert before wrapping in DDP.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"convert_sync_batchnorm needs an nn.Module, not {type(model).__name__}")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise UserError("convert BatchNorm before wrapping in DDP/DataParallel: pass the unwrapped model")
    if impl not in ("auto", "torch", "cpu"):
        raise UserError(f"impl must be 'auto', 'torch' or 'cpu', not {impl!r}")
    if impl == "auto":
        impl = "torch" if _torch_syncbn_works(model) else "cpu"
    if impl == "torch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
    return _convert(model, process_group)


# --------------------------------------------------------------------------- internals


def _torch_syncbn_works(model: nn.Module) -> bool:
    if _has_group() and dist.get_backend() == "gloo":
        return False
    devices = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
    if devices & set(_TORCH_SYNCBN_DEVICES):
        return True
    return devices <= {"cpu"} and torch.cuda.is_available()


def _has_group() -> bool:
    # not distributed.is_dist: distributed imports this module
    return dist.is_available() and dist.is_initialized()


def _convert(module: nn.Module, process_group: Any | None) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        out = _cpu_sync_bn(module, process_group)
    for name, child in module.named_children():
        out.add_module(name, _convert(child, process_group))
    return out


def _cpu_sync_bn(module: _BatchNorm, process_group: Any | None) -> CPUSyncBatchNorm:
    """A CPUSyncBatchNorm holding ``module``'s very parameters and buffers."""
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
        raise UserError("a lazy BatchNorm is not initialised yet: run one forward pass before converting")
    out = CPUSyncBatchNorm(
        module.num_features,
        module.eps,
        module.momentum,
        module.affine,
        module.track_running_stats,
        process_group,
    )
    # Reuse the very tensors: values, devices, requires_grad and optimizer references all carry over.
    out.weight = module.weight
    out.bias = module.bias
    out.running_mean = module.running_mean
    out.running_var = module.running_var
    out.num_batches_tracked = module.num_batches_tracked
    out.train(module.training)
    if hasattr(module, "qconfig"):
        out.qconfig = module.qconfig
    return out


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for the sums (cancellation in E[x²] − E[x]²) where the device supports it."""
    return torch.float32 if t.device.type == "mps" else torch.float64


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


class _SyncBatchNormFn(torch.autograd.Function):
    """Global-statistics batch norm: one all-reduce forward, one backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: Any,
    ) -> torch.Tensor:
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        acc = _acc_dtype(x)
        xa = x.to(acc)
        count = torch.full((1,), x.numel() // c, dtype=acc, device=x.device)
        stats = torch.cat([xa.sum(dims), (xa * xa).sum(dims), count])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)  # the one communication
        total, total_sq, n = stats[:c], stats[c : 2 * c], stats[2 * c]
        n_items = int(n.item())
        if n_items <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {n_items} over all ranks")
        mean = total / n
        var = (total_sq / n - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            _update_running(running_mean, running_var, mean, var, n_items, momentum)

        cd = _compute_dtype(x)
        mean_c, invstd_c = mean.to(cd), invstd.to(cd)
        y = _times_weight((x.to(cd) - mean_c.view(shape)) * invstd_c.view(shape), weight, cd, shape)
        if bias is not None:
            y = y + bias.to(cd).view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.group = group
        ctx.n = n_items
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        cd = mean.dtype
        acc = _acc_dtype(x)
        xhat = (x.to(cd) - mean.view(shape)) * invstd.view(shape)
        dyc = dy.to(cd)
        sum_dy = dyc.to(acc).sum(dims)
        sum_dy_xhat = (dyc * xhat).to(acc).sum(dims)

        grad_x = grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)  # this rank's share; DDP sums/averages across ranks
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(dy.dtype if weight is None else weight.dtype)
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=ctx.group)  # the one communication
            mean_dy = (both[:c] / ctx.n).to(cd).view(shape)
            mean_dy_xhat = (both[c:] / ctx.n).to(cd).view(shape)
            scale = _times_weight(invstd.view(shape), weight, cd, shape)
            grad_x = ((dyc - mean_dy - xhat * mean_dy_xhat) * scale).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


@torch.no_grad()
def _update_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                    n_items: int, momentum: float) -> None:
    """BatchNorm's running statistics update, with the global batch's mean and unbiased variance."""
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    unbiased = var * (n_items / (n_items - 1))
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


def _times_weight(y: torch.Tensor, weight: torch.Tensor | None, cd: torch.dtype, shape: list[int]) -> torch.Tensor:
    """``y`` scaled by the per-channel ``weight`` (in the compute dtype); as it is without an affine weight."""
    if weight is None:
        return y
    return y * weight.to(cd).view(shape)
