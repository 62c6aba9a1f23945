"""How far the step is from the machine's limit (issue 22, item 6): the tune's report carries the MFU of the plain
step and of the recommendation, equal to FLOPs per step / step time / the cached peak of the dtype, and the peak
is read from the cache, not measured twice; the step's FLOPs are FlopCounterMode's."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import torch_tricks.inspect.peak as peak_mod
from torch_tricks.cli import main
from torch_tricks.inspect.peak import device_peak
from torch_tricks.tuning.efficiency import step_cost


def test_a_steps_flops_are_flop_counter_modes_forward_and_backward():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    cost = step_cost(model, {"device": "cpu", "fused_optimizer": False}, (x, y),
                     loss_fn=nn.functional.cross_entropy)
    with FlopCounterMode(display=False) as ref:
        nn.functional.cross_entropy(model(x), y).backward()
    assert cost.flops == ref.get_total_flops() > 0
    assert cost.traffic_bytes > 0 and 0 < cost.pointwise_bytes < cost.traffic_bytes


def test_the_report_carries_mfu_from_the_cached_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "cache"))
    peak = device_peak("cpu", max_size=256)  # measured once, here (small matmuls: quick)

    def measured_again(*args, **kwargs):
        raise AssertionError("the peak was measured again: the cache was not reused")

    monkeypatch.setattr(peak_mod, "_measure_all", measured_again)
    out = tmp_path / "out"
    code = main(["tune", "--model", "mlp", "--batch", "64", "--budget-seconds", "12", "--device", "cpu",
                 "--no-progress", "--out", str(out), *(a for t in ("compile", "ema", "deterministic")
                                                       for a in ("--skip", t))])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    eff = report["efficiency"]
    assert eff["status"] == "measured" and eff["peak_cached"] and eff["peak_key"] == peak.key, eff
    assert set(report["mfu"]) == {"plain", "recommended"}
    for label, row in eff["rows"].items():
        assert report["mfu"][label] == pytest.approx(eff["flops_per_step"] / row["step_s"] / peak.flops[row["dtype"]])
    assert eff["rows"]["plain"]["step_s"] == report["baseline"]["step_s"] and eff["rows"]["plain"]["dtype"] == "fp32"
    assert "MFU of the plain step" in (out / "report.md").read_text()  # report.md holds the printed lines


def test_without_a_cached_peak_and_a_small_budget_it_says_why_not(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "empty"))
    code = main(["tune", "--model", "mlp", "--batch", "16", "--budget-seconds", "6", "--no-progress", "--json",
                 *(a for t in ("compile", "ema", "deterministic") for a in ("--skip", t))])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["efficiency"]["status"] == "skipped"
    assert "torch-tricks peak" in report["efficiency"]["reason"] and report["mfu"] == {}
