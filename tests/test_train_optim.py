"""torch_tricks.train.optim: parameter groups (T14, T15) and fused/foreach optimizers (T7)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick
from torch_tricks.train.optim import build_optimizer, optimizer_info, param_groups

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


class Net(nn.Module):
    """Every kind of parameter the grouping must tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.pos_embed = nn.Parameter(torch.zeros(1, 4, 8))
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 10)
        self.tied = nn.Linear(8, 10, bias=False)
        self.tied.weight = self.head.weight  # shared: must appear once
        self.scale = nn.Parameter(torch.ones(()))  # 0-D: no decay

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos_embed  # (B, 4, 8)
        # no bias right before a norm: its gradient would be rounding noise, which Adam amplifies
        x = self.gn(torch.tanh(self.conv(self.bn(x.transpose(1, 2))))).transpose(1, 2)
        x = self.rms(self.ln(x))
        x = self.frozen(x)
        return (self.head(x) + self.tied(x)) * self.scale


def _names(groups, which):
    return set(next(g for g in groups if g["name"] == which)["param_names"])


def test_groups_exclude_frozen_and_spare_norm_bias():
    net = Net()
    groups = param_groups(net, 0.05, with_names=True)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    decay, no_decay = _names(groups, "decay"), _names(groups, "no_decay")
    assert decay == {"emb.weight", "pos_embed", "conv.weight", "head.weight"}
    assert no_decay == {
        "conv.bias", "bn.weight", "bn.bias", "gn.weight", "gn.bias", "ln.weight", "ln.bias",
        "rms.weight", "head.bias", "scale",
    }  # fmt: skip
    all_params = [p for g in groups for p in g["params"]]
    assert len(all_params) == len({id(p) for p in all_params})  # shared weight once
    assert not any(p is net.frozen.weight or p is net.frozen.bias for p in all_params)
    assert all(p.requires_grad for p in all_params)


def test_norm_detected_by_type_not_name():
    class Weird(nn.LayerNorm):  # a norm subclass with an unhelpful name
        pass

    m = nn.Sequential()
    m.add_module("x", Weird(4, elementwise_affine=True))
    m.add_module("y", nn.Linear(4, 4))
    # make the norm's weight 2-D so only the type can tell
    m.x.weight = nn.Parameter(torch.ones(1, 4))
    groups = param_groups(m, 0.1, with_names=True)
    assert "x.weight" in _names(groups, "no_decay")
    assert _names(groups, "decay") == {"y.weight"}


def test_group_options_embeddings_extra_and_off():
    net = Net()
    g = param_groups(net, 0.1, no_decay_embeddings=True, extra_no_decay=("conv.*",), with_names=True)
    assert _names(g, "decay") == {"head.weight"}
    g = param_groups(net, 0.1, no_decay_bias_and_norm=False, with_names=True)
    assert [x["name"] for x in g] == ["decay"]
    net.no_weight_decay = lambda: {"pos_embed"}  # timm's convention
    assert "pos_embed" in _names(param_groups(net, 0.1, with_names=True), "no_decay")
    with pytest.raises(UserError):
        param_groups(net, -1.0)
    with pytest.raises(UserError):
        param_groups([net.head.weight], 0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        idx = torch.randint(0, 10, (3, 4), generator=g).to(model.head.weight.device)
        model(idx).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop"])
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_fast_step_matches_for_loop(name, impl):
    if impl == "fused" and name == "rmsprop":
        pytest.skip("PyTorch has no fused RMSprop")
    ref_model = Net()
    fast_model = copy.deepcopy(ref_model)
    ref = build_optimizer(ref_model, name, lr=1e-2, weight_decay=0.1, fused=False, foreach=False)
    fast = build_optimizer(fast_model, name, lr=1e-2, weight_decay=0.1, **{impl: True})
    assert optimizer_info(ref).implementation == "for-loop"
    assert optimizer_info(fast).implementation == impl
    assert fast.defaults.get(impl) is True
    _train(ref_model, ref)
    _train(fast_model, fast)
    for (n, a), b in zip(ref_model.named_parameters(), fast_model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=n)
    assert not torch.equal(ref_model.head.weight, Net().head.weight)  # it trained


def test_default_picks_fused_where_torch_has_it_on_cpu():
    info = optimizer_info(build_optimizer(Net(), "adamw"))
    assert info.name == "adamw" and info.device == "cpu"
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    fused_cpu = "cpu" in _get_fused_kernels_supported_devices()
    assert info.implementation == ("fused" if fused_cpu else "for-loop")
    assert optimizer_info(build_optimizer(Net(), "rmsprop")).implementation == "for-loop"  # CPU foreach not faster
    assert optimizer_info(torch.optim.SGD(Net().parameters(), lr=0.1)) is None


def test_adam_with_decay_becomes_adamw_and_is_recorded():
    opt = build_optimizer(Net(), "adam", weight_decay=0.01)
    info = optimizer_info(opt)
    assert type(opt) is torch.optim.AdamW and info.requested == "adam" and info.name == "adamw"
    assert any("AdamW" in n for n in info.notes)
    assert type(build_optimizer(Net(), "adam", weight_decay=0.01, decoupled=False)) is torch.optim.Adam
    assert type(build_optimizer(Net(), "adam")) is torch.optim.Adam  # no decay: nothing to switch
    assert info.frozen_excluded == 2
    assert [g["name"] for g in info.groups] == ["decay", "no_decay"]
    assert opt.param_groups[1]["weight_decay"] == 0.0


def test_build_from_params_and_groups_drops_frozen():
    net = Net()
    opt = build_optimizer(net.parameters(), "sgd", lr=0.1)
    assert optimizer_info(opt).frozen_excluded == 2
    assert opt.param_groups[0]["momentum"] == 0.9
    opt = build_optimizer([{"params": net.frozen.parameters()}, {"params": net.head.parameters(), "lr": 0.5}], "sgd")
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(name="lamb"),
        dict(name="rmsprop", fused=True),
        dict(fused=True, foreach=True),
        dict(lr=-1.0),
        dict(name="sgd", bogus=1),
    ],
)
def test_bad_input_is_a_user_error(kwargs):
    with pytest.raises(UserError):
        build_optimizer(Net(), **kwargs)


def test_momentum_for_adam_is_ignored_with_a_note():
    opt = build_optimizer(Net(), "adamw", momentum=0.9, betas=(0.8, 0.99))
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    assert any("momentum" in n for n in optimizer_info(opt).notes)


def test_all_frozen_is_a_user_error():
    net = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(UserError, match="no trainable"):
        build_optimizer(net)


def test_registered():
    assert get_trick("fused_optimizer").fn is build_optimizer
    assert get_trick("no_decay_groups").config_key == "no_decay_norm_bias"
    assert get_trick("fused_optimizer").check("cpu")[0] is True


@requires_cuda
def test_cuda_default_is_fused_and_matches_loop():
    ref_model = Net().cuda()
    fast_model = copy.deepcopy(ref_model)
    ref = build_optimizer(ref_model, "adamw", lr=1e-2, fused=False, foreach=False)
    fast = build_optimizer(fast_model, "adamw", lr=1e-2)
    assert optimizer_info(fast).implementation == "fused"
    _train(ref_model, ref)
    _train(fast_model, fast)
    for a, b in zip(ref_model.parameters(), fast_model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
