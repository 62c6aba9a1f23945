"""T28 under DDP and FSDP: ``fit`` with ``chunked_lm_loss`` on 2 gloo ranks, every rank on the same batches.

Usage: torchrun --standalone --nproc_per_node=2 lm_loss_ddp.py OUT_DIR
Rank 0 writes OUT_DIR/params.pt (the trained parameters) and OUT_DIR/applied.txt (the switches fit applied,
and whether a forward with labels through DDP returned no logits: the chunked loss served it); then the same
fit under FSDP (SGD: its fused step has no sharded form, foreach serves) writes OUT_DIR/fsdp_params.pt (the
full parameters) and OUT_DIR/fsdp_applied.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from test_train_lm_loss import _batch, _model  # noqa: E402

from torch_tricks.train import TrainConfig, fit  # noqa: E402
from torch_tricks.train.distributed import cleanup  # noqa: E402

torch.set_num_threads(1)
out = Path(sys.argv[1])
model = _model("gpt2")
h = fit(model, [_batch() for _ in range(3)], config=TrainConfig(epochs=1, optimizer="sgd", lr=0.1, device="cpu",
                                                                progress=False, chunked_lm_loss=True, distributed="ddp"))
wrapped = torch.nn.parallel.DistributedDataParallel(model.train())  # the hooks fire through DDP's forward too
logits_none = wrapped(**_batch()).logits is None
if torch.distributed.get_rank() == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "params.pt")
    (out / "applied.txt").write_text(",".join(h.applied) + f"\nlogits None under DDP: {logits_none}")
del wrapped
sharded = _model("gpt2")
hf = fit(sharded, [_batch() for _ in range(3)], config=TrainConfig(epochs=1, optimizer="sgd", lr=0.1, device="cpu",
                                                                  progress=False, chunked_lm_loss=True,
                                                                  distributed="fsdp"))
full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in sharded.state_dict().items()}
if torch.distributed.get_rank() == 0:
    torch.save(full, out / "fsdp_params.pt")
    (out / "fsdp_applied.txt").write_text(",".join(hf.applied))
cleanup()
