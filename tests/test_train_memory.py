"""T9 inplace activations, T10 memory-efficient BN+activation, T12 checkpointing: behaviour
(exact gradients, running statistics, state_dict keys) and measured saved-activation bytes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.inspect.memory import saved_activation_bytes
from torch_tricks.models import get_model
from torch_tricks.train.memory import (
    MemoryEfficientBNAct,
    checkpoint_blocks,
    checkpoint_sequential_sqrt,
    checkpointed_names,
    inplace_activations,
    memory_efficient_bn_act,
)


@pytest.fixture(autouse=True, scope="module")
def _quick_cpu():
    """Two settings that only change speed, restored afterwards (both sides of every
    comparison run under them): the backward passes of these untrained nets produce
    denormal floats, which make x86 CPUs up to 10x slower, so they are flushed to zero;
    and one intra-op thread, because on a shared 2-core machine two OpenMP threads that
    spin-wait for each other made ResNet-50 steps 50x slower (6.8 s instead of 0.13 s)."""
    threads = torch.get_num_threads()
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_step(model: nn.Module, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    (out.float() ** 2).mean().backward()
    return out.detach()


def _assert_same_training(a: nn.Module, b: nn.Module, x: torch.Tensor, atol: float = 1e-5) -> None:
    """One training step on each: same output, same gradients, same buffers afterwards."""
    out_a, out_b = _train_step(a, x), _train_step(b, x)
    torch.testing.assert_close(out_a, out_b, atol=atol, rtol=1e-5)
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=atol, rtol=1e-5, msg=f"gradient of {k}")
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=1e-5, msg=f"state {k}")


def _not_inplace(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if hasattr(m, "inplace") and isinstance(m, (nn.ReLU, nn.ReLU6)):
            m.inplace = False
    return model


# -- T9 ---------------------------------------------------------------------------------------

class Mixed(nn.Module):
    """One activation of each kind: safe after conv/bn, unsafe on the graph input, on a
    tensor read twice (residual), and after sigmoid (which saves its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_input = nn.ReLU()  # unsafe: would overwrite the caller's tensor
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.after_bn = nn.ReLU()  # safe
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.on_shared = nn.LeakyReLU(0.1)  # unsafe: conv2's output is also added later
        self.after_sigmoid = nn.ELU()  # unsafe: sigmoid's backward reads its output
        self.head = nn.Linear(8, 4)
        self.after_linear = nn.SiLU()  # safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.on_input(x)
        h = self.after_bn(self.bn(self.conv(x)))
        r = self.conv2(h)
        s = self.on_shared(r) + r
        s = self.after_sigmoid(torch.sigmoid(s))
        return self.after_linear(self.head(s.mean((2, 3))))


def test_inplace_only_where_safe_and_gradients_unchanged():
    model = Mixed()
    ref = copy.deepcopy(model)
    _, n = inplace_activations(model, return_count=True)
    assert n == 2
    assert model.after_bn.inplace and model.after_linear.inplace
    assert not model.on_input.inplace and not model.on_shared.inplace and not model.after_sigmoid.inplace
    x = torch.randn(2, 3, 8, 8)
    x_copy = x.clone()
    _assert_same_training(ref, model, x)
    assert torch.equal(x, x_copy)  # the caller's input is untouched


def test_inplace_resnet_blocks_and_a_shared_relu():
    model = _not_inplace(get_model("resnet18", num_classes=10))
    ref = copy.deepcopy(model)
    model, n = inplace_activations(model, return_count=True)
    # The stem ReLU and each block's ReLU (used after bn1 and after the residual add,
    # both safe) become inplace.
    assert n == 9
    _assert_same_training(ref, model, torch.randn(2, 3, 32, 32))


class Untraceable(nn.Module):
    """Data-dependent control flow: fx cannot trace it, so the structural rule applies."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if y.sum() > 0:  # fx: a Proxy cannot be a bool
            y = y * 2
        return self.act(y) + y  # unsafe: y is read twice


def test_inplace_falls_back_to_sequential_rule_when_fx_fails():
    model = Untraceable()
    ref = copy.deepcopy(model)
    inplace_activations(model)
    assert model.body[3].inplace  # after a BN in a Sequential
    assert not model.body[0].inplace  # first in the Sequential: its input is the caller's
    assert not model.act.inplace  # called from code fx could not read
    _assert_same_training(ref, model, torch.randn(2, 3, 6, 6))


# -- T10 --------------------------------------------------------------------------------------

def _bn_pair(channels: int = 8) -> nn.Sequential:
    pair = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU())
    with torch.no_grad():
        bn = pair[0]
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return pair


@pytest.mark.parametrize("train", [True, False])
def test_memory_efficient_bn_act_equals_plain_pair(train):
    plain = _bn_pair().train(train)
    eff = MemoryEfficientBNAct.from_bn(copy.deepcopy(plain[0]), nn.ReLU()).train(train)
    x = torch.randn(4, 8, 6, 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain(xa), eff(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(yb, ya, atol=1e-6, rtol=0)
    torch.testing.assert_close(xb.grad, xa.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(eff.weight.grad, plain[0].weight.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(eff.bias.grad, plain[0].bias.grad, atol=1e-6, rtol=0)
    # Running statistics updated exactly once, though BN ran again in backward.
    for k, v in plain[0].state_dict().items():
        torch.testing.assert_close(eff.state_dict()[k], v, atol=1e-6, rtol=0, msg=k)
    assert int(eff.num_batches_tracked) == (1 if train else 0)


def test_memory_efficient_bn_act_saves_less():
    plain = _bn_pair()
    eff = MemoryEfficientBNAct.from_bn(copy.deepcopy(plain[0]))
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    plain_bytes = saved_activation_bytes(plain, x)
    eff_bytes = saved_activation_bytes(eff, x)
    assert eff_bytes < plain_bytes
    assert eff_bytes <= x.numel() * x.element_size() + 1024  # the BN input only


def test_memory_efficient_bn_act_rejects_an_activation_with_parameters():
    with pytest.raises(UserError, match="parameter-free"):
        MemoryEfficientBNAct(8, activation=nn.PReLU())


def test_memory_efficient_converter_keeps_state_dict_and_training():
    for name, n_pairs in (("resnet9", 8), ("resnet18", 9)):  # Sequential pairs; torchvision blocks
        model = get_model(name, num_classes=10)
        ref = copy.deepcopy(model)
        keys = list(model.state_dict())
        params = {id(p) for p in model.parameters()}
        model, n = memory_efficient_bn_act(model, return_count=True)
        assert n == n_pairs
        assert list(model.state_dict()) == keys
        assert {id(p) for p in model.parameters()} == params  # an existing optimizer stays valid
        assert sum(isinstance(m, MemoryEfficientBNAct) for m in model.modules()) == n_pairs
        _assert_same_training(ref, model, torch.randn(2, 3, 32, 32))
        model.load_state_dict(ref.state_dict())  # a plain checkpoint loads


# -- T12 --------------------------------------------------------------------------------------

def test_checkpoint_blocks_resnet50_memory_gradients_running_stats():
    model = get_model("resnet50", num_classes=10)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    checkpoint_blocks(model)
    assert checkpointed_names(model) == [n for n, m in model.named_modules() if type(m).__name__ == "Bottleneck"]
    assert list(model.state_dict()) == keys
    x = torch.randn(2, 3, 32, 32)
    plain_bytes = saved_activation_bytes(ref, x)
    ckpt_bytes = saved_activation_bytes(model, x)
    # Measured 65% less here, 64% at batch 8, 224x224 (the stem is not checkpointed).
    assert ckpt_bytes <= 0.4 * plain_bytes
    model.load_state_dict(ref.state_dict())  # the forward passes above moved running stats
    _assert_same_training(ref, model, x)
    # eval / no_grad: plain forward, same result
    ref.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


def test_checkpoint_blocks_by_name_and_type_transformer_with_dropout():
    model = get_model("transformer", num_layers=2, d_model=32, nhead=2, dim_feedforward=64)
    ref = copy.deepcopy(model)
    checkpoint_blocks(model)  # default: the repeated TransformerEncoderLayers
    assert checkpointed_names(model) == ["encoder.layers.0", "encoder.layers.1"]
    tokens = torch.randint(0, 1000, (2, 16))
    _assert_same_training(ref, model, tokens)  # dropout replayed with the same RNG state

    by_name = checkpoint_blocks(copy.deepcopy(ref), names="encoder.layers.*")
    assert checkpointed_names(by_name) == ["encoder.layers.0", "encoder.layers.1"]
    by_type = checkpoint_blocks(copy.deepcopy(ref), types=nn.TransformerEncoder)
    assert checkpointed_names(by_type) == ["encoder"]


def test_checkpoint_blocks_errors_and_deepcopy():
    with pytest.raises(UserError, match="no repeated blocks"):
        checkpoint_blocks(get_model("mlp"))
    with pytest.raises(UserError, match="no submodule"):
        checkpoint_blocks(get_model("resnet18"), names=["nothing.*"])
    model = checkpoint_blocks(get_model("resnet18", num_classes=10))
    clone = copy.deepcopy(model)
    assert checkpointed_names(clone) == checkpointed_names(model)
    # the copy's wrapped forwards run the copy's own weights
    assert clone.layer1[0].forward.module is clone.layer1[0]


def test_memory_efficient_bn_inside_a_checkpointed_block_updates_stats_once():
    model = get_model("resnet18", num_classes=10)
    ref = copy.deepcopy(model)
    memory_efficient_bn_act(model)
    checkpoint_blocks(model)
    _assert_same_training(ref, model, torch.randn(2, 3, 32, 32))


def _deep_sequential(n: int = 16, width: int = 32) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n // 4):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True), nn.Dropout(0.1)]
    return nn.Sequential(*layers)


def test_checkpoint_sequential_sqrt():
    seq = _deep_sequential(16)
    ref = copy.deepcopy(seq)
    out = checkpoint_sequential_sqrt(seq)
    assert out is seq and checkpointed_names(seq) == [""]
    bounds = seq.forward.bounds
    assert len(bounds) == 4  # ceil(sqrt(16))
    assert all(not getattr(seq[a], "inplace", False) for a, _ in bounds)
    x = torch.randn(8, 32)
    assert saved_activation_bytes(seq, x) < 0.5 * saved_activation_bytes(ref, x)
    seq.load_state_dict(ref.state_dict())
    _assert_same_training(ref, seq, x)
    with pytest.raises(UserError, match="nn.Sequential"):
        checkpoint_sequential_sqrt(get_model("mlp"))  # an MLP module, not a Sequential
    with pytest.raises(UserError, match="segments"):
        checkpoint_sequential_sqrt(_deep_sequential(8), segments=20)


def test_registered_tricks():
    from torch_tricks.registry import _TRICKS  # get_trick would import every train module

    assert _TRICKS["inplace_activations"].ids == ("T9",) and _TRICKS["inplace_activations"].config_key == "inplace"
    assert _TRICKS["memory_efficient_bn"].config_key == "memory_efficient_bn"
    assert _TRICKS["checkpointing"].ids == ("T12",) and _TRICKS["checkpointing"].fn is checkpoint_blocks
