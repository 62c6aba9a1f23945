"""T36, the batch of the most samples a second (issue 36): the tune times its recommendation at larger micro-batches
that ran under the memory limit, says what each gives against the batch tuned, writes a larger micro-batch only
where it keeps the effective batch (fewer accumulation steps), and otherwise states the lr rule and writes nothing."""

from __future__ import annotations

import json
import tomllib

import torch
import torch.nn as nn

from torch_tricks.tuning import tune
from torch_tricks.tuning.report import TuneReport
from torch_tricks.tuning.result import Result
from torch_tricks.tuning.throughput_batch import ThroughputBatch


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)


def test_larger_batches_are_run_under_the_limit_timed_and_stated_not_written(tmp_path):
    g = torch.Generator().manual_seed(0)
    report = tune(Tiny, (torch.randn(4, 32, generator=g), torch.randint(0, 4, (4,), generator=g)), budget_s=20,
                  progress=False, skip=["compile"])
    tb = report.throughput_batch
    assert tb["status"] == "measured", tb
    assert tb["batch"] == 4 and tb["accumulate"] == 1 and not tb["keeps_effective_batch"]
    rows = tb["rows"]
    assert [r["batch"] for r in rows] == [4, 8, 16][:len(rows)] and len(rows) >= 2
    assert "samples_vs_tuned" not in rows[0]  # the batch tuned: the reference
    for r in rows[1:]:
        assert r["samples_per_s"] == r["batch"] / r["step_s"] and r["rounds"] >= 5
    # the words follow the numbers: the choice is the most samples a second among those beyond the margin
    job = ThroughputBatch.__new__(ThroughputBatch)
    job._margin = lambda half: max(report.noise, half, report.min_effect)
    assert job._batch_choice(rows, 4, 1) == {k: tb[k] for k in ("choice", "reason", "written") if k in tb}
    if tb["choice"] is not None:
        factor = tb["choice"]["batch"] // 4
        assert f"scale the lr {factor}x" in tb["reason"] and "not written to [train]" in tb["reason"]
    # not written: the batch (and the effective batch) stay the user's
    paths = report.write(tmp_path)
    toml = paths["tricks.toml"].read_text()
    train = tomllib.loads(toml)["train"]
    assert "batch_size" not in train and "accumulate" not in train
    assert ("# throughput batch (T36): " in toml) == (tb["choice"] is not None)
    assert json.loads(paths["report.json"].read_text())["throughput_batch"]["rows"][0]["batch"] == 4
    assert any(line.startswith("throughput batch (samples a second of ") for line in report.summary_lines())


def _rows(gain: float, half: float) -> list[dict]:
    return [{"micro_batch": 4, "accumulate": 4, "batch": 16, "step_s": 0.4, "samples_per_s": 40.0, "rounds": 12},
            {"micro_batch": 8, "accumulate": 2, "batch": 16, "step_s": 0.4 / gain, "samples_per_s": 40.0 * gain,
             "rounds": 12, "samples_vs_tuned": gain, "half_ci": half}]


def test_fewer_accumulation_steps_are_written_only_beyond_the_margin():
    job = ThroughputBatch.__new__(ThroughputBatch)
    job._margin = lambda half: max(0.01, half, 0.02)
    inside = job._batch_choice(_rows(1.015, 0.01), 16, 4)
    assert inside["choice"] is None and "beyond the margin" in inside["reason"]
    won = job._batch_choice(_rows(1.3, 0.02), 16, 4)
    assert won["written"] and won["choice"]["accumulate"] == 2
    assert won["reason"] == ("micro-batch 8 x 2 accumulation steps: 1.30x the samples a second of the batch tuned, "
                             "the effective batch 16 kept")


def test_the_written_micro_batch_keeps_the_effective_batch_in_tricks_toml():
    report = TuneReport(model="net", batch=16, device="cpu", optimizer="adamw", memory_limit=1 << 30,
                        memory_limit_source="given", budget_s=60.0, noise=0.01)
    plain = Result("plain", "baseline", {}, (), status="measured", verdict="baseline", step_s=1.0, ratio=1.0)
    acc = Result("gradient_accumulation", "memory", {"accumulate": 4}, ("T11",), status="measured",
                 verdict="no measurable change", step_s=1.0, ratio=1.0)
    acc.chosen = True
    report.baseline, report.best_throughput, report.results = plain, acc, [acc]
    assert report.recommended_config()["accumulate"] == 4 and report.recommended_config()["batch_size"] == 4
    report.throughput_batch = {"status": "measured", "written": True, "rows": [],
                               "choice": {"micro_batch": 8, "accumulate": 2, "batch": 16}, "reason": "r"}
    cfg = report.recommended_config()
    assert cfg["accumulate"] == 2 and cfg["batch_size"] == 8  # 8 x 2 = the 16 tuned
    report.throughput_batch["choice"] = {"micro_batch": 16, "accumulate": 1, "batch": 16}
    cfg = report.recommended_config()
    assert cfg["accumulate"] == 1 and "batch_size" not in cfg  # the loader's batch is the one tuned
    report.best_batch = acc
    assert report.recommended_config("batch")["accumulate"] == 4  # the largest-batch file is another question
