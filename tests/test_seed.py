"""torch_tricks.seed: seeding, deterministic mode, DataLoader workers (T17, D11)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick
from torch_tricks import seed as seed_mod
from torch_tricks.seed import restore_determinism, seed_everything, seeded_generator, worker_init_fn

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


@pytest.fixture(autouse=True)
def _restore_global_state(monkeypatch):
    """Every test here changes process-wide switches: put them all back afterwards."""
    for key in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG"):
        monkeypatch.delenv(key, raising=False)  # records the original; restored at teardown
    det = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (det, warn):
        torch.use_deterministic_algorithms(det, warn_only=warn)  # slow the first time: imports inductor
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.set_rng_state(torch_state)


def _draws() -> tuple:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2, 2).tolist()


def test_same_seed_same_draws():
    info = seed_everything(123)
    assert os.environ["PYTHONHASHSEED"] == "123" and info["env"] == {"PYTHONHASHSEED": "123"}
    first = _draws()
    seed_everything(123)
    assert _draws() == first
    seed_everything(124)
    assert _draws() != first
    assert info["seeded"][:3] == ["random", "numpy", "torch"]
    assert info["deterministic"] is False


def test_deterministic_mode_toggles_and_restores(monkeypatch):
    # CUDA not started in this process (on a GPU machine an earlier test in the same worker may have started it)
    monkeypatch.setattr(seed_mod, "_cuda_initialized", lambda: False)
    before = torch.are_deterministic_algorithms_enabled()
    info = seed_everything(0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert info["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and info["problems"] == []
    assert info["previous"]["deterministic_algorithms"] is before
    restore_determinism(info)
    assert torch.are_deterministic_algorithms_enabled() is before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ

    seed_everything(0, deterministic=True, warn_only=True)
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_existing_cublas_setting_is_kept(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    info = seed_everything(0, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and "CUBLAS_WORKSPACE_CONFIG" not in info["env"]


def test_cuda_already_initialised_says_why(monkeypatch):
    monkeypatch.setattr(seed_mod, "_cuda_initialized", lambda: True)
    before = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(UserError, match="CUBLAS_WORKSPACE_CONFIG") as exc:
        seed_everything(0, deterministic=True)
    assert "\n" not in str(exc.value)
    assert torch.are_deterministic_algorithms_enabled() is before  # nothing changed
    info = seed_everything(0, deterministic=True, warn_only=True)
    assert len(info["problems"]) == 1 and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # set in time: no problem
    assert seed_everything(0, deterministic=True)["problems"] == []


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", True])
def test_bad_seed(bad):
    with pytest.raises(UserError):
        seed_everything(bad)


class _Draws(Dataset):
    """Each sample: which worker made it, that worker's torch seed, and its numpy/random draws."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        info = torch.utils.data.get_worker_info()
        return (
            -1 if info is None else info.id,
            torch.initial_seed(),
            float(np.random.rand()),
            random.random(),
            float(torch.rand(())),
        )


def _epoch(seed: int | None, epochs: int = 1) -> list[list[tuple]]:
    gen = None if seed is None else seeded_generator(seed)
    loader = DataLoader(_Draws(), batch_size=None, num_workers=2, worker_init_fn=worker_init_fn, generator=gen)
    return [[tuple(float(v) if isinstance(v, torch.Tensor) else v for v in s) for s in loader] for _ in range(epochs)]


def test_dataloader_workers_reproducible_and_distinct():
    run1 = _epoch(7, epochs=2)
    torch.rand(100)  # disturb the global RNG: the loader's generator must not care
    run2 = _epoch(7, epochs=2)
    assert run1 == run2  # two fresh loaders, same seed: same per-worker draws, both epochs
    assert run1[0] != run1[1]  # a new base seed per epoch
    assert _epoch(8) != run1[:1]

    samples = run1[0]
    by_worker = {w: [s[2:] for s in samples if s[0] == w] for w in (0, 1)}
    assert len(by_worker[0]) == len(by_worker[1]) == 4
    assert set(by_worker[0]).isdisjoint(by_worker[1])  # the workers draw different numbers
    # numpy really was seeded by worker_init_fn, from the worker's torch seed
    w0 = next(s for s in samples if s[0] == 0)
    expected = np.random.RandomState(np.random.SeedSequence(w0[1]).generate_state(4)).rand()
    assert w0[2] == expected


def test_seeded_generator():
    a, b = seeded_generator(3), seeded_generator(3)
    assert torch.equal(torch.randperm(10, generator=a), torch.randperm(10, generator=b))
    with pytest.raises(UserError):
        seeded_generator(-2)


def test_registered():
    t = get_trick("deterministic")
    assert t.fn is seed_everything and t.ids == ("T17",) and t.config_key == "deterministic"


@requires_cuda
def test_cuda_initialised_first_is_refused_in_a_fresh_process():
    code = (
        "import torch; torch.zeros(1, device='cuda')\n"
        "from torch_tricks.seed import seed_everything\n"
        "from torch_tricks.errors import UserError\n"
        "try:\n    seed_everything(0, deterministic=True)\nexcept UserError:\n    print('refused')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "refused" in out.stdout, out.stderr
