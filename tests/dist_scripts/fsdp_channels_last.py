"""ddp and fsdp with channels_last on the same conv model and rank batches; rank 0 writes both losses and parameters.

Usage: torchrun --standalone --nproc_per_node=2 fsdp_channels_last.py OUT.pt
FSDP2 shards contiguous parameters only: under fsdp, channels_last converts the inputs alone.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_tricks.train.distributed import cleanup
from torch_tricks.train.loop import TrainStep

torch.set_num_threads(1)
out = {}
for mode in ("ddp", "fsdp"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    step = TrainStep(model, config={"distributed": mode, "channels_last": True, "optimizer": "adamw", "lr": 0.01,
                                    "device": "cpu", "seed": 0})
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    r = dist.get_rank()
    losses = [float(step((x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]))) for _ in range(4)]
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in step.model.state_dict().items()}
    out[mode] = {"losses": losses, "params": params, "applied": step.applied}
if dist.get_rank() == 0:
    torch.save(out, sys.argv[1])
cleanup()
