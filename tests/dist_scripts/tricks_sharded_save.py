"""Your own loop with Tricks under distributed = fsdp | zero1: save mid-run with tricks.save, resume with tricks.load.

Usage: torchrun --standalone --nproc_per_node=2 tricks_sharded_save.py MODE PHASE DIR
PHASE run: 6 steps, tricks.save(DIR/ckpt) after step 3; resume: a fresh Tricks, tricks.load(DIR/ckpt), steps 4-6.
Rank 0 writes DIR/PHASE.pt: the global losses (the mean over ranks) by step and the full parameters.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_train_sharded import make_model, tricks_batches  # noqa: E402

from torch_tricks import Tricks  # noqa: E402
from torch_tricks.train.distributed import cleanup, reduce_mean  # noqa: E402

torch.set_num_threads(1)
mode, phase, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
tricks = Tricks({"distributed": mode, "device": "cpu", "optimizer": "adamw", "lr": 0.01, "seed": 0})
model, optimizer = tricks.prepare(make_model())
rank = dist.get_rank()
ckpt = out / "ckpt"  # a DCP folder: every rank writes its shards
first = 0
if phase == "resume":
    tricks.load(ckpt)
    first = tricks.step_count
losses = {}
for i, (x, y) in enumerate(tricks_batches()):
    if i < first:
        continue
    with tricks.autocast():
        loss = F.cross_entropy(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4])
    tricks.backward(loss)
    tricks.step()
    losses[tricks.step_count] = float(reduce_mean(loss))
    if phase == "run" and tricks.step_count == 3:
        tricks.save(ckpt)
full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in tricks.unwrapped_model.state_dict().items()}
if rank == 0:
    torch.save({"losses": losses, "params": full}, out / f"{phase}.pt")
del tricks, model, optimizer  # DDP/ZeRO/FSDP hold the process group: gone before it is destroyed
gc.collect()
cleanup()
