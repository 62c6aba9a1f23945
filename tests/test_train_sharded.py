"""T18 sharded: ``distributed = zero1`` (DDP + ZeroRedundancyOptimizer) and ``fsdp`` (FSDP2
``fully_shard`` per repeated block) on 2 ranks (gloo, CPU) end with the parameters of a
single-process run on the same global batches (atol 1e-5), plain and with checkpointing +
accumulate=2; bad use is one line."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from torch_tricks.errors import UserError

N, PER_RANK, WORLD, SEED = 64, 8, 2, 3
VARIANTS = {"plain": {}, "checkpointing-accumulate2": {"checkpointing": "blocks", "accumulate": 2},
            "ema": {"ema": True, "ema_decay": 0.9}}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Sequential(Block(16), Block(16), Block(16)), nn.Linear(16, 3))


def dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


def config(**kw):
    from torch_tricks.train import TrainConfig

    return TrainConfig(epochs=2, batch_size=PER_RANK, optimizer="adamw", lr=0.01, weight_decay=0.01, seed=SEED,
                       progress=False, device="cpu", **kw)


def global_batches():
    """The global batches the two ranks see together, in DistributedSampler's order."""
    data = dataset()
    batches = []
    for epoch in range(2):
        g = torch.Generator().manual_seed(SEED + epoch)
        order = torch.randperm(N, generator=g)
        per_rank = [order[r::WORLD] for r in range(WORLD)]
        for i in range(0, N // WORLD, PER_RANK):
            idx = torch.cat([p[i:i + PER_RANK] for p in per_rank])
            batches.append((data.tensors[0][idx], data.tensors[1][idx]))
    return batches


def _torchrun(script: Path, *args: str, timeout: float = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", str(script),
           *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s; log tail:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.mark.parametrize("mode", ["zero1", "fsdp"])
def test_sharded_fit_on_two_ranks_equals_single_process(tmp_path, mode):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    log = _torchrun(Path(__file__).parent / "dist_scripts" / "fit_sharded.py", mode, str(tmp_path))
    assert (tmp_path / "done").exists(), log[-3000:]

    from torch_tricks.train import fit

    for name, extra in VARIANTS.items():
        sharded = torch.load(tmp_path / f"{name}.pt")
        single = make_model()
        h = fit(single, global_batches(), dataset(), config=config(**extra).replace(epochs=1))  # the list: both epochs
        for k, v in single.state_dict().items():
            torch.testing.assert_close(sharded[k].to(v.dtype), v, rtol=0, atol=1e-5, msg=f"{name}: {k}")
        if extra.get("ema"):  # the average of the sharded parameters, evaluated on the ranks' validation shards
            assert h.final["loss_ema"] == pytest.approx(sharded["final"]["loss_ema"], rel=1e-5)


@pytest.mark.parametrize("mode", ["ddp", "zero1", "fsdp"])
def test_a_sharded_mode_without_torchrun_is_one_line(mode, monkeypatch, capsys):
    from torch_tricks import Tricks
    from torch_tricks.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match=f"distributed = {mode} needs several processes: launch with `torchrun"):
        Tricks({"distributed": mode, "device": "cpu"})
    assert main(["train", "--model", "small_cnn", "--data", "digits", "--distributed", mode, "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs several processes" in err, err


def test_unknown_distributed_mode_is_a_config_error():
    from torch_tricks.train import TrainConfig

    with pytest.raises(UserError, match="distributed must be auto, ddp, zero1, fsdp or off, not 'zero3'"):
        TrainConfig(distributed="zero3").validate()
