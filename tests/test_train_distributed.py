"""Tests for torch_tricks.train.distributed and torch_tricks.train.syncbn (catalogue T18, T19, T20).

The multi-process checks run once per session: ``torchrun --standalone`` starts 2 CPU
processes with gloo on tests/dist_scripts/dist_checks.py (the ``gloo_jobs`` fixture of
conftest.py, see tests/torchrun_launch.py), each rank writes its measurements as JSON, and
the tests below assert on them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_tricks.train.distributed as D
from torch_tricks.errors import UserError
from torch_tricks.train.syncbn import CPUSyncBatchNorm, convert_sync_batchnorm

TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(gloo_jobs):
    """The per-rank result dicts of the 2-process gloo checks (run in the session's shared launch)."""
    results = []
    for r in range(2):
        f = gloo_jobs.checks / f"rank{r}.json"
        assert f.is_file(), f"rank {r} wrote no result (exit {gloo_jobs.returncode}); log tail:\n{gloo_jobs.log[-3000:]}"
        res = json.loads(f.read_text())
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
        results.append(res)
    assert gloo_jobs.returncode == 0, gloo_jobs.log[-3000:]
    return results


# --------------------------------------------------------------------------- 2 processes, gloo


def test_launch_info(ranks):
    for r, res in enumerate(ranks):
        info = res["info"]
        assert info == {"rank": r, "world_size": 2, "local_rank": r, "device": "cpu", "is_main": r == 0,
                        "initialized": True, "backend": "gloo"}


@pytest.mark.parametrize("kind", ["2d", "1d_uneven"])
def test_cpu_syncbn_matches_batchnorm_over_global_batch(ranks, kind):
    for res in ranks:
        d = res["syncbn"][kind]
        for name in ("y", "dx", "dw", "db", "running_mean", "running_var", "eval"):
            assert d[name] < TOL, (kind, name, d[name])
        assert d["num_batches_tracked"] == 0


@pytest.mark.parametrize("variant", ["plain", "syncbn", "accumulate"])
def test_ddp_two_ranks_equal_single_process_full_batch(ranks, variant):
    for res in ranks:
        d = res["ddp"][variant]
        assert d["param"] < TOL and d["buffer"] < TOL, d
        assert d["syncbn_used"] == (variant == "syncbn")


def test_ddp_plain_batchnorm_differs_so_the_check_has_teeth(ranks):
    # per-rank BatchNorm statistics differ from the global batch's: SyncBN is what makes them match
    assert all(res["ddp"]["bn_unsynced"]["param"] > 1e-4 for res in ranks)


def test_collective_decisions_agree(ranks):
    for res in ranks:
        c = res["collectives"]
        assert c["any_rank_one_true"] is True
        assert c["all_agree_one_true"] is False
        assert c["all_agree_all_true"] is True
        assert c["any_rank_all_false"] is False
        assert c["reduce_mean"] == pytest.approx(0.5) and c["reduce_mean_int"] == pytest.approx(0.5)
        assert c["all_reduce_sum"] == [3, 20]


def test_checkpoint_save_rank0_barrier_load_everywhere(ranks):
    for res in ranks:
        c = res["checkpoint"]
        assert c["exists_after_return"], "save_checkpoint returned before rank 0 had written"
        assert c["latest"].endswith("step3.pt")
        assert c["plain_param"] == 0.0 and c["plain_complete"]
        assert c["ddp_param"] == 0.0 and c["ddp_complete"]
        assert c["opt_restored"] and c["momentum"] == 0.0
        assert c["restored"] == ["model", "rng"]
        assert c["position"] == [3, 1, 1, 1]
        assert c["rng_same_stream"], "each rank must get its own RNG state back"
        assert c["rng_ranks_differ"]


# --------------------------------------------------------------------------- single process


@pytest.fixture
def no_launcher_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_init_distributed_without_torchrun_is_a_noop(no_launcher_env):
    info = D.init_distributed()
    assert info == D.DistInfo(device=info.device)
    assert (info.rank, info.world_size, info.is_main, info.initialized) == (0, 1, True, False)
    assert not torch.distributed.is_initialized()
    assert D.is_main_process() and D.get_world_size() == 1
    D.barrier()  # no group: returns at once
    D.cleanup()
    assert D.all_agree(True) and not D.all_agree(False)
    assert D.any_rank(True) and not D.any_rank(False)
    t = torch.tensor([1.5, 2.0], requires_grad=True)
    m = D.reduce_mean(t)
    assert torch.equal(m, t.detach()) and not m.requires_grad
    assert torch.equal(D.all_reduce_sum(torch.tensor([2, 3])), torch.tensor([2, 3]))


def test_init_distributed_bad_env_is_a_user_error(no_launcher_env, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="MASTER_ADDR"):
        D.init_distributed()
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(UserError, match="RANK='zero'"):
        D.init_distributed()


def test_single_process_helpers(no_launcher_env):
    info = D.init_distributed()
    model = nn.Linear(3, 2)
    assert D.wrap_ddp(model, info) is model  # nothing to synchronise with
    assert isinstance(D.no_sync_if(model, True), contextlib.nullcontext)
    ds = torch.utils.data.TensorDataset(torch.arange(10.0))
    s = D.distributed_sampler(ds, info, shuffle=False)
    assert list(s) == list(range(10))
    compiled_like = nn.DataParallel(model)
    assert D.unwrap_model(compiled_like) is model
    with pytest.raises(UserError, match="DataParallel"):
        D.wrap_ddp(compiled_like, info)


def test_cpu_syncbn_without_group_is_exactly_batchnorm2d():
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4, momentum=None)  # cumulative average, the harder case
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.normal_()
    sync = CPUSyncBatchNorm(4, momentum=None)
    sync.load_state_dict(ref.state_dict())
    for _ in range(3):
        x = torch.randn(6, 4, 5, 5) * 2 + 1
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        g = torch.randn_like(x)
        ref.zero_grad()
        sync.zero_grad()
        yr, ys = ref(xr), sync(xs)
        (yr * g).sum().backward()
        (ys * g).sum().backward()
        assert torch.equal(yr, ys) and torch.equal(xr.grad, xs.grad)
        assert torch.equal(ref.weight.grad, sync.weight.grad) and torch.equal(ref.bias.grad, sync.bias.grad)
    for a, b in zip(ref.state_dict().values(), sync.state_dict().values()):
        assert torch.equal(a, b)
    ref.eval()
    sync.eval()
    x = torch.randn(2, 4, 3, 3)
    assert torch.equal(ref(x), sync(x))


def test_convert_sync_batchnorm_on_cpu_keeps_tensors_and_keys():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2),
                          nn.BatchNorm1d(2, affine=False))
    model(torch.randn(2, 3, 6, 6))  # materialise the lazy layer
    keys = list(model.state_dict())
    weight = model[1].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # auto picks ours for a CPU model on a machine without CUDA (with CUDA, torch's: the model will move there)
    out = convert_sync_batchnorm(model, impl="auto" if not torch.cuda.is_available() else "cpu")
    assert isinstance(out[1], CPUSyncBatchNorm) and isinstance(out[5], CPUSyncBatchNorm)
    assert out[1].weight is weight  # an optimizer built before the conversion still updates it
    assert list(out.state_dict()) == keys
    assert out[5].weight is None
    assert any(p is weight for g in opt.param_groups for p in g["params"])
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm1d(3), impl="cpu"), CPUSyncBatchNorm)  # a bare BN is replaced
    with pytest.raises(UserError, match="impl"):
        convert_sync_batchnorm(model, impl="apex")


def test_registered_tricks():
    from torch_tricks.registry import get_trick

    assert get_trick("ddp").ids == ("T18",) and get_trick("ddp").config_key == "distributed"
    assert get_trick("sync_batchnorm").ids == ("T19",) and get_trick("sync_batchnorm").config_key == "sync_bn"


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


@requires_cuda
@pytest.mark.cuda
def test_convert_uses_torch_syncbn_for_cuda_models():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).cuda()
    out = convert_sync_batchnorm(model)
    assert isinstance(out[1], nn.SyncBatchNorm)
    assert isinstance(convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)).cuda(), impl="cpu")[0], CPUSyncBatchNorm)


def _worker_pid(token: str, rank: int, timeout: float = 60.0) -> int:
    """The pid of the torchrun worker of ``rank`` whose environment carries ``token``."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"TT_TEST_TOKEN={token}".encode() in env and f"RANK={rank}".encode() in env \
                    and b"TORCHELASTIC_RUN_ID=" in b" ".join(env) and f"LOCAL_RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.2)
    pytest.fail(f"no worker of rank {rank} appeared in {timeout} s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the worker to kill")
def test_kill_9_of_one_rank_mid_epoch_stops_the_other_with_one_line_naming_it(tmp_path):
    import time
    import uuid

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TT_TEST_TOKEN=token)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "torch_tricks.cli", "train", "--model", "small_cnn", "--data", "digits", "--epochs", "10000",
           "--no-progress", "--log-every", "1000", "--checkpoint-dir", "ckpt", "--checkpoint-every", "5",
           "--device", "cpu"]  # gloo ranks on a GPU machine too (auto would put both on its one GPU)
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        victim = _worker_pid(token, 1)
        deadline = time.monotonic() + 120
        while not (tmp_path / "ckpt" / "last.pt").exists():  # training is under way (a loaded machine starts late)
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended or 120 s"
            time.sleep(0.2)
        time.sleep(1)  # mid-epoch, past a checkpoint
        assert proc.poll() is None, "the run ended before the kill"
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        log, _ = proc.communicate(timeout=90)
        took = time.monotonic() - killed
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert took < 60, f"the other rank took {took:.0f} s to stop"
    lines = [line for line in log.splitlines() if "rank 1 of 2 was lost at step" in line]
    assert len(lines) == 1 and lines[0].startswith("torch-tricks: error: rank 1 of 2 was lost at step"), log[-3000:]
    assert "last complete checkpoint: ckpt/last.pt (step " in lines[0], lines[0]  # still there to resume from
    assert proc.returncode != 0
