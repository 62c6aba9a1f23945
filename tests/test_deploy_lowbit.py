"""I4: DoReFa / ternary / binary fake-quant modules still learn, and use only their few levels."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torch_tricks.deploy.lowbit import (
    BinaryConv2d,
    QuantConv2d,
    QuantLinear,
    TernaryConv2d,
    TernaryLinear,
    convert_lowbit,
    dorefa_weight,
    quantize_k,
)
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick

LOWBIT_TYPES = (QuantConv2d, QuantLinear, TernaryConv2d, TernaryLinear, BinaryConv2d)


@pytest.fixture(scope="module")
def digits():
    pytest.importorskip("sklearn")
    from torch_tricks.data.digits import load_dataset

    return load_dataset("digits")


@pytest.fixture
def one_thread():
    # Tiny models on shared cores: a second intra-op thread only spins (5x slower under load).
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _lowbit_layers(model):
    return [m for m in model.modules() if isinstance(m, LOWBIT_TYPES)]


@pytest.mark.parametrize("mode", ["dorefa", "ternary", "binary"])
def test_lowbit_small_cnn_learns_digits(mode, digits, one_thread):
    from torch_tricks.train.config import TrainConfig
    from torch_tricks.train.loop import fit

    train, val = digits
    model = convert_lowbit(get_model("small_cnn"), mode, bits=4)
    hist = fit(model, train, val, config=TrainConfig(epochs=4, batch_size=64, lr=3e-3, progress=False, device="cpu"))
    assert hist.final["acc"] >= 0.90, hist.final

    layers = _lowbit_layers(model)
    assert len(layers) == 2  # the two inner convs; first conv and fc stay fp32
    for layer in layers:
        q = layer.quantized_weight()
        if mode == "dorefa":
            assert q.unique().numel() <= 2**4
        elif mode == "ternary":
            assert q.unique().numel() <= 3
            assert q.unique().numel() == 3  # a trained layer uses all of -a, 0, +a
        else:
            for row in q.flatten(1):  # per output channel: -alpha_c, +alpha_c
                assert row.unique().numel() <= 2


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dorefa_weight_levels(bits):
    w = torch.randn(64, 32, 3, 3)
    q = dorefa_weight(w, bits)
    assert q.unique().numel() <= 2**bits
    assert q.unique().numel() > 2 ** (bits - 1)  # a Gaussian weight spreads over most levels
    assert q.abs().max() <= 1.0 + 1e-6


def test_straight_through_gradients_reach_latent_weights():
    x = torch.rand(8, 1, requires_grad=True)
    quantize_k(x, 2).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # STE: d round(x) / dx := 1
    for cls in (QuantConv2d, TernaryConv2d, BinaryConv2d):
        conv = cls(4, 8, 3, padding=1)
        conv(torch.rand(2, 4, 6, 6)).square().sum().backward()
        assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0


def test_ternary_threshold_and_scale_follow_twn():
    w = torch.tensor([[0.05, -0.1, 0.8, -1.2, 0.3, 0.0]])
    lin = TernaryLinear(6, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    delta = 0.7 * w.abs().mean()
    kept = w.abs() > delta
    alpha = w.abs()[kept].mean()
    expected = alpha * torch.sign(w) * kept
    torch.testing.assert_close(lin.quantized_weight(), expected)


def test_convert_keeps_first_last_and_leaves_input_unchanged():
    model = get_model("small_cnn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = convert_lowbit(model, "binary")
    assert type(out.features[0][0]) is nn.Conv2d and type(out.fc) is nn.Linear
    assert isinstance(out.features[1][0], BinaryConv2d)
    assert all(type(m) in (nn.Conv2d, nn.Linear) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    every = convert_lowbit(model, "dorefa", bits=2, skip_first_last=False)
    assert len(_lowbit_layers(every)) == 4
    # the first conv sees the (signed) input image: its activations are not clipped to [0, 1]
    assert every.features[0][0].bits_a == 32 and every.features[1][0].bits_a == 2


def test_convert_rejects_bad_arguments():
    model = get_model("small_cnn")
    with pytest.raises(UserError, match="mode must be"):
        convert_lowbit(model, "octal")
    with pytest.raises(UserError, match="bits must be"):
        convert_lowbit(model, "dorefa", bits=0)
    with pytest.raises(UserError, match="no nn.Conv2d"):
        convert_lowbit(nn.Sequential(nn.ReLU()), "binary")


def test_lowbit_tricks_registered():
    for name in ("lowbit_dorefa", "ternary_weights", "binary_weights"):
        trick = get_trick(name)
        assert trick.ids == ("I4",) and trick.kind == "train"
