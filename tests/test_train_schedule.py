"""torch_tricks.train.schedule: lr scaling and warm-up schedules (T21)."""

from __future__ import annotations

import math

import pytest
import torch

from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick
from torch_tricks.train.schedule import WarmupFactor, scale_lr, warmup_schedule


def _opt(lr: float = 0.4) -> torch.optim.Optimizer:
    w = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    return torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": lr / 2}], lr=lr, momentum=0.9)


def _lrs(opt, sched, steps: int) -> list[list[float]]:
    """lr of every group used by optimizer steps 0..steps-1 (one scheduler step per optimizer step)."""
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def test_scale_lr_rules():
    assert scale_lr(0.1, 1024) == pytest.approx(0.4)
    assert scale_lr(0.1, 8192, base_batch=256) == pytest.approx(3.2)  # Goyal et al.'s ImageNet setting
    assert scale_lr(0.1, 1024, rule="sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 64) == pytest.approx(0.025)
    for bad in (dict(batch_size=0), dict(batch_size=2.5), dict(rule="cubic"), dict(base_lr=-1.0)):
        kw = dict(base_lr=0.1, batch_size=512) | bad
        with pytest.raises(UserError):
            scale_lr(**kw)


def test_warmup_ramps_linearly_to_base_lr():
    opt = _opt(0.4)
    sched = warmup_schedule(opt, warmup_steps=4, total_steps=12, kind="cosine")
    lrs = _lrs(opt, sched, 5)
    assert [r[0] for r in lrs] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert [r[1] for r in lrs] == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])  # each group from its own lr

    opt = _opt(0.4)
    sched = warmup_schedule(opt, 4, 12, warmup_start_ratio=0.25)
    assert [r[0] for r in _lrs(opt, sched, 5)] == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4])


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_decay_reaches_min_lr_at_total_steps(kind):
    opt = _opt(1.0)
    sched = warmup_schedule(opt, 3, 13, kind=kind, min_lr_ratio=0.1)
    lrs = [r[0] for r in _lrs(opt, sched, 16)]
    assert lrs[3] == pytest.approx(1.0)
    mid = 0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * 0.5)) if kind == "cosine" else 0.5)
    assert lrs[8] == pytest.approx(mid)
    assert lrs[13] == pytest.approx(0.1)
    assert lrs[14:] == pytest.approx([0.1, 0.1])  # held after the end
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # monotone decay


def test_constant_and_no_warmup():
    opt = _opt(0.3)
    lrs = [r[0] for r in _lrs(opt, warmup_schedule(opt, 2, 2, kind="constant"), 5)]
    assert lrs == pytest.approx([0.0, 0.15, 0.3, 0.3, 0.3])
    opt = _opt(0.3)
    lrs = [r[0] for r in _lrs(opt, warmup_schedule(opt, 0, 10), 2)]
    assert lrs[0] == pytest.approx(0.3)


def test_state_dict_round_trip_resumes_exactly():
    opt = _opt(0.5)
    sched = warmup_schedule(opt, 3, 10, kind="cosine", min_lr_ratio=0.2)
    full = _lrs(opt, sched, 10)

    opt_a = _opt(0.5)
    sched_a = warmup_schedule(opt_a, 3, 10, kind="cosine", min_lr_ratio=0.2)
    first = _lrs(opt_a, sched_a, 4)
    state_sched, state_opt = sched_a.state_dict(), opt_a.state_dict()

    # a fresh schedule built with other settings: the saved ones must win
    opt_b = _opt(0.5)
    sched_b = warmup_schedule(opt_b, 1, 100, kind="linear")
    opt_b.load_state_dict(state_opt)
    sched_b.load_state_dict(state_sched)
    assert sched_b.lr_lambdas[0] == WarmupFactor(3, 10, "cosine", 0.2, 0.0)
    rest = _lrs(opt_b, sched_b, 6)
    assert first + rest == full  # bit-identical


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((5, 3), {}),
        ((-1, 3), {}),
        ((1, 3), dict(kind="step")),
        ((1, 3), dict(min_lr_ratio=1.5)),
        ((1.5, 3), {}),
    ],
)
def test_bad_schedule_input(args, kwargs):
    with pytest.raises(UserError):
        warmup_schedule(_opt(), *args, **kwargs)
    with pytest.raises(UserError):
        warmup_schedule("not an optimizer", 1, 2)


def test_registered():
    t = get_trick("lr_warmup")
    assert t.fn is warmup_schedule and t.ids == ("T21",) and t.config_key == "warmup_steps"
