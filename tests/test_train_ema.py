"""torch_tricks.train.ema: EMA and SWA of weights (T22)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick
from torch_tricks.train.distributed import unwrap_model
from torch_tricks.train.ema import EMA, SWA, update_bn


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model.train()
    opt.zero_grad()
    model(torch.randn(8, 3, generator=g)).square().mean().backward()
    opt.step()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ema_equals_hand_computed_average():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = EMA(model, decay=0.9, warmup=False)
    snaps = []
    for step in range(3):
        _train_step(model, opt, step)
        ema.update(model)
        snaps.append(_state(model))
    ema_state = ema.module.state_dict()
    for key, value in ema_state.items():
        if key.endswith("num_batches_tracked"):
            assert value == snaps[-1][key]  # integer counters are copied, not averaged
            continue
        expected = snaps[0][key]  # the first update copies
        for s in snaps[1:]:
            expected = 0.9 * expected + 0.1 * s[key]
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=key)
    assert ema.num_updates == 3
    assert not ema.module.training
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_ema_skips_parameters_frozen_all_along_and_averages_one_once_unfrozen():
    model = _tiny()
    model[0].requires_grad_(False)  # a frozen first layer (a LoRA model's base, a frozen backbone)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ema = EMA(model, decay=0.9, warmup=False)
    frozen = ema.module[0].weight
    _train_step(model, opt, 0)
    ema.update(model)  # the first update copies every tensor
    snaps, versions = [_state(model)], frozen._version
    for step in range(1, 3):
        _train_step(model, opt, step)
        ema.update(model)
        snaps.append(_state(model))
    assert frozen._version == versions  # not written since: no pass over the frozen bytes per update
    assert torch.equal(frozen, model[0].weight)
    for key in ("3.weight", "1.running_mean"):  # trained weights and buffers: averaged as before
        expected = snaps[0][key]
        for s in snaps[1:]:
            expected = 0.9 * expected + 0.1 * s[key]
        torch.testing.assert_close(ema.module.state_dict()[key], expected, rtol=0, atol=1e-6, msg=key)

    model[0].weight.requires_grad_(True)  # unfrozen: averaged from now on
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    torch.testing.assert_close(frozen, 0.9 * snaps[-1]["0.weight"] + 0.1 * model[0].weight.detach())
    model[0].weight.requires_grad_(False)  # frozen again: still averaged (its average is no longer its copy)
    ema.update(model)
    assert not torch.equal(frozen, model[0].weight)
    assert frozen._version > versions


def test_ema_decay_warmup():
    ema = EMA(nn.Linear(2, 2), decay=0.999, warmup=True)
    assert ema.current_decay() == pytest.approx(1 / 10)
    ema.num_updates = 5
    assert ema.current_decay() == pytest.approx(6 / 15)
    ema.num_updates = 10**6
    assert ema.current_decay() == pytest.approx(0.999)
    assert EMA(nn.Linear(2, 2), decay=0.9, warmup=False).current_decay() == 0.9

    model = nn.Linear(2, 2)
    ema = EMA(model, decay=0.999)
    with torch.no_grad():
        model.weight.zero_()
    ema.update(model)  # copy
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)  # n=1: decay = 2/11
    torch.testing.assert_close(ema.module.weight, torch.full((2, 2), 9 / 11))


def test_ema_state_dict_round_trip_resumes_identically():
    torch.manual_seed(0)
    model = _tiny()
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = EMA(model, decay=0.95)
    for step in range(5):
        _train_step(model, opt, step)
        ema.update(model)
    reference = _state(ema.module)

    model2 = copy.deepcopy(start)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    ema2 = EMA(model2, decay=0.95)
    for step in range(3):
        _train_step(model2, opt2, step)
        ema2.update(model2)
    saved = copy.deepcopy(ema2.state_dict())

    resumed = EMA(copy.deepcopy(start), decay=0.5, warmup=False)  # settings come from the checkpoint
    resumed.load_state_dict(saved)
    assert (resumed.decay, resumed.warmup, resumed.num_updates) == (0.95, True, 3)
    for step in range(3, 5):
        _train_step(model2, opt2, step)
        resumed.update(model2)
    for key, value in resumed.module.state_dict().items():
        assert torch.equal(value, reference[key]), key
    with pytest.raises(UserError):
        resumed.load_state_dict({"weights": 1})


def test_ema_unwraps_compile_and_data_parallel():
    model = _tiny()
    compiled = torch.compile(model, backend="eager")  # a wrapper; nothing compiles until it is called
    ema = EMA(compiled, decay=0.5, warmup=False)
    assert type(ema.module) is nn.Sequential
    assert set(ema.module.state_dict()) == set(model.state_dict())  # no _orig_mod. prefix
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(nn.DataParallel(compiled))  # (which moves the model to cuda:0 where there is one)
    torch.testing.assert_close(ema.module[0].weight, model[0].weight, check_device=False)  # first update copies
    assert unwrap_model(nn.DataParallel(compiled)) is model
    with pytest.raises(UserError):
        ema.update(nn.Linear(3, 4))


def test_ema_unwraps_ddp():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = nn.Linear(3, 2)
        ddp = nn.parallel.DistributedDataParallel(model)
        ema = EMA(ddp, decay=0.5, warmup=False)
        assert type(ema.module) is nn.Linear
        ema.update(ddp)
        with torch.no_grad():
            model.weight.add_(2.0)
        ema.update(ddp)
        torch.testing.assert_close(ema.module.weight, model.weight - 1.0)
    finally:
        dist.destroy_process_group()


def test_swa_average_equals_mean_of_snapshots():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    swa = SWA(model, opt, swa_lr=0.05, anneal_epochs=2)
    snaps = []
    for step in range(4):
        _train_step(model, opt, step)
        swa.update(model)
        swa.step_lr()
        snaps.append({k: v.detach().clone() for k, v in model.named_parameters()})
    assert swa.num_averaged == 4
    for name, value in swa.module.named_parameters():
        expected = torch.stack([s[name] for s in snaps]).mean(0)
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=name)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # SWALR annealed to swa_lr
    # buffers follow the live model until update_bn recomputes them
    torch.testing.assert_close(swa.module[1].running_mean, model[1].running_mean)

    state = copy.deepcopy(swa.state_dict())
    other = SWA(_tiny(), torch.optim.SGD(_tiny().parameters(), lr=0.5), swa_lr=0.05)
    other.load_state_dict(state)
    assert other.num_averaged == 4
    torch.testing.assert_close(other.module[0].weight, swa.module[0].weight)


def test_update_bn_sets_running_stats_to_the_data():
    model = nn.Sequential(nn.Identity(), nn.BatchNorm1d(3))
    g = torch.Generator().manual_seed(0)
    data = torch.randn(64, 3, generator=g) * torch.tensor([1.0, 2.0, 3.0]) + torch.tensor([5.0, -1.0, 0.5])
    loader = [(data[i : i + 16], torch.zeros(16)) for i in range(0, 64, 16)]  # (x, y) batches
    model.eval()
    update_bn(loader, model)
    bn = model[1]
    torch.testing.assert_close(bn.running_mean, data.mean(0), rtol=0, atol=1e-5)
    # cumulative average of the batches' unbiased variances
    expected_var = torch.stack([x.var(0, unbiased=True) for x, _ in loader]).mean(0)
    torch.testing.assert_close(bn.running_var, expected_var, rtol=1e-5, atol=1e-5)
    assert not model.training  # mode restored
    assert bn.momentum == 0.1  # momentum restored


def test_update_bn_input_fn_for_dict_batches():
    class TakesKw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(2)

        def forward(self, *, pixels: torch.Tensor) -> torch.Tensor:
            return self.bn(pixels)

    model = TakesKw()
    loader = [{"x": torch.full((4, 2), 3.0) + torch.arange(4.0)[:, None], "label": 0}] * 2
    update_bn(loader, model, input_fn=lambda b: {"pixels": b["x"]})
    torch.testing.assert_close(model.bn.running_mean, torch.full((2,), 4.5))

    swa_model = _tiny()
    opt = torch.optim.SGD(swa_model.parameters(), lr=0.3)
    swa = SWA(swa_model, opt)  # no swa_lr: no scheduler, the lr is left alone
    assert swa.scheduler is None
    swa.update(swa_model)
    swa.step_lr()
    assert opt.param_groups[0]["lr"] == 0.3
    out = swa.finalize([(torch.randn(8, 3) + 7.0, None)], lambda b: b[0])
    assert out is swa.module and not out.training
    assert swa.module[1].num_batches_tracked == 1


def test_bad_input():
    with pytest.raises(UserError):
        EMA(nn.Linear(2, 2), decay=1.5)
    with pytest.raises(UserError):
        EMA("model")
    with pytest.raises(UserError):
        SWA(nn.Linear(2, 2), swa_lr=0.1)  # nothing to anneal
    with pytest.raises(UserError):
        update_bn([], nn.Linear(2, 2), input_fn=3)


def test_registered():
    assert get_trick("ema").fn is EMA and get_trick("ema").config_key == "ema"
    assert get_trick("swa").fn is SWA and get_trick("swa").ids == ("T22",)
