"""The device floor: one reading of a device name everywhere, one line when it cannot be served.

The GPU-machine cases (CUDA present, too few devices, a CPU run on a machine with GPUs) are
played here on the CPU by making torch report CUDA devices: the first suite run on a real
GPU (an H100, 2026-11-25) found each of them broken, and CI has none.
"""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

from torch_tricks.device import check_available, module_device, no_cuda_message, parse, resolve, synchronize
from torch_tricks.errors import UserError


@pytest.fixture
def one_gpu(monkeypatch):
    """torch reports one CUDA device (nothing is run on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cuda_where_there_is_one_else_cpu(one_gpu):
    assert resolve("auto") == torch.device("cuda") == resolve(None) == resolve(" AUTO ")


def test_auto_without_cuda_is_the_cpu(no_gpu):
    assert resolve("auto") == torch.device("cpu")
    assert resolve("cpu") == torch.device("cpu") and resolve(torch.device("cpu")) == torch.device("cpu")


def test_cuda_without_cuda_is_one_line_naming_the_option(no_gpu):
    for name in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(UserError) as err:
            resolve(name, what="--device")
        assert str(err.value) == "--device cuda asked for, but this torch sees no CUDA device: use --device cpu"
    assert no_cuda_message() == "device cuda asked for, but this torch sees no CUDA device: use device='cpu'"


def test_an_index_past_the_last_device_is_one_line_not_cudas_invalid_ordinal(one_gpu):
    assert resolve("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(UserError, match=r"^--device cuda:7 asked for, but this machine has 1 CUDA device\(s\): "
                                        r"use cuda:0, or cpu$"):
        resolve("cuda:7", what="--device")


def test_unknown_names_are_one_line(no_gpu):
    for bad in ("gpu", "cuda:x", "", 3.5):
        with pytest.raises(UserError, match="unknown device .*use auto, cpu, cuda or cuda:N"):
            resolve(bad)
    with pytest.raises(UserError, match="unknown device"):
        parse("tpu0")


def test_parse_does_not_check_the_machine(no_gpu):
    """A timer may be set up for a device before it is used: parse reads the name only."""
    assert parse("cuda:1") == torch.device("cuda", 1)
    check_available(torch.device("cpu"))  # the CPU is always there


def test_module_device_and_its_fallback():
    assert module_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert module_device(nn.ReLU(), [torch.zeros(1, device="meta")]) == torch.device("meta")
    assert module_device(nn.ReLU()) == torch.device("cpu")
    bn = nn.BatchNorm1d(2, affine=False).to("meta")  # buffers only
    assert module_device(bn) == torch.device("meta")


def test_synchronize_is_a_no_op_on_the_cpu():
    synchronize("cpu")
    synchronize(torch.device("meta"))
    synchronize(None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cpu_run_under_torchrun_on_a_gpu_machine_uses_gloo(one_gpu, monkeypatch):
    """device='cpu' under torchrun on a machine with GPUs: gloo on the CPU, not NCCL on a GPU (the
    second rank on a one-GPU machine failed with 'LOCAL_RANK=1 but only 1 CUDA device(s)')."""
    from torch_tricks.train.distributed import cleanup, init_distributed

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("a CPU run must not pick a GPU"))
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    info = init_distributed(timeout=30, device="cpu")
    try:
        assert info.initialized and info.backend == "gloo" and info.device == torch.device("cpu")
        assert init_distributed(device="cpu").device == torch.device("cpu")  # the group's info: gloo, so the CPU
    finally:
        cleanup()


def test_auto_under_torchrun_with_too_few_gpus_is_one_line(one_gpu, monkeypatch):
    from torch_tricks.train.distributed import init_distributed

    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match="LOCAL_RANK=1 but only 1 CUDA device"):
        init_distributed(device="auto")


def test_determinism_on_the_cpu_does_not_care_that_cuda_started(monkeypatch):
    """cuBLAS cannot make a CPU run nondeterministic: a CPU run in a process where CUDA has started
    (another test, another library) is not refused."""
    import torch_tricks.seed as S

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(S, "_cuda_initialized", lambda: True)
    with pytest.raises(UserError, match="CUDA was initialised before CUBLAS_WORKSPACE_CONFIG"):
        S.seed_everything(0, deterministic=True)
    done = S.seed_everything(0, deterministic=True, device="cpu")
    try:
        assert done["deterministic"] and not done["problems"] and torch.are_deterministic_algorithms_enabled()
    finally:
        S.restore_determinism(done)


def test_fsdp_on_the_cpu_of_a_gpu_machine_shards_on_a_cpu_mesh(monkeypatch):
    """FSDP2's default mesh is on the machine's accelerator: on a GPU machine a CPU (gloo) run's second
    rank asked for cuda:1 ("invalid device ordinal" on the H200). shard_fsdp builds the mesh on the
    model's device. Played here by making torch report a CUDA accelerator."""
    import torch.distributed as dist

    from torch_tricks.train.sharding import shard_fsdp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
        model = shard_fsdp(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        model(torch.randn(3, 4)).sum().backward()
        assert all(p.device.type == "cpu" for p in model.parameters())
    finally:
        dist.destroy_process_group()
