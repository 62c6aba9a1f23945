"""The joint race of the faster speed tricks' combinations (torch_tricks.tuning.combine), on planted step times.

Every runner of the tune (the baselines, each trick, each combination) runs its real step and then sleeps for
a time planted by its configuration, much longer than the tiny model's step: the speeds the tune must find
are known, and no absolute time is asserted. The planted steps (plain 40 ms):

* fused AdamW alone 0.80 of plain, channels_last alone 0.88, both together ``both``.
"""

import math
import time
import tomllib

import pytest
import torch
import torch.nn as nn

import torch_tricks.tuning.builds as builds_mod
import torch_tricks.tuning.combine as combine_mod
from torch_tricks.tuning import tune
from torch_tricks.tuning.measure import Runner

PLAIN_S = 0.04
# everything but the two switches under test and the tricks that cannot run here is left out
SKIP = ["compile", "mixed_precision", "threads", "checkpointing", "gradient_accumulation", "memory_efficient_bn",
        "low_precision_optimizer_state", "optimizer_in_backward", "deterministic", "ema", "inplace_activations"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def _planted(monkeypatch, both: float) -> None:
    """Each runner sleeps PLAIN_S times the factor of its switches after its real step."""

    def factor(cfg) -> float:
        fused, cl = bool(cfg.fused_optimizer), bool(cfg.channels_last)
        return {(False, False): 1.0, (True, False): 0.80, (False, True): 0.88, (True, True): both}[(fused, cl)]

    class Planted(Runner):
        def __call__(self):
            out = super().__call__()
            time.sleep(PLAIN_S * factor(self.step.config))
            return out

    def build(real):
        def planted(*a, **kw):
            r = real(*a, **kw)
            r.__class__ = Planted
            return r
        return planted

    for mod in (builds_mod, combine_mod):
        monkeypatch.setattr(mod, "build_runner", build(mod.build_runner))


def _tune(tmp_path):
    torch.manual_seed(0)
    report = tune(Net, _batch(), budget_s=40, progress=False, skip=SKIP, name="net", threads=1)
    report.write(tmp_path)
    return report, tomllib.loads((tmp_path / "tricks.toml").read_text())["train"]


def test_the_pair_that_is_faster_together_is_picked_and_both_are_written(monkeypatch, tmp_path):
    _planted(monkeypatch, both=0.62)
    report, train = _tune(tmp_path)
    best = report.best_throughput
    assert best.name == "channels_last+fused_optimizer", [(r.name, r.ratio) for r in report.results + report.combos]
    assert best.vs_current_name == "fused_optimizer" and best.vs_current < 1 - report._margin(best.vs_current_half_ci)
    assert best.ratio == pytest.approx(0.62, abs=0.06) and best.peak_bytes is not None  # its memory run: picked
    assert train["fused_optimizer"] is True and train["channels_last"] is True
    assert "faster than fused_optimizer, which it extends, beyond the margin" in best.why


def test_a_trick_that_adds_nothing_on_top_is_left_off_because_the_pair_was_measured(monkeypatch, tmp_path):
    _planted(monkeypatch, both=0.80)  # channels_last alone is faster, on top of fused it adds nothing
    report, train = _tune(tmp_path)
    assert report.best_throughput.name == "fused_optimizer"
    pair = next(r for r in report.combos if r.name == "channels_last+fused_optimizer")
    assert pair.status == "measured" and not math.isnan(pair.vs_current)
    assert abs(pair.vs_current - 1) <= report._margin(pair.vs_current_half_ci)  # inside the margin of fused alone
    cl = next(r for r in report.results if r.name == "channels_last")
    assert cl.verdict == "faster"
    assert train == {"fused_optimizer": True, "channels_last": False, "threads": 1}  # shown no faster: written off
    assert "channels_last+fused_optimizer" in cl.why


def test_a_faster_trick_not_combined_for_the_budget_is_not_written_off(monkeypatch, tmp_path):
    _planted(monkeypatch, both=0.62)
    monkeypatch.setattr(combine_mod.Combining, "_joint_need", lambda self, rows: 1e9)  # no time for any build
    report, train = _tune(tmp_path)
    assert report.best_throughput.name == "fused_optimizer" and not report.combos
    assert "channels_last" not in train and train["fused_optimizer"] is True  # undecided: not written either way
    assert report.open_keys() == {"channels_last"}
    assert any("not combined for the budget: channels_last+fused_optimizer" in n for n in report.notes)
    cl = next(r for r in report.results if r.name == "channels_last")
    assert "not tried: over --budget-seconds" in cl.why


def test_combination_sets_skip_overlapping_and_invalid_switches_fastest_predicted_first():
    from torch_tricks.tuning.result import Result

    rows = [Result("a", "speed", {"fused_optimizer": True}, (), ratio=0.9),
            Result("bf16", "speed", {"precision": "bf16"}, (), ratio=0.7),
            Result("fp16", "speed", {"precision": "fp16"}, (), ratio=0.8),
            Result("c", "speed", {"channels_last": True}, (), ratio=0.95)]
    sets = combine_mod._combination_sets(rows)
    names = [n for _, n in sets]
    assert "bf16+fp16" not in names and not any("bf16" in n and "fp16" in n for n in names)
    assert names[:2] == ["a+bf16+c", "a+bf16"]  # 0.9 x 0.7 x 0.95, then 0.9 x 0.7: predicted fastest first
    assert len(names) == 7  # pairs: a+bf16 a+fp16 a+c bf16+c fp16+c; triples: a+bf16+c a+c+fp16
