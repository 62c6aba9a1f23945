"""The tune's distributed rows (issue 14): ``tune --processes 2`` and ``tune`` under torchrun time ddp,
zero1 and fsdp against one process and write per-rank memory and state; the decision; bad input."""

import json
import os
import subprocess
import sys
import tomllib

import pytest
import torch
import torch.nn as nn

from torch_tricks.cli import main
from torch_tricks.errors import UserError
from torch_tricks.tuning import distributed as D
from torch_tricks.tuning.distributed import MODES, check_world, recommend

pytestmark = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                                reason="this torch build has no gloo backend")

ROWS = {"one process", "one rank", *MODES}
# the single-process tricks are this module's background (tests/test_tune.py measures them): all but one left out
_SKIP = ("compile", "ema", "deterministic", "checkpointing", "gradient_accumulation", "inplace_activations",
         "memory_efficient_bn", "mixed_precision", "channels_last")
# the budget is a ceiling: alone, the race settles in 11-16 s; on a machine another test shares, the build of
# the lanes took past its share (0.6 of 24 s) once and zero1 was skipped; at 40 s (and at 60) a mode was skipped
# so in three of five full suites of session 19, beside the other worker's tunes: the writing test tries again
# once where a mode ran out of the phase's time (the product said so, rightly), rather than take longer always
TUNE = ["tune", "--model", "small_cnn", "--batch", "16", "--budget-seconds", "40", "--no-progress",
        *(a for name in _SKIP for a in ("--skip", name))]


def _small_cnn_param_bytes() -> int:
    from torch_tricks.models import get_model

    return sum(p.numel() * p.element_size() for p in get_model("small_cnn").parameters())


def _check_rows(d: dict, ranks: int = 2) -> dict:
    """What every distributed tune must show: a measured row per mode, each figure from the ranks."""
    assert d["status"] == "measured", d
    rows = {r["name"]: r for r in d["rows"]}
    assert set(rows) == ROWS
    assert d["processes"] == ranks and d["global_batch"] == 16 and d["per_rank_batch"] == 8
    assert d["rounds"] >= 5 and isinstance(d["settled"], bool)
    full = _small_cnn_param_bytes()
    for name in MODES:
        r = rows[name]
        assert r["status"] == "measured", r
        assert r["ranks"] == ranks and r["batch_per_rank"] == 8 and r["rounds"] == d["rounds"]
        assert r["step_s"] > 0 and r["samples_per_s"] == pytest.approx(16 / r["step_s"])
        assert r["throughput_vs_one_process"] > 0 and r["scaling_efficiency"] > 0
        assert r["peak_bytes"] >= r["state"]["params"] and len(r["peak_per_rank"]) == ranks
        assert r["loss_drift"] < 0.05  # the global batch split over the ranks trains what one process trains
        assert r["fits"] is True and r["verdict"]
    ddp, zero1, fsdp = rows["ddp"]["state"], rows["zero1"]["state"], rows["fsdp"]["state"]
    assert ddp["params"] == ddp["grads"] == full  # every rank holds the whole model and its gradients
    assert ddp["optimizer"] == 2 * full  # AdamW: two moments
    assert zero1["params"] == full and zero1["optimizer"] < ddp["optimizer"]  # ZeRO-1 shards the moments only
    assert fsdp["total"] <= 0.55 * ddp["total"]  # FSDP shards all three
    assert rows["fsdp"]["peak_bytes"] < rows["ddp"]["peak_bytes"]
    assert rows["one process"]["batch_per_rank"] == 16 and rows["one rank"]["batch_per_rank"] == 8
    assert d["recommended"] in ROWS - {"one rank"} and d["why"]
    return rows


def test_tune_processes_2_writes_rows_for_ddp_zero1_fsdp(tmp_path, capsys):
    for attempt in (1, 2):  # a second time only where the first ran out of its phase's time on a busy machine
        code = main([*TUNE, "--processes", "2", "--out", str(tmp_path)])
        out, err = capsys.readouterr()
        assert code == 0, err
        d = json.loads((tmp_path / "report.json").read_text())["distributed"]
        if not any("over the budget" in r.get("reason", "") for r in d.get("rows", [])):
            break
    _check_rows(d)
    assert d["launched_by"] == "tune --processes 2"
    cores = len(os.sched_getaffinity(0))
    assert d["threads_per_rank"] == max(1, cores // 2)  # the ranks share this machine's cores
    for name in ("ddp", "zero1", "fsdp", "one process", "scaling eff.", "peak/rank"):
        assert name in out
    assert f"distributed: recommended {d['recommended']}" in out
    assert (tmp_path / "report-distributed.png").stat().st_size > 0
    assert "## Distributed: ddp, zero1, fsdp" in (tmp_path / "report.md").read_text()
    cfg = tomllib.loads((tmp_path / "tricks.toml").read_text())["train"]
    if d["recommended"] == "one process":
        assert cfg["distributed"] == "off" and cfg.get("batch_size", 16) == 16  # the batch tuned: not restated
    else:  # fit's batch_size is per rank
        assert cfg["distributed"] == d["recommended"] and cfg["batch_size"] == 8


def test_tune_under_torchrun_uses_the_ranks_it_was_given(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # what torchrun sets for each rank when it is not set already
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "torch_tricks.cli", *TUNE, "--out", str(tmp_path)]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("distributed: recommended") == 1  # rank 0 prints, the other rank does not
    d = json.loads((tmp_path / "report.json").read_text())["distributed"]
    _check_rows(d)
    assert d["launched_by"] == "torchrun"
    assert d["threads_per_rank"] == 1  # the launcher's OMP_NUM_THREADS=1 for each rank ...
    assert d["one_process_threads"] == len(os.sched_getaffinity(0))  # ... one process gets the whole host


@pytest.mark.parametrize("argv, needle", [
    (["--processes", "3"], "the batch 16 is the global batch, split across 3 processes, and 3 does not divide it: "
                           "give --batch a multiple of 3 (e.g. 15 or 18)"),
    (["--processes", "1"], "--processes 1: give 2 or more"),
])
def test_bad_process_counts_are_one_line_and_exit_2(capsys, argv, needle):
    assert main([*TUNE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_processes_under_torchrun_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*TUNE, "--processes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--processes launches the ranks itself" in err, err


def test_a_world_under_torchrun_that_does_not_divide_the_batch_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun --nproc_per_node 3 sets it: said before any rank waits
    assert main(TUNE) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "split across 3 processes, and 3 does not divide it" in err, err
    check_world(4, 32, torch.device("cpu"))  # divides: no error


class _Unpicklable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.hook = lambda x: x  # a lambda does not pickle: the ranks cannot be sent this model

    def forward(self, x):
        return self.fc(self.hook(x))


def test_a_model_the_ranks_cannot_receive_is_reported_and_the_tune_goes_on():
    from torch_tricks.tuning import tune

    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    report = tune(_Unpicklable(), batch, budget_s=6, progress=False, processes=2,
                  skip=("compile", "deterministic", "ema", "checkpointing", "gradient_accumulation"))
    d = report.distributed
    assert d["status"] == "failed" and "cannot be sent to the ranks" in d["reason"], d
    assert "distributed (2 processes): failed: the model, batch or loss/optimizer functions cannot be sent" \
        in report.to_text()
    assert report.baseline.step_s > 0  # the single-process tune stands
    assert "distributed" not in report.recommended_config()


# -- the decision ---------------------------------------------------------------------------------

def _row(name, time_ratio, peak, *, drift=0.0, status="measured", share=1.0):
    r = {"name": name, "status": status, "step_s": 0.1 * time_ratio, "peak_bytes": peak, "loss_drift": drift,
         "vs_one_process": time_ratio, "vs_one_process_half_ci": 0.01,
         "throughput_vs_one_process": share / time_ratio, "throughput_vs_one_process_half_ci": 0.01}
    if name == "one process":
        r.pop("vs_one_process"), r.pop("throughput_vs_one_process")
    return r


def _result(*rows, device="cpu"):
    return {"status": "measured", "device": device, "rows": list(rows)}


def test_recommend_keeps_one_process_when_no_mode_beats_it():
    res = _result(_row("one process", 1.0, 100), _row("one rank", 0.6, 60, share=0.5), _row("ddp", 1.3, 100),
                  _row("zero1", 1.5, 90), _row("fsdp", 1.9, 70))
    rec, why = recommend(res, 10_000, local_ranks=2)
    assert rec == "one process" and "the fastest, ddp, gives 0.77x" in why
    assert {r["name"]: r["verdict"] for r in res["rows"]}["fsdp"] == "slower than one process"


def test_recommend_takes_the_fastest_mode_beyond_the_margin():
    res = _result(_row("one process", 1.0, 100), _row("ddp", 0.55, 100), _row("zero1", 0.8, 90), _row("fsdp", 0.9, 60))
    rec, why = recommend(res, 10_000, local_ranks=2)
    assert rec == "ddp" and why.startswith("1.82x (±")


def test_recommend_prefers_the_leaner_of_modes_within_the_margin():
    res = _result(_row("one process", 1.0, 100), _row("ddp", 0.60, 100), _row("zero1", 0.605, 80),
                  _row("fsdp", 0.8, 50))
    rec, why = recommend(res, 10_000, local_ranks=2)
    assert rec == "zero1" and "within the margin of ddp, the smallest per-rank peak" in why


def test_recommend_fits_the_per_rank_limit_first():
    # the host's 200 bytes shared by 2 ranks: 100 each; one process (250) and ddp (120 per rank) do not fit
    res = _result(_row("one process", 1.0, 250), _row("ddp", 0.5, 120), _row("zero1", 0.7, 110),
                  _row("fsdp", 0.9, 80))
    rec, why = recommend(res, 200, local_ranks=2)
    assert rec == "fsdp" and why.startswith("one process does not fit the memory limit; fsdp fits")
    assert res["memory_limit_per_rank"] == 100
    assert [r["fits"] for r in res["rows"]] == [False, False, False, True]  # one process has the whole 200
    # on CUDA every rank has a device of its own: the limit is per rank as given
    res = _result(_row("one process", 1.0, 250), _row("ddp", 0.5, 120), _row("fsdp", 0.9, 80), device="cuda")
    assert recommend(res, 200, local_ranks=2)[0] == "ddp"


def test_recommend_never_takes_a_mode_whose_loss_drifts_or_nothing_that_fits():
    res = _result(_row("one process", 1.0, 100), _row("ddp", 0.5, 100, drift=0.2), _row("fsdp", 1.5, 60))
    assert recommend(res, 10_000, local_ranks=2)[0] == "one process"
    assert res["rows"][1]["verdict"].startswith("trains something else: its loss differs from one process's by 20.0%")
    res = _result(_row("one process", 1.0, 500), _row("ddp", 0.5, 400), _row("fsdp", 0.7, 300))
    rec, why = recommend(res, 400, local_ranks=2)
    assert rec is None and "nothing measured fits the memory limit" in why


# -- when the rounds stop -------------------------------------------------------------------------

def _lane(name, times, *, peak=100, everyone=True, step=True):
    lane = D._Lane(name, "off" if not everyone else name, everyone, None, None)
    lane.row.update(status="measured", peak_bytes=peak)
    lane.times = list(times)
    lane.step = (lambda batch: None) if step else None
    return lane


def test_the_rounds_are_settled_once_more_of_them_would_not_change_the_recommendation():
    one = [1.0, 1.02, 0.98, 1.01] * 5
    settled = D._settled
    slower = [_lane("one process", one, everyone=False), _lane("ddp", [1.6 * t for t in one]),
              _lane("fsdp", [2.5 * t for t in one])]
    assert settled(slower, limit=1000, min_effect=0.02)  # no mode can beat one process: keep it
    faster = [_lane("one process", one, everyone=False), _lane("ddp", [0.7 * t for t in one])]
    assert settled(faster, limit=1000, min_effect=0.02)  # faster, and its ratio known to within 1%
    noisy = [_lane("one process", one, everyone=False), _lane("ddp", [0.9 * t * (1.3 if i % 2 else 0.8)
                                                                      for i, t in enumerate(one)])]
    assert not settled(noisy, limit=1000, min_effect=0.02)  # might be faster: how much is not known yet
    assert not settled(slower, limit=50, min_effect=0.02)  # one process over the limit: the modes race on time
    failed = [_lane("one process", one, everyone=False), _lane("ddp", [0.7 * t for t in one]), *noisy[1:]]
    failed[-1].step = None  # a mode that failed in the rounds is not waited for
    assert settled(failed, limit=1000, min_effect=0.02)


@pytest.mark.parametrize("answer_at, want", [(None, (60, False)), (2, (24, True))])
def test_the_rounds_ask_from_the_settle_rounds_on_every_fifth_and_stop_when_settled(answer_at, want):
    lanes = [_lane("one process", [], everyone=False), _lane("ddp", [])]
    asked = []

    def settled():
        asked.append(len(lanes[0].times))
        return len(asked) == answer_at

    got = D._rounds(lanes, seed=0, rank=0, dev=torch.device("cpu"), deadline=float("inf"), settled=settled)
    assert got == want and len(lanes[0].times) == len(lanes[1].times) == want[0]
    assert asked == [20, 24, 29, 35, 42, 51][:len(asked)] and asked[-1] <= want[0]
