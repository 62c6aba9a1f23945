"""How far the step is from the machine's limit (issue 22, item 6): the tune's report carries the MFU of the plain
step and of the recommendation, equal to FLOPs per step / step time / the cached peak of the dtype, and the peak
is read from the cache, not measured twice; the step's FLOPs are FlopCounterMode's."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import torch_tricks.inspect.peak as peak_mod
from torch_tricks.cli import main
from torch_tricks.inspect.peak import device_peak
from torch_tricks.tuning.efficiency import efficiency, step_cost


def test_a_steps_flops_are_flop_counter_modes_forward_and_backward():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    cost = step_cost(model, {"device": "cpu", "fused_optimizer": False}, (x, y),
                     loss_fn=nn.functional.cross_entropy)
    with FlopCounterMode(display=False) as ref:
        nn.functional.cross_entropy(model(x), y).backward()
    assert cost.flops == ref.get_total_flops() > 0
    assert cost.traffic_bytes > 0 and 0 < cost.pointwise_bytes < cost.traffic_bytes


def _tune_mlp(out) -> int:
    """``torch-tricks tune`` of the built-in mlp for 12 s into ``out`` (compile, ema, deterministic left out)."""
    return main(["tune", "--model", "mlp", "--batch", "64", "--budget-seconds", "12", "--device", "cpu",
                 "--no-progress", "--out", str(out), *(a for t in ("compile", "ema", "deterministic")
                                                       for a in ("--skip", t))])


def test_the_report_carries_mfu_from_the_cached_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "cache"))
    peak = device_peak("cpu", max_size=256)  # measured once, here (small matmuls: quick)

    def measured_again(*args, **kwargs):
        raise AssertionError("the peak was measured again: the cache was not reused")

    monkeypatch.setattr(peak_mod, "_measure_all", measured_again)
    out = tmp_path / "out"
    code = _tune_mlp(out)
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


# -- a step faster than the cached peak (issue 35, item 5): the peak measured again, or the MFU withheld -------

_LOW = 1e6  # FLOP/s: a planted peak far below what any machine does, as a disturbed measurement would cache


def _plant_low_peak() -> str:
    """A cache entry for this machine whose peak every step beats; its key."""
    key = peak_mod.machine_key(torch.device("cpu"))
    peak_mod._write(peak_mod.cache_path(), {key: {
        "device": "planted", "flops": dict.fromkeys(peak_mod.DTYPES, _LOW), "size": dict.fromkeys(peak_mod.DTYPES, 256),
        "measured_at": "2020-01-01 00:00:00", "notes": []}})
    return key


def _mlp_cost():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    return step_cost(model, {"device": "cpu", "fused_optimizer": False}, batch, loss_fn=nn.functional.cross_entropy)


def test_a_step_faster_than_the_cached_peak_has_the_peak_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "cache"))
    key, cost = _plant_low_peak(), _mlp_cost()
    planted = device_peak("cpu")
    assert planted.cached and planted.flops["fp32"] == _LOW
    steps = {"plain": ("plain", "fp32", cost.flops / (4 * _LOW))}  # 4x the planted peak: an MFU of 400%
    out = efficiency(cost, planted, steps, remeasure=lambda: device_peak("cpu", refresh=True, max_size=256))
    cached = json.loads(peak_mod.cache_path().read_text())[key]
    assert cached["flops"]["fp32"] == out.peak_flops["fp32"] > 100 * _LOW  # the new figure replaced the entry
    row = out.rows["plain"]
    assert row["mfu"] == pytest.approx(4 * _LOW / out.peak_flops["fp32"]) and 0 < row["mfu"] <= 1.0
    assert not out.peak_cached and not out.withheld
    assert "the cached peak (fp32 1.0 MFLOP/s, measured 2020-01-01 00:00:00) was below what a step achieved: " \
           "measured again now" in out.lines()
    assert "MFU of the plain step: 0% " in out.lines()[0] and "measured now" in out.lines()[0]


def test_without_a_new_measurement_the_mfu_over_the_peak_is_withheld(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "cache"))
    _plant_low_peak()
    cost, planted = _mlp_cost(), device_peak("cpu")
    steps = {"plain": ("plain", "fp32", cost.flops / (2 * _LOW)), "recommended": ("bf16", "bf16", cost.flops / (_LOW / 2))}
    out = efficiency(cost, planted, steps)  # no remeasure: the caller has no time for a measurement
    assert out.rows["plain"]["mfu"] is None and out.rows["plain"]["flops_per_s"] == pytest.approx(2 * _LOW)
    assert out.rows["recommended"]["mfu"] == pytest.approx(0.5)  # bf16's peak was not beaten: its MFU stands
    assert out.withheld == ("MFU withheld: a step achieved more (fp32 2.0 MFLOP/s of model FLOPs) than this machine's "
                            "matmul peak (fp32 1.0 MFLOP/s, cached, measured 2020-01-01 00:00:00): that peak is too "
                            "low (its measurement was disturbed); measure it again on a quiet machine with "
                            "`torch-tricks peak --refresh --device cpu`")
    lines = out.lines()
    assert lines[0].startswith("MFU of the plain step: withheld (2.0 MFLOP/s") and out.withheld in lines
    assert _printed_mfus("\n".join(lines)) == [50]

    def low_again(dev, dtype, max_size):  # a measurement disturbed again: the step still beats it
        return _LOW, 256

    again = efficiency(cost, planted, steps,
                       remeasure=lambda: device_peak("cpu", refresh=True, measure=low_again, max_size=256))
    assert again.rows["plain"]["mfu"] is None and again.remeasured
    assert "(fp32 1.0 MFLOP/s, measured again now)" in again.withheld


def test_a_tune_against_a_low_cached_peak_prints_no_mfu_over_100(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "cache"))
    key = _plant_low_peak()
    out = tmp_path / "out"
    code = _tune_mlp(out)
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    eff, printed = report["efficiency"], capsys.readouterr().out + (out / "report.md").read_text()
    assert eff["status"] == "measured" and eff["rows"], eff
    assert all(m is None or 0 < m <= 1.0 for m in report["mfu"].values()), report["mfu"]
    assert all(n <= 100 for n in _printed_mfus(printed)) and "MFU of the plain step" in printed
    if eff["remeasured"]:  # the tune had the time to measure the peak again: the new figure is cached
        assert json.loads(peak_mod.cache_path().read_text())[key]["flops"]["fp32"] == eff["peak_flops"]["fp32"] > _LOW
        assert eff["remeasured"] in printed
    if any(m is None for m in report["mfu"].values()):  # else withheld, said so with the way to refresh the peak
        assert "MFU withheld" in eff["withheld"] and "torch-tricks peak --refresh" in eff["withheld"]
        assert eff["withheld"] in printed
    assert eff["remeasured"] or eff["withheld"]  # the planted peak was beaten: one or the other happened


def _printed_mfus(text: str) -> list[int]:
    """Every ``MFU ...: N%`` figure in ``text``."""
    return [int(n) for n in re.findall(r"MFU of [^:]*: (\d+)%", text)]
