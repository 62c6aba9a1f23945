"""T37, float8 training (issue 36): which Linear layers it takes, refused in one line where it cannot run (a CPU:
no float8 tensor cores), and the conversion itself (torchao's) checked on a CPU, where torch can run the float8
matmuls slowly: parameters kept, losses near fp32's."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import torch_tricks.train.float8 as f8
from torch_tricks._optional import available
from torch_tricks.errors import UserError
from torch_tricks.train import Tricks

_FLOAT8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= f8.FLOAT8_CAPABILITY
_TORCHAO = available("torchao.float8")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def test_it_takes_the_linear_layers_whose_dimensions_are_multiples_of_16():
    names, total = f8.float8_linears(_net())
    assert names == ["0", "2"] and total == 3  # the 64 -> 10 head stays as it is


def test_a_cpu_is_refused_in_one_line_before_the_model_changes():
    ok, why = f8.float8_available("cpu")
    assert not ok and "capability 8.9+" in why and "5.5x slower than fp32" in why
    model = _net()
    with pytest.raises(UserError, match="^float8: float8 training needs float8 tensor cores"):
        Tricks({"float8": True, "device": "cpu", "inplace": True}).prepare(model)
    assert all(type(m) is nn.Linear for m in model if isinstance(m, nn.Linear))
    assert all(not m.inplace for m in model if isinstance(m, nn.ReLU))  # nothing else applied either


def test_train_float8_on_a_cpu_is_exit_2(capsys):
    from torch_tricks.cli import main

    assert main(["train", "--model", "mlp", "--max-steps", "1", "--no-progress", "--float8"]) == 2
    err = capsys.readouterr().err
    assert "float8 training needs float8 tensor cores" in err and err.count("\n") == 1, err


@pytest.mark.skipif(not _TORCHAO, reason="needs torchao (pip install 'torch-tricks[float8]')")
def test_the_conversion_keeps_the_parameters_and_the_loss_near_fp32s(monkeypatch):
    """The conversion path with the device check answered yes: on a CPU torch runs float8 matmuls (slowly), so
    what the conversion does is checked here; the speed is the GPU's question."""
    monkeypatch.setattr(f8, "float8_available", lambda device: (True, ""))
    ref, model = _net(), _net()
    params = list(model.parameters())
    out, n, total = f8.float8_training(model, "cpu")
    assert out is model and (n, total) == (2, 3)
    assert [type(m).__name__ for m in model if not isinstance(m, nn.ReLU)] == ["Float8Linear", "Float8Linear", "Linear"]
    assert list(model.parameters()) == params  # the same tensors: an optimizer built before still steps them
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss8 = nn.functional.cross_entropy(model(x), y)
        loss8.backward()
    loss32 = nn.functional.cross_entropy(ref(x), y)
    loss32.backward()
    assert loss8.item() == pytest.approx(loss32.item(), rel=0.02)  # e4m3 products: about 2 significant digits
    # the output gradients in e5m2 (2 mantissa bits), through two float8 layers: the first layer's weight gradient
    # points the same way (cosine 0.97 here), not digit for digit (25% of its norm apart)
    g8, g32 = model[0].weight.grad.flatten(), ref[0].weight.grad.flatten()
    assert float(nn.functional.cosine_similarity(g8, g32, dim=0)) > 0.95


def test_none_to_take_is_one_line(monkeypatch):
    monkeypatch.setattr(f8, "float8_available", lambda device: (True, ""))
    with pytest.raises(UserError, match="none of the model's 1 Linear layers"):
        f8.float8_training(nn.Linear(10, 3), "cpu")


def test_the_tune_says_why_it_does_not_measure_it_here():
    from torch_tricks.tuning.candidates import training_candidates

    cands, skipped = training_candidates(_net(), (torch.randn(2, 64),), torch.device("cpu"), batch=2)
    assert "float8" not in {c.name for c in cands}
    assert "capability 8.9+" in {s.name: s.reason for s in skipped}["float8"]


@pytest.mark.skipif(not (_FLOAT8_GPU and _TORCHAO), reason="needs a CUDA GPU of capability 8.9+ and torchao")
def test_float8_trains_near_bf16_on_a_float8_gpu():
    def losses(cfg: dict) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
        tricks = Tricks({**cfg, "precision": "bf16", "device": "cuda", "progress": False})
        model, opt = tricks.prepare(model)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 256, generator=g).cuda()
        out = []
        for _ in range(5):
            with tricks.autocast():
                loss = (model(x) - x).pow(2).mean()
            tricks.backward(loss)
            tricks.step()
            out.append(loss.item())
        if cfg:
            assert "float8 (2 of 2 Linear layers)" in tricks.applied
        return out

    assert losses({"float8": True}) == pytest.approx(losses({}), rel=0.05)
