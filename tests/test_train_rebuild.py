"""Your own optimizer under ``optimizer_state`` (8bit, bf16) and ``optimizer_in_backward``: ``Tricks.prepare``
rebuilds it with the same groups and settings, moves the lr scheduler you pass onto the new one (its lr follows
the schedule at every step, without PyTorch's "scheduler before optimizer" warning), retires the old one, and
trains; what cannot be right is one line. torchao's 8-bit step runs under ``set_stance("force_eager")`` (the
same numerics as compiled, without seconds of compilation per shape)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR

from torch_tricks.errors import UserError
from torch_tricks.train import Tricks
from torch_tricks.train.in_backward import InBackwardOptimizer
from torch_tricks.train.optim_state import Bf16StateAdam
from torch_tricks.train.rebuild import check_scheduler, move_scheduler, retire

STEPS = 8
ETA_MIN = 1e-5
CASES = {
    "8bit": {"optimizer_state": "8bit"},
    "bf16": {"optimizer_state": "bf16"},
    "in_backward": {"optimizer_in_backward": True},
    "bf16_in_backward": {"optimizer_state": "bf16", "optimizer_in_backward": True},
}
SETTINGS = ("lr", "weight_decay", "betas", "eps")


@pytest.fixture(autouse=True)
def _eager():
    with torch.compiler.set_stance("force_eager"):
        yield


def _net() -> nn.Module:
    """The first weight has 4,096 values: torchao keeps its moments 8-bit (smaller tensors stay fp32)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(2)]


def _user_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """A loop's own AdamW: weight decay on the matrices only, the other group at its own lr."""
    decay = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                                                                       "lr": 1e-3}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-7)


def _scheduler(kind: str, opt: torch.optim.Optimizer):
    if kind == "cosine":
        return CosineAnnealingLR(opt, T_max=STEPS, eta_min=ETA_MIN)
    if kind == "lambda":  # warm-up then cosine, as transformers' get_cosine_schedule_with_warmup
        return LambdaLR(opt, lambda s: (s + 1) / 3 if s < 2 else 0.5 * (1 + math.cos(math.pi * (s - 2) / STEPS)))
    return SequentialLR(opt, [LinearLR(opt, 0.25, total_iters=2), CosineAnnealingLR(opt, T_max=STEPS - 2)],
                        milestones=[2])


def _settings_by_param(opt: torch.optim.Optimizer) -> dict[int, dict]:
    """Each parameter's group settings, as plain numbers (a torchao lr is a tensor)."""
    def plain(v):
        return float(v) if isinstance(v, torch.Tensor) else v
    return {id(p): {k: plain(g[k]) for k in SETTINGS} for g in opt.param_groups for p in g["params"]}


def _own_loop(cfg: dict | None, kind: str = "cosine", steps: int = STEPS):
    """The user's loop: its AdamW and scheduler given to prepare(); ``cfg`` None is the same loop without Tricks."""
    model = _net()
    opt = _user_optimizer(model)
    sched = _scheduler(kind, opt)
    given = _settings_by_param(opt)
    tricks = None
    if cfg is not None:
        tricks = Tricks(device="cpu", **cfg)
        model, opt, sched = tricks.prepare(model, opt, sched)
    losses, lrs = [], []
    for i in range(steps):
        x, y = _batches()[i % 2]
        if tricks is None:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
        else:
            with tricks.autocast():
                loss = F.cross_entropy(model(x), y)
            tricks.backward(loss)
            assert tricks.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        lrs.append(_group_lrs(opt))
    return model, opt, sched, tricks, losses, lrs, given


def _group_lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


@pytest.fixture(scope="module")
def plain_runs():
    """The loop without Tricks, once per scheduler kind: the schedule and parameters the others must follow."""
    with torch.compiler.set_stance("force_eager"):
        return {kind: _own_loop(None, kind) for kind in ("cosine", "lambda", "sequential")}


@pytest.mark.parametrize("case", list(CASES))
def test_your_adamw_is_rebuilt_with_its_groups_and_trains_on_the_cosine_it_was_given(case, plain_runs):
    if CASES[case].get("optimizer_state") == "8bit":
        pytest.importorskip("torchao.optim", reason="8-bit state needs torchao")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, sched, tricks, losses, lrs, given = _own_loop(CASES[case])
    assert not [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]  # no "step() before" warning
    assert sched.optimizer is opt and tricks.optimizer is opt and tricks.scheduler is sched
    if case == "8bit":
        assert type(opt).__name__ == "AdamW8bit" and opt.is_adamw
        assert any(type(s["exp_avg"]).__name__ == "OptimState8bit" for s in opt.state.values())
    elif case == "bf16":
        assert type(opt) is Bf16StateAdam and opt.defaults["decoupled"]
    else:
        assert isinstance(opt, InBackwardOptimizer) and len(opt.param_groups) == 2
    # every parameter kept its group's lr (as the schedule set it at prepare), weight decay, betas and eps
    plain_lrs = plain_runs["cosine"][5]
    assert [g["initial_lr"] for g in opt.param_groups] == [3e-3, 1e-3]
    now = _settings_by_param(opt)
    for key, s in given.items():
        assert {k: v for k, v in now[key].items() if k != "lr"} == {k: v for k, v in s.items() if k != "lr"}
    # the lr at every step: the plain loop's, which is the cosine's closed form
    for step, (mine, plain) in enumerate(zip(lrs, plain_lrs), start=1):
        cosine = [ETA_MIN + (base - ETA_MIN) * (1 + math.cos(math.pi * step / STEPS)) / 2 for base in (3e-3, 1e-3)]
        assert mine == pytest.approx(plain, rel=1e-5, abs=1e-12) and plain == pytest.approx(cosine, rel=1e-9)
    assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses  # each of the two batches' loss went down
    plain_losses = plain_runs["cosine"][4]
    assert losses == pytest.approx(plain_losses, rel=2e-2 if "optimizer_state" in CASES[case] else 1e-5)


def test_in_backward_takes_the_same_steps_as_your_plain_loop(plain_runs):
    plain_model = plain_runs["cosine"][0]
    model = _own_loop(CASES["in_backward"])[0]
    for a, b in zip(plain_model.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lambda", "sequential"])
def test_a_warm_up_schedule_and_a_sequential_one_are_moved_too(kind, plain_runs):
    *_, lrs, _ = _own_loop(CASES["bf16"], kind)
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(lrs) == pytest.approx(flat(plain_runs[kind][5]), rel=1e-9)


@pytest.mark.parametrize("case", ["bf16", "in_backward"])
def test_a_killed_own_loop_resumes_to_the_same_parameters(case, tmp_path):
    whole = _own_loop(CASES[case])[0]
    _, _, _, tricks, _, _, _ = _own_loop(CASES[case], steps=3)
    tricks.save(tmp_path / "t.pt")
    model = _net()
    opt = _user_optimizer(model)
    fresh = Tricks(device="cpu", **CASES[case])
    model, opt, sched = fresh.prepare(model, opt, _scheduler("cosine", opt))
    fresh.load(tmp_path / "t.pt")
    assert fresh.step_count == 3 and sched.last_epoch == 3
    for i in range(3, STEPS):
        x, y = _batches()[i % 2]
        fresh.backward(F.cross_entropy(model(x), y))
        fresh.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(whole.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_old_optimizer_steps_no_more():
    model = _net()
    opt = _user_optimizer(model)
    new = Tricks(device="cpu", optimizer_state="bf16").prepare(model, opt)[1]
    assert new is not opt
    with pytest.raises(UserError, match=r"rebuilt by tricks.prepare\(\) \(optimizer_state = bf16\): step the one"):
        opt.step()
    late = CosineAnnealingLR(opt, T_max=3)  # a scheduler built on it afterwards still wraps its step
    with pytest.raises(UserError, match="rebuilt by tricks.prepare"):
        opt.step()
    assert late.optimizer is opt


def test_an_optimizer_already_on_the_state_asked_for_is_kept():
    model = _net()
    opt = Bf16StateAdam(model.parameters(), lr=1e-3)
    sched = CosineAnnealingLR(opt, T_max=4)
    tricks = Tricks(device="cpu", optimizer_state="bf16")
    _, same, sched2 = tricks.prepare(model, opt, sched)
    assert same is opt and sched2.optimizer is opt and "optimizer_state=bf16" in tricks.applied


def _one_line(fn, needle: str) -> None:
    with pytest.raises(UserError, match=needle) as err:
        fn()
    assert "\n" not in str(err.value)


class _HomeMadeScheduler:
    """A scheduler that is not torch's: it may hold the optimizer elsewhere than in ``optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        pass

    def state_dict(self):
        return {}


@pytest.mark.parametrize("what, cfg, needle", [
    ("sgd", {"optimizer_state": "8bit"}, r"needs Adam or AdamW \(it stores their two moments\), not SGD"),
    ("stepped", {"optimizer_state": "bf16"}, "the state your AdamW holds .* cannot carry over"),
    ("maximize", {"optimizer_state": "bf16"}, r"has no maximize \(it would minimise\)"),
    ("home-made scheduler", {"optimizer_state": "bf16"}, "a _HomeMadeScheduler cannot be moved onto the new one"),
    ("other optimizer's scheduler", {"optimizer_in_backward": True}, "bound to another optimizer than the one given"),
    ("scheduler without optimizer", {}, "prepare\\(\\) builds the optimizer here"),
])
def test_what_cannot_be_right_is_one_line(what, cfg, needle):
    model = _net()
    opt, extra = _user_optimizer(model), []
    if what == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    elif what == "stepped":
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
    elif what == "maximize":
        opt = torch.optim.AdamW(model.parameters(), maximize=True)
    elif what == "home-made scheduler":
        extra = [_HomeMadeScheduler(opt)]
    elif what == "other optimizer's scheduler":
        extra = [CosineAnnealingLR(_user_optimizer(_net()), T_max=4)]
    else:
        extra, opt = [CosineAnnealingLR(opt, T_max=4)], None
    _one_line(lambda: Tricks(device="cpu", **cfg).prepare(model, opt, *extra), needle)


def test_a_refused_scheduler_leaves_the_model_and_optimizer_untouched():
    """Checked before anything changes: no hook left on the parameters, the optimizer's step still its own."""
    model = _net()
    opt = _user_optimizer(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UserError):
        Tricks(device="cpu", optimizer_in_backward=True).prepare(model, opt, _HomeMadeScheduler(opt))
    model(torch.randn(2, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # no step in backward freed them
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_move_scheduler_binds_a_chained_one_and_tracks_the_new_step():
    a, b = _user_optimizer(_net()), _user_optimizer(_net())
    chained = torch.optim.lr_scheduler.ChainedScheduler([CosineAnnealingLR(a, T_max=4), LinearLR(a, 0.5)])
    check_scheduler(chained, a, "a test")
    move_scheduler(chained, b)
    assert chained.optimizer is b and all(s.optimizer is b for s in chained._schedulers)
    assert b.step._wrapped_by_lr_sched and not getattr(b, "_opt_called", False)
    b.step()
    assert b._opt_called
    retire(a, "a test")
    with pytest.raises(UserError, match=r"\(a test\)"):
        a.step()
