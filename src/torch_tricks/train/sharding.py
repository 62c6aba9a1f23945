"""Sharded data parallelism with PyTorch's own engines (catalogue T18): ZeRO-1 and FSDP2.

Under ``torchrun`` every rank holds the whole model with DDP (``distributed = "ddp"``);
when the optimizer state or the model itself no longer fits a device, shard it:

* ``zero1``: DDP for the gradients, :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`
  for the optimizer: each rank keeps and steps the state of its share of the parameters
  and broadcasts its updated share (AdamW's two moments are 2/3 of a model's training
  state: halved on 2 ranks).
* ``fsdp``: :func:`torch.distributed.fsdp.fully_shard` (FSDP2) on each repeated block
  (the blocks activation checkpointing finds: :func:`~torch_tricks.train.memory.repeated_blocks`)
  and on the root: parameters, gradients and optimizer state are sharded; a block's
  parameters are gathered just before its forward/backward and freed after
  (``fsdp_reshard``: also after forward, the default; off keeps them gathered between
  forward and backward, more memory for one all-gather less). ``precision = "bf16"``
  becomes a :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` (bf16 compute and
  communication, fp32 gradient reduction and master weights).

Checkpoints: under both, a DCP checkpoint every rank writes its shards of
(:mod:`torch_tricks.train.sharded_checkpoint`; under ``zero1`` each rank its share of the
optimizer state), which loads on any number of ranks. Under ``fsdp`` with ``bf16``/``fp16``
BatchNorm is sharded on its own in fp32, and ``channels_last`` converts the inputs only
(FSDP2 shards contiguous parameters).

Nothing here is a home-made engine: it is the wiring (wrapping granularity, the optimizer
built on the sharded parameters, gradient sync only on a group's last micro-batch) that
``Tricks`` and ``fit`` apply when the config asks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_tricks.device import module_device
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick
from torch_tricks.train.memory import repeated_blocks

__all__ = ["shard_fsdp", "zero1_optimizer", "sharding_available"]


def sharding_available(device: torch.device) -> tuple[bool, str]:
    """ZeRO-1 and FSDP need torch.distributed and several processes (torchrun)."""
    import torch.distributed as dist

    if not dist.is_available():
        return False, "this torch build has no torch.distributed"
    return False, "needs several processes: run the training under torchrun (distributed = zero1 | fsdp)"


@register_trick(
    "fsdp",
    ids=("T18",),
    kind="train",
    trades="parameters, gradients and optimizer state split across ranks, for an all-gather per block per pass",
    needs="torchrun with several processes; repeated blocks to shard one by one",
    config_key="distributed",
    available=sharding_available,
    measured_in="benchmarks/distributed.py",
)
def shard_fsdp(model: nn.Module, *, mesh: Any = None, precision: str = "fp32", reshard_after_forward: bool = True,
               blocks: list[nn.Module] | None = None) -> nn.Module:
    """``fully_shard`` each repeated block of ``model`` (or ``blocks``), then the root; in place, returned.

    The model must be on this rank's device already. ``precision`` ``bf16``/``fp16``: the
    blocks compute in that dtype from fp32 master weights, gradients reduced in fp32;
    BatchNorm layers are sharded on their own in fp32 (their running statistics are fp32).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise UserError("distributed = fsdp needs torchrun: launch with `torchrun --nproc_per_node N ...`")
    if mesh is None:  # FSDP's own default mesh is on CUDA wherever CUDA exists: a CPU (gloo) run on a GPU machine
        mesh = init_device_mesh(module_device(model).type, (dist.get_world_size(),))  # failed with cuda:1 missing
    mp = _mixed_precision_policy(precision)
    if precision in ("bf16", "fp16"):
        _shard_batchnorms_in_fp32(model, mesh, reshard_after_forward)
    chosen = blocks if blocks is not None else [m for _, m in repeated_blocks(model)]
    for block in chosen:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def _mixed_precision_policy(precision: str) -> Any:
    """FSDP's policy for ``precision``: bf16/fp16 compute from fp32 master weights, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in ("bf16", "fp16"):
        return MixedPrecisionPolicy()
    low = torch.bfloat16 if precision == "bf16" else torch.float16
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def _shard_batchnorms_in_fp32(model: nn.Module, mesh: Any, reshard_after_forward: bool) -> None:
    """BatchNorm keeps fp32 weights: its running statistics are fp32 buffers (FSDP casts parameters only),
    and batch_norm refuses low-precision weights beside them; autocast runs it this way too."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine and any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy())


@register_trick(
    "zero1",
    ids=("T18",),
    kind="train",
    trades="optimizer state split across ranks, for one broadcast of the updated parameters per step",
    needs="torchrun with several processes",
    config_key="distributed",
    available=sharding_available,
    measured_in="benchmarks/distributed.py",
)
def zero1_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` with ``optimizer``'s class,
    param groups and options (``optimizer`` must not have stepped yet: its state is not moved);
    each rank keeps and steps the state of its share of the parameters."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if not dist.is_initialized():
        raise UserError("distributed = zero1 needs torchrun: launch with `torchrun --nproc_per_node N ...`")
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise UserError("zero1 shards an optimizer before its first step: this one has state already")
    used = _nonempty_groups(optimizer)
    groups, defaults = _constructor_args(optimizer, used)
    zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
    # the keys the constructor does not take (a group's "name") are put back: ZeRO passes them to its local
    # optimizer's groups, and a checkpoint's groups then match those of the plain optimizer it may load into
    for mine, theirs in zip(zero.param_groups, used):
        _put_back(mine, theirs)
    return zero


def _constructor_args(optimizer: torch.optim.Optimizer,
                      groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``groups`` and ``optimizer``'s defaults with only the keys its class's ``__init__`` takes
    (the defaults also hold keys it does not take, a group may hold a "name")."""
    import inspect

    takes = inspect.signature(type(optimizer).__init__).parameters
    kept = [{k: v for k, v in g.items() if k == "params" or k in takes} for g in groups]
    defaults = {k: v for k, v in optimizer.defaults.items() if k in takes and k != "params"}
    return kept, defaults


def _nonempty_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [g for g in optimizer.param_groups if g["params"]]


def _put_back(group: dict[str, Any], original: dict[str, Any]) -> None:
    """The keys of ``original`` that ``group`` lacks, with their values."""
    for k, v in original.items():
        group.setdefault(k, v)
