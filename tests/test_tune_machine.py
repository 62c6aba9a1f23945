"""The tune on the machine as it is (issue 35, item 3): the step's scaling with threads measured before the race,
``threads`` raced as a switch and carried into tricks.toml, ``threads=N`` forcing it, and other processes' CPU use
said in the report's first line."""

from __future__ import annotations

import tomllib

import pytest
import torch
import torch.nn as nn

import torch_tricks.tuning.racing as racing_mod
import torch_tricks.tuning.tuner as tuner_mod
from torch_tricks.errors import UserError
from torch_tricks.machine import ForeignLoad
from torch_tricks.tuning import TuneReport, tune

SKIP = ["compile", "mixed_precision", "ema", "deterministic", "checkpointing", "gradient_accumulation",
        "low_precision_optimizer_state", "optimizer_in_backward", "memory_efficient_bn", "inplace_activations",
        "channels_last"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.body(x)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)


@pytest.fixture
def two_threads(monkeypatch):
    """The tune's process on two intra-op threads (the test workers run on one), put back after; short races."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(racing_mod, "_MAX_ROUNDS", 20)
    monkeypatch.setattr(racing_mod, "_MAX_SIDE_ROUNDS", 10)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(tuner_mod.available_cores() < 2, reason="needs two cores to race one thread against two")
def test_threads_are_raced_and_the_recommendation_carries_the_count_every_step_ran_at(two_threads, tmp_path):
    report = tune(Net, _batch(), budget_s=30, progress=False, skip=SKIP)
    assert torch.get_num_threads() == 2  # the process's count is put back after the tune
    probe = report.threads["probe_s"]
    assert set(probe) == {"1", "2"} and all(v > 0 for v in probe.values())
    lane = next(r for r in report.results if r.name.startswith("threads:"))
    if report.threads.get("chosen_at_start"):  # one thread was faster at the start: every lane ran at one
        assert probe["1"] < 0.9 * probe["2"] and lane.name == "threads:2" and report.threads["threads"] == 1
    else:
        assert lane.name == "threads:1" and report.threads["threads"] == 2
    assert lane.status.startswith("measured") and lane.verdict, lane  # raced, or decided slower by its probe
    cfg = report.recommended_config()
    chosen = report.best_throughput.changes.get("threads")
    expected = chosen if chosen is not None else (1 if report.threads.get("chosen_at_start") else 0)
    if any(r is lane for r in report.undecided()) and not report.threads.get("chosen_at_start"):
        expected = None  # faster, but inside the noise: no call, the key not written (the process's own stays)
    assert cfg.get("threads") == expected, (cfg, report.threads, lane.verdict)  # 0: the process's own, as plain ran
    report.write(tmp_path)
    assert tomllib.loads((tmp_path / "tricks.toml").read_text())["train"].get("threads") == expected


def test_threads_given_fix_every_lane_and_are_written(two_threads):
    report = tune(Net, _batch(), budget_s=20, progress=False, skip=SKIP + ["fused_optimizer"], threads=1)
    assert not any(r.name.startswith("threads:") for r in report.results)  # fixed by the caller: not raced
    assert report.threads == {"threads": 1, "given": True} and report.recommended_config()["threads"] == 1
    with pytest.raises(UserError, match=r"threads = 0: give 1"):
        tune(Net, _batch(), budget_s=5, progress=False, threads=0)


class _Busy:
    """A load monitor that saw other processes use 1.5 of 2 cores."""

    def start(self):
        return self

    def stop(self, hold=True):
        return ForeignLoad(wall_s=10.0, foreign_s=15.0, own_s=5.0, source="/proc/stat", cores=2)


def test_a_shared_machine_is_the_first_line_of_every_view(monkeypatch, tmp_path):
    monkeypatch.setattr(tuner_mod, "LoadMonitor", _Busy)
    report = tune(Net, _batch(), budget_s=8, progress=False, skip=SKIP + ["fused_optimizer"], threads=1)
    assert report.machine["shared"] and report.machine["foreign_cores"] == pytest.approx(1.5)
    first = report.to_text().splitlines()[0]
    assert first.startswith("shared machine: other processes used 1.50 of 2 cores during the tune"), first
    assert "taskset" in first and "beyond the noise measured under that load" in first
    report.write(tmp_path)
    assert (tmp_path / "report.md").read_text().splitlines()[2].startswith("**shared machine: other processes")
    import json

    assert json.loads((tmp_path / "report.json").read_text())["machine"]["shared"] is True


def test_a_quiet_machine_adds_no_line():
    report = TuneReport(model="m", batch=1, device="cpu", optimizer="adamw", memory_limit=1 << 30,
                        memory_limit_source="given", budget_s=10.0)
    report.machine = {"shared": False, "text": "other processes used 0.01 of 2 cores during the tune"}
    assert report.machine_lines() == []
