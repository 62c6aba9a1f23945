"""ddp and fsdp on the same conv model and rank batches, for switches FSDP2 needs wiring for; rank 0 writes
both runs' losses and parameters per variant.

Usage: torchrun --standalone --nproc_per_node=2 fsdp_vs_ddp.py OUT.pt
channels_last: FSDP2 shards contiguous parameters only, so under fsdp the inputs alone go channels_last.
bf16 (a model with BatchNorm): FSDP casts parameters, not the fp32 running statistics beside them, so BatchNorm
is sharded on its own in fp32, as autocast runs it under ddp.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_tricks.train.distributed import cleanup
from torch_tricks.train.loop import TrainStep

VARIANTS = {"channels_last": ({"channels_last": True}, False), "bf16-batchnorm": ({"precision": "bf16"}, True)}


def make_model(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    norm = (lambda c: nn.BatchNorm2d(c)) if bn else (lambda c: nn.Identity())
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), norm(8),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


torch.set_num_threads(1)
out = {}
for variant, (switches, bn) in VARIANTS.items():
    for mode in ("ddp", "fsdp"):
        step = TrainStep(make_model(bn), config={"distributed": mode, "optimizer": "adamw", "lr": 0.01,
                                                 "device": "cpu", "seed": 0, **switches})
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        r = dist.get_rank()
        losses = [float(step((x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]))) for _ in range(4)]
        params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                  for k, v in step.model.state_dict().items()}
        out[variant, mode] = {"losses": losses, "params": params, "applied": step.applied}
# a NaN on one rank only: every rank stops at the same step (one all-reduce decides), none waits for the other
from torch_tricks.train.tricks import TrainingDiverged  # noqa: E402

for mode in ("fsdp", "zero1"):
    step = TrainStep(make_model(False), config={"distributed": mode, "optimizer": "adamw", "device": "cpu", "seed": 0})
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    stopped = None
    for i in range(1, 4):
        xi = x.clone()
        if i == 2 and dist.get_rank() == 1:
            xi[0, 0, 0, 0] = float("nan")
        try:
            step((xi, y))
        except TrainingDiverged as exc:
            stopped = (i, str(exc))
            break
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, stopped)
    out["nan", mode] = everyone
if dist.get_rank() == 0:
    torch.save(out, sys.argv[1])
del step  # DDP/ZeRO/FSDP hold the process group: gone before it is destroyed
gc.collect()
cleanup()
