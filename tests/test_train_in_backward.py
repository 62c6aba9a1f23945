"""T30 optimizer step in backward: the same parameters as the plain step (AdamW, SGD with momentum, a
scheduler: the config's or yours, moved onto it), no gradient alive after backward, a checkpoint that
resumes, a stepped optimizer going on from its state, a lower peak; refused with one line where it cannot
be right."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.errors import UserError
from torch_tricks.inspect.memory import LiveTensors
from torch_tricks.train import TrainConfig, Tricks
from torch_tricks.train.in_backward import InBackwardOptimizer, optimizer_in_backward


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def _batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(n)]


def _run(cfg: dict, batches, model=None, total: int = 6) -> tuple[nn.Module, Tricks, list[float]]:
    tricks = Tricks(device="cpu", progress=False, lr=1e-2, weight_decay=0.05, schedule="cosine", warmup_steps=2,
                    max_steps=total, **cfg)
    model, _ = tricks.prepare(model or _net())
    losses = []
    for x, y in batches:
        with tricks.autocast():
            loss = F.cross_entropy(model(x), y)
        tricks.backward(loss)
        if cfg.get("optimizer_in_backward"):
            assert all(p.grad is None for p in model.parameters())  # each freed right after its own step
        tricks.step()
        losses.append(float(loss))
    return model, tricks, losses


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_the_parameters_are_the_plain_steps_with_a_schedule(opt):
    batches = _batches()
    plain, _, l0 = _run({"optimizer": opt}, batches)
    fused, tricks, l1 = _run({"optimizer": opt, "optimizer_in_backward": True}, batches)
    assert "optimizer_in_backward" in tricks.applied and isinstance(tricks.optimizer, InBackwardOptimizer)
    assert l1 == pytest.approx(l0, rel=1e-5)
    for (n, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)
    lrs = {g["lr"] for g in tricks.optimizer.param_groups}
    assert len(lrs) == 1 and lrs.pop() == pytest.approx(tricks.scheduler.get_last_lr()[0])  # the schedule reached all


def test_a_state_dict_resumes_to_the_same_parameters(tmp_path):
    batches = _batches(6)
    whole, _, _ = _run({"optimizer_in_backward": True}, batches)
    half, tricks, _ = _run({"optimizer_in_backward": True}, batches[:3])
    tricks.save(tmp_path / "t.pt")
    fresh = Tricks(device="cpu", progress=False, lr=1e-2, weight_decay=0.05, schedule="cosine", warmup_steps=2,
                   max_steps=6, optimizer_in_backward=True)
    model, _ = fresh.prepare(_net())
    fresh.load(tmp_path / "t.pt")
    assert fresh.step_count == 3 and len(fresh.optimizer.state) == len(list(model.parameters()))
    for x, y in batches[3:]:
        fresh.backward(F.cross_entropy(model(x), y))
        fresh.step()
    for a, b in zip(whole.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_peak_of_a_step_drops_by_about_the_gradients():
    big = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
    x = torch.randn(4, 512)

    def peak(in_backward: bool) -> int:
        model = copy.deepcopy(big)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if in_backward:
            opt = optimizer_in_backward(opt)
        with LiveTensors() as live:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return live.peak_bytes

    grads = sum(p.numel() * 4 for p in big.parameters())
    saved = peak(False) - peak(True)
    assert saved >= 0.8 * grads, (saved, grads)  # all but the last layer's gradient never coexist


@pytest.mark.parametrize("kw, needle", [
    ({"accumulate": 4}, "cannot accumulate 4 micro-batches: set accumulate = 1"),
    ({"grad_clip": 1.0}, "global-norm clipping (grad_clip) cannot be applied"),
    ({"precision": "fp16"}, "cannot run under fp16"),
    ({"auto_micro_batch": True}, "auto_micro_batch cannot split a batch"),
])
def test_what_cannot_be_right_is_one_line(kw, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(optimizer_in_backward=True, **kw).validate()


def test_your_scheduler_is_moved_onto_it_and_its_lr_reaches_each_parameters_step():
    model = _net()
    opt = torch.optim.AdamW([{"params": list(model[0].parameters()), "lr": 1e-2},
                             {"params": [p for m in list(model)[1:] for p in m.parameters()], "lr": 1e-2}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.0 if s >= 1 else 1.0])
    tricks = Tricks(device="cpu", optimizer_in_backward=True)
    model, opt2, sched2 = tricks.prepare(model, opt, sched)
    assert sched2 is sched and sched.optimizer is opt2 and len(opt2.param_groups) == 2
    x, y = _batches(1)[0]
    for step in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        tricks.backward(F.cross_entropy(model(x), y))
        tricks.step()
        moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
        assert all(moved[:2]) and all(moved[2:]) == (step == 0)  # the second group's lr is 0 from the 2nd step
    assert [g["lr"] for g in opt2.param_groups] == [1e-2, 0.0]


def test_a_stepped_optimizer_goes_on_from_its_state():
    """Converting after some plain steps (or after loading a state into it) keeps the moments: the same parameters
    as plain steps all along."""
    batches = _batches(5)

    def train(switch_after: int) -> nn.Module:
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        for i, (x, y) in enumerate(batches):
            if i == switch_after:
                opt = optimizer_in_backward(opt)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model

    for a, b in zip(train(99).parameters(), train(2).parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_bf16_moments_stay_bf16_after_a_load(tmp_path):
    from torch_tricks.train.optim_state import low_precision_state

    model = _net()
    opt = optimizer_in_backward(low_precision_state(torch.optim.AdamW(model.parameters()), "bf16"))
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    saved = opt.state_dict()
    fresh = optimizer_in_backward(low_precision_state(torch.optim.AdamW(model.parameters()), "bf16"))
    fresh.load_state_dict(saved)
    moments = [s[k] for s in fresh.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(moments) == 2 * len(list(model.parameters())) and all(m.dtype == torch.bfloat16 for m in moments)
    assert all(o.state is fresh.state for o in fresh.optimizers)


def test_the_cli_says_it_in_one_line_with_exit_2(capsys):
    from torch_tricks.cli import main

    code = main(["train", "--model", "mlp", "--max-steps", "1", "--optimizer-in-backward", "--accumulate", "4",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cannot accumulate 4 micro-batches" in err, err


def test_the_tune_never_combines_it_with_accumulation():
    from torch_tricks.tuning.tuner import _compatible, _valid_together

    assert not _valid_together({"optimizer_in_backward": True, "accumulate": 2})
    assert _valid_together({"optimizer_in_backward": True, "checkpointing": "blocks"})

    class Row:
        def __init__(self, **changes):
            self.changes = changes

    rows = [Row(optimizer_in_backward=True), Row(accumulate=2), Row(checkpointing="blocks")]
    chosen, changes = _compatible(rows)
    assert changes == {"optimizer_in_backward": True, "checkpointing": "blocks"} and rows[1] not in chosen


def test_the_tunes_drift_check_reads_the_gradients_without_stepping():
    """Found on a GPU run's tune: reading the first batch's gradients (the drift check, the probe) let the
    hooks step and free them, so the tune saw zero gradients and a run one step ahead ("drifts 23%")."""
    from torch_tricks.tuning.measure import build_runner

    batches = _batches(3)
    kw = {"loss_fn": F.cross_entropy, "optimizer_fn": None}
    plain = build_runner("plain", _net(), {"device": "cpu"}, batches, **kw)
    inb = build_runner("inb", _net(), {"device": "cpu", "optimizer_in_backward": True}, batches, **kw)
    assert inb.losses == pytest.approx(plain.losses, rel=1e-5)
    for a, b in zip(plain.grads, inb.grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert sum(float(g.abs().sum()) for g in inb.grads) > 0
