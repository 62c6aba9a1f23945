"""Contenders first, and the pacing of what follows them, on a fake clock (torch_tricks.tuning.contenders).

The tune's state is built as ``tune`` builds it, with runners and memory runs that cost planted seconds on a
fake clock: what the phases start, skip and say depends only on those seconds, so the budget rules are
tested exactly, whatever the machine's load.
"""

import functools
import time
from types import SimpleNamespace

import pytest
import torch

import torch_tricks.tuning.builds as builds_mod
import torch_tricks.tuning.combine as combine_mod
import torch_tricks.tuning.contenders as contenders_mod
from torch_tricks.train.config import TrainConfig
from torch_tricks.tuning.candidates import Candidate
from torch_tricks.tuning.measure import Memory
from torch_tricks.tuning.race import Race
from torch_tricks.tuning.report import TuneReport
from torch_tricks.tuning.result import Result
from torch_tricks.tuning.tuner import _Tune

BUILD_S, MEMORY_S, STEP_S = 2.0, 1.0, 0.1


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeRunner:
    """A runner whose every call takes ``seconds`` of the fake clock."""

    def __init__(self, clock: FakeClock, seconds: float, cfg: dict) -> None:
        self.clock, self.seconds = clock, seconds
        self.first_call_s, self.losses, self.grads, self.probe_s = seconds, [1.0, 0.9, 0.8], None, seconds / 8
        self.step_times = [seconds] * 3
        self.step = SimpleNamespace(config=TrainConfig().replace(**{k: v for k, v in cfg.items() if k != "seed"}),
                                    device=torch.device("cpu"))
        self.error = None

    def __call__(self) -> None:
        self.clock.t += self.seconds


@pytest.fixture
def clock(monkeypatch):
    """The fake clock in every module of the tune that reads one, its races included; builds and memory runs
    cost BUILD_S and MEMORY_S of it, a step STEP_S (times a planted factor for memory tricks: 1.3)."""
    c = FakeClock()
    monkeypatch.setattr(time, "perf_counter", c)

    def build(name, model, cfg, batches, **kw):
        c.t += BUILD_S
        return FakeRunner(c, STEP_S * (1.3 if name in ("checkpointing", "ema") else 1.0), cfg)

    def memory(model, cfg, batch, **kw):
        c.t += MEMORY_S
        return Memory(peak_bytes=1000, state_bytes=100, activation_bytes=500, bytes_per_sample=50.0, micro_batch=4)

    for mod in (builds_mod, combine_mod):
        monkeypatch.setattr(mod, "build_runner", build)
    monkeypatch.setattr(builds_mod, "measure_memory", memory)
    for mod in (contenders_mod, combine_mod):
        monkeypatch.setattr(mod, "Race", functools.partial(Race, clock=c))
    return c


def _job(clock: FakeClock, budget: float, memory_limit_source: str = "ram") -> _Tune:
    report = TuneReport(model="fake", batch=4, device="cpu", optimizer="adamw", memory_limit=10_000,
                        memory_limit_source=memory_limit_source, budget_s=budget)
    bar = SimpleNamespace(update=lambda n=1: None, set_postfix_str=lambda *a, **k: None, close=lambda: None)
    base_cfg = {"optimizer": "adamw", "lr": 1e-3, "fused_optimizer": False, "device": "cpu", "seed": 0,
                "batch_size": 4, "threads": 1}
    job = _Tune(torch.nn.Linear(2, 2), [None], base_cfg, {"loss_fn": None, "optimizer_fn": None}, 10_000, report,
                bar, clock.t, budget, False, False)
    job.base = job.twin = FakeRunner(clock, STEP_S, base_cfg)
    job.step_s, job.build_s, job.memory_s, job.setup_s = STEP_S, BUILD_S, MEMORY_S, BUILD_S + MEMORY_S
    job.compile_reserve = 0.0
    report.baseline = Result("plain", "baseline", {}, (), status="measured", peak_bytes=1000, bytes_per_sample=50.0)
    report.noise = 0.01
    return job


SPEED = Candidate("fused_optimizer", {"fused_optimizer": True}, "speed")
MEMORY = Candidate("checkpointing", {"checkpointing": "blocks"}, "memory")
COST = Candidate("ema", {"ema": True}, "cost")


def test_the_speed_question_sets_up_the_speed_tricks_first(clock):
    job = _job(clock, 60)
    first, later = job._contenders_first([MEMORY, SPEED, COST])
    assert [c.name for c in first] == ["fused_optimizer"] and [c.name for c in later] == ["checkpointing", "ema"]


@pytest.mark.parametrize("source", ["given"])
def test_a_memory_question_sets_up_every_trick_first(clock, source):
    job = _job(clock, 60, memory_limit_source=source)
    assert job._contenders_first([MEMORY, SPEED])[1] == []
    job = _job(clock, 60)
    job.report.baseline.peak_bytes = 20_000  # the plain step does not fit the limit
    assert job._contenders_first([MEMORY, SPEED])[1] == []


def test_the_later_tricks_are_set_up_and_timed_for_their_cost_within_the_budget(clock):
    job = _job(clock, 60)
    rows = [Result(c.name, c.goal, c.changes, c.ids) for c in (MEMORY, COST)]
    job._later_phase([MEMORY, COST], rows)
    assert all(r.status == "measured" for r in rows), [(r.name, r.reason) for r in rows]
    for r in rows:  # timed in their own race with plain, for their cost only: the least rounds, then out
        assert r.rounds == 5 and "timed for its cost only" in r.left_reason
        assert r.ratio == pytest.approx(1.3) and r.verdict == "slower"
    assert clock() <= job.train_end


def test_later_tricks_the_time_left_cannot_hold_are_skipped_with_the_budget_that_would_do_them(clock):
    job = _job(clock, 60)
    clock.t = job.train_end - 4.0  # one set-up (3 s) and its least timing (6 x 3 x 0.1 s) do not fit in 4 s
    rows = [Result(c.name, c.goal, c.changes, c.ids) for c in (MEMORY, COST)]
    job._later_phase([MEMORY, COST], rows)
    assert [r.status for r in rows] == ["skipped", "skipped"]
    for r in rows:
        assert r.reason.startswith("over --budget-seconds: a ") and "measured after the speed tricks" in r.reason
        assert "--budget-seconds 70)" in r.reason  # 2 set-ups of 3.6 s and 6 rounds of 3 steps: ~10 s more
    assert clock() <= job.train_end and job.later is None


def test_the_joint_race_builds_only_the_combinations_the_time_left_holds(clock):
    job = _job(clock, 60)
    rows = [Result(n, "speed", ch, (), status="measured", ratio=r, verdict="faster", runner=FakeRunner(clock, STEP_S * r, {}))
            for n, ch, r in (("a", {"fused_optimizer": True}, 0.8), ("b", {"channels_last": True}, 0.9),
                             ("c", {"deterministic": True}, 0.95))]
    end = clock() + 1.5 * MEMORY_S + job._joint_need(4) + 0.5  # one combination's build and race, not two
    assert job._run_joint(rows, end)
    assert [r.name for r in job.joint_rows[3:]] == ["a+b+c"]  # the fastest predicted was built
    assert job.joint_not_built == ["a+b", "a+c", "b+c"]
    assert clock() <= end + job._race_need(5, 5)  # past the end only by the least race it always runs


def test_the_later_race_times_only_the_lanes_whose_least_rounds_fit(clock):
    job = _job(clock, 60)
    rows = [Result(c.name, c.goal, c.changes, c.ids, status="measured", peak_bytes=900,
                   runner=FakeRunner(clock, STEP_S * 1.3, {})) for c in (MEMORY, COST)]
    clock.t = job.train_end - 1.5  # plain's 6 calls (0.6 s) and one trick's (0.78 s) fit in 1.5 s; not two
    job._race_later(rows)
    assert rows[0].rounds == 5 and rows[0].ratio == pytest.approx(1.3)
    assert rows[1].runner is None and rows[1].rounds is None and rows[1].verdict == "not timed"
    assert rows[1].reason.startswith("not timed: over --budget-seconds") and rows[1].peak_bytes == 900
    assert clock() <= job.train_end
