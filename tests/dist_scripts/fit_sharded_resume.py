"""``fit`` under torchrun with distributed = fsdp and a DCP checkpoint_dir.

Usage: torchrun --standalone --nproc_per_node=2 fit_sharded_resume.py PHASE CKPT_DIR OUT_FILE [MODE]
PHASE: whole (all steps), resume (from CKPT_DIR), killsave (a checkpoint every step; rank 0 is killed with SIGKILL while saving step RESUME_STOP + 1: every
rank's shards are written, the pointer is not yet moved to them).
Rank 0 writes OUT_FILE: the full parameters and rank 0's logged train losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_train_sharded import RESUME_STOP, resume_config, dataset, make_model  # noqa: E402

from torch_tricks.train import fit  # noqa: E402
from torch_tricks.train.distributed import cleanup  # noqa: E402

torch.set_num_threads(1)
phase, ckpt, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "fsdp"
extra = {"resume": True} if phase == "resume" else {}
if phase == "killsave":
    import os
    import signal

    from torch_tricks.train import sharded_checkpoint

    class _KillOnPointer:
        """os, but moving the pointer to step RESUME_STOP + 1 kills this process first (as a power cut would)."""

        def __getattr__(self, name):
            return getattr(os, name)

        def replace(self, src, dst):
            if f"step-{RESUME_STOP + 1:08d}" in Path(src).read_text():
                os.kill(os.getpid(), signal.SIGKILL)
            return os.replace(src, dst)

    sharded_checkpoint.os = _KillOnPointer()
    extra = {"checkpoint_every": 1, "max_steps": RESUME_STOP + 2}
model = make_model()
history = fit(model, dataset(), config=resume_config(distributed=mode, checkpoint_dir=ckpt, **extra))
full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
if dist.get_rank() == 0:
    losses = [(r["step"], r["loss"]) for r in history.rows if r["split"] == "train"]
    torch.save({"params": full, "losses": losses, "resumed_from": history.resumed_from_step}, out)
cleanup()
