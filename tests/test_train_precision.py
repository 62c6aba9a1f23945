"""T1 mixed precision: which precisions run where, autocast dtypes, the grad scaler, and
telling a skipped fp16 step apart so the lr scheduler is not stepped for it."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.train import precision as P
from torch_tricks.train.precision import (
    PRECISIONS,
    autocast,
    check_precision,
    cpu_has_bf16,
    make_grad_scaler,
    mixed_precision,
    normalize_precision,
    precision_available,
    scaler_step,
    step_was_skipped,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")
cpu_fp16 = pytest.mark.skipif(
    not P._cpu_autocast_works("fp16"), reason=f"torch {torch.__version__} has no fp16 autocast on CPU"
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops: one intra-op thread is faster, and immune to OpenMP spin-waiting on a
    shared machine (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_names_and_aliases():
    assert PRECISIONS == ("fp32", "bf16", "fp16")
    assert normalize_precision("bfloat16") == "bf16"
    assert normalize_precision("HALF") == "fp16"
    with pytest.raises(UserError, match="unknown precision 'fp8': choose one of fp32, bf16, fp16"):
        check_precision("fp8", "cpu")


def test_check_precision_on_cpu_follows_the_probe(monkeypatch):
    check_precision("fp32", "cpu")
    check_precision("bf16", "cpu")  # CPU autocast has had bf16 since torch 1.10
    if P._cpu_autocast_works("fp16"):
        check_precision("fp16", "cpu")
    # A torch whose CPU autocast rejects fp16: one clear line that names the way out.
    monkeypatch.setattr(P, "_cpu_autocast_works", lambda p: p != "fp16")
    with pytest.raises(UserError) as err:
        check_precision("fp16", "cpu")
    msg = str(err.value)
    assert "\n" not in msg and "fp16" in msg and "precision=bf16" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message when CUDA is absent")
def test_check_precision_cuda_without_cuda():
    with pytest.raises(UserError, match="no CUDA device"):
        check_precision("fp16", "cuda")


def test_autocast_dtypes_on_cpu():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast("fp32", "cpu"):
        assert (a @ b).dtype == torch.float32
    assert isinstance(autocast("fp32", "cpu"), contextlib.nullcontext)
    with autocast("bf16", "cpu"):
        assert (a @ b).dtype == torch.bfloat16
        assert (a @ b).float().sum().dtype == torch.float32  # ops outside the lists keep their dtype


@cpu_fp16
def test_autocast_fp16_on_cpu():
    with autocast("fp16", torch.device("cpu")):
        assert (torch.randn(4, 4) @ torch.randn(4, 4)).dtype == torch.float16


def test_grad_scaler_enabled_only_for_fp16():
    assert make_grad_scaler("fp16", "cpu").is_enabled()
    for p in ("fp32", "bf16"):
        s = make_grad_scaler(p, "cpu")
        assert not s.is_enabled()
        loss = torch.tensor(3.0)
        assert s.scale(loss) is loss


def _model_and_opt():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


@cpu_fp16
def test_skipped_fp16_step_is_reported_and_the_scheduler_waits():
    model, opt, sched = _model_and_opt()
    scaler = make_grad_scaler("fp16", "cpu")
    x = torch.randn(8, 4)
    w0 = model.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        # Step 1: an inf loss gives inf gradients: the scaler skips the step.
        with autocast("fp16", "cpu"):
            loss = model(x).float().sum() * float("inf")
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        assert scaler_step(scaler, opt) is False
        assert scaler.get_scale() < scale
        assert torch.equal(model.weight, w0)  # the optimizer did not step
        opt.zero_grad()
        # Step 2: a finite loss: the step is taken, and only now the scheduler steps.
        with autocast("fp16", "cpu"):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        assert scaler_step(scaler, opt) is True
        sched.step()
    assert not torch.equal(model.weight, w0)
    assert sched.last_epoch == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_disabled_scaler_always_steps():
    model, opt, _ = _model_and_opt()
    scaler = make_grad_scaler("bf16", "cpu")
    w0 = model.weight.detach().clone()
    model(torch.randn(8, 4)).sum().backward()
    assert scaler_step(scaler, opt) is True
    assert not torch.equal(model.weight, w0)
    assert step_was_skipped(scaler, 1.0) is False


def test_bf16_training_tracks_fp32():
    """A short regression fit under bf16 autocast ends close to the fp32 fit."""
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(256, 1)
    losses = {}
    for p in ("fp32", "bf16"):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        mp = mixed_precision(p, "cpu")
        opt = torch.optim.Adam(model.parameters(), lr=3e-2)
        for _ in range(60):
            with mp.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            mp.backward(loss)
            assert mp.step(opt)
        losses[p] = loss.item()
    assert losses["fp32"] < 0.1
    assert losses["bf16"] < 2 * losses["fp32"] + 0.02


@requires_cuda
def test_cuda_precisions():
    dev = torch.device("cuda")
    check_precision("fp16", dev)
    if torch.cuda.is_bf16_supported():
        check_precision("bf16", dev)
    with autocast("fp16", dev):
        assert (torch.randn(8, 8, device=dev) @ torch.randn(8, 8, device=dev)).dtype == torch.float16
    assert make_grad_scaler("fp16", dev).is_enabled()


def test_registered_and_available_on_cpu():
    from torch_tricks.registry import _TRICKS  # get_trick would import every train module

    t = _TRICKS["mixed_precision"]
    assert t.ids == ("T1",) and t.config_key == "precision" and t.kind == "train"
    ok, why = precision_available(torch.device("cpu"))
    assert ok
    assert isinstance(cpu_has_bf16(), bool)
    assert ("slower" in why) == (not cpu_has_bf16())
    mp = mixed_precision("bf16", "cpu")
    assert mp.dtype == torch.bfloat16 and not mp.scaler.is_enabled()
