"""``fit`` unchanged under torchrun: each rank trains on its DistributedSampler share.

Usage: torchrun --standalone --nproc_per_node=2 fit_ddp.py OUT_DIR
Rank 0 writes OUT_DIR/params.pt (the trained parameters) and OUT_DIR/done.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_train_fit_ddp import N, config, dataset, make_model  # noqa: E402

from torch_tricks.train import fit  # noqa: E402
from torch_tricks.train.distributed import cleanup  # noqa: E402

torch.set_num_threads(1)
out = Path(sys.argv[1])
model = make_model()
fit(model, dataset(), config=config(sync_bn=True))
if torch.distributed.get_rank() == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "params.pt")
    (out / "done").write_text(str(N))
cleanup()  # every rank leaves together
