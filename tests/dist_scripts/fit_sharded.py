"""``fit`` under torchrun with distributed = zero1 | fsdp, plain and with checkpointing + accumulate=2.

Usage: torchrun --standalone --nproc_per_node=2 fit_sharded.py MODE OUT_DIR
Rank 0 writes OUT_DIR/VARIANT.pt (the full trained parameters) for each variant, then OUT_DIR/done.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_train_sharded import VARIANTS, config, dataset, make_model  # noqa: E402

from torch_tricks.train import fit  # noqa: E402
from torch_tricks.train.distributed import cleanup  # noqa: E402

torch.set_num_threads(1)
mode, out = sys.argv[1], Path(sys.argv[2])
for name, extra in VARIANTS.items():
    model = make_model()
    history = fit(model, dataset(), dataset(), config=config(distributed=mode, **extra))
    assert mode in history.applied, history.applied
    full = {}
    for k, v in model.state_dict().items():  # FSDP: DTensor shards, gathered on every rank
        full[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    if dist.get_rank() == 0:
        torch.save({**full, "final": dict(history.final)}, out / f"{name}.pt")
if dist.get_rank() == 0:
    (out / "done").write_text("ok")
cleanup()
