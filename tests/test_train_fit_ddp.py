"""T18/T19 through fit itself: `torchrun --nproc_per_node=2` with gloo on CPU ends with the
parameters of a single-process run on the same global batches (tolerance 1e-5), BatchNorm
included thanks to SyncBN."""

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

N, PER_RANK, WORLD, SEED = 64, 8, 2, 3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


def config(**kw):
    from torch_tricks.train import TrainConfig

    return TrainConfig(epochs=2, batch_size=PER_RANK, optimizer="sgd", lr=0.1, momentum=0.9, seed=SEED,
                       progress=False, device="cpu", **kw)


def global_batches(per_rank=PER_RANK, epochs=2):
    """The global batches the two ranks see together, in DistributedSampler's order."""
    data = dataset()
    batches = []
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(SEED + epoch)
        order = torch.randperm(N, generator=g)
        shards = [order[r::WORLD] for r in range(WORLD)]
        for i in range(0, N // WORLD, per_rank):
            idx = torch.cat([p[i:i + per_rank] for p in shards])
            batches.append((data.tensors[0][idx], data.tensors[1][idx]))
    return batches


def test_fit_under_torchrun_equals_single_process(gloo_jobs):
    # fit_ddp.py ran in the session's shared torchrun launch (conftest.py: gloo_jobs)
    assert gloo_jobs.returncode == 0 and (gloo_jobs.fit / "done").exists(), gloo_jobs.log[-3000:]
    ddp = torch.load(gloo_jobs.fit / "params.pt")

    from torch_tricks.train import fit

    single = make_model()
    fit(single, global_batches(), config=config().replace(epochs=1))  # the list holds both epochs
    for k, v in single.state_dict().items():
        torch.testing.assert_close(ddp[k].to(v.dtype), v, rtol=0, atol=1e-5, msg=k)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_through_a_c10d_rendezvous_and_train_as_one_process(tmp_path):
    """Many machines, as on a cluster: `torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint
    HOST:PORT` on each node, here two agents on localhost with one process each; fit runs
    unchanged and ends with the single-process parameters."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    script = Path(__file__).parent / "dist_scripts" / "fit_ddp.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = []
    for _ in range(WORLD):  # one agent per "node", started independently, as on two hosts
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(WORLD), "--nproc_per_node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "tt-two-nodes", str(script),
               str(tmp_path)]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True))
    logs = []
    try:
        for proc in agents:
            logs.append(proc.communicate(timeout=180)[0])
    except subprocess.TimeoutExpired:
        for proc in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the two agents did not finish in 180 s")
    assert all(p.returncode == 0 for p in agents) and (tmp_path / "done").exists(), "\n---\n".join(
        log[-2000:] for log in logs)
    ddp = torch.load(tmp_path / "params.pt")

    from torch_tricks.train import fit

    single = make_model()
    fit(single, global_batches(), config=config().replace(epochs=1))
    for k, v in single.state_dict().items():
        torch.testing.assert_close(ddp[k].to(v.dtype), v, rtol=0, atol=1e-5, msg=k)
