"""tune(): every figure from a measurement, skipped and failed tricks with reasons, the memory
limit, and tricks.toml taken as it is by TrainConfig / fit.

Tiny models: a tune of one finishes in seconds, well inside its budget (the rounds are
capped), and the budgets leave room for a busy shared machine. No absolute times are
asserted, only what the tune did and how the report says it.
"""

import json
import math
import random
import statistics
import time
import tomllib
from typing import Any

import pytest
import torch
import torch.nn as nn

import torch_tricks.tuning.builds as builds_mod
import torch_tricks.tuning.combine as combine_mod
import torch_tricks.tuning.contenders as contenders_mod
import torch_tricks.tuning.racing as racing_mod
import torch_tricks.tuning.tuner as tuner_mod
from torch_tricks.registry import list_tricks
from torch_tricks.train import TrainConfig, fit, load_config
from torch_tricks.tuning import TuneReport, example_batch, parse_size, tune
from torch_tricks.tuning.candidates import Candidate
from torch_tricks.tuning.measure import measure_memory, paired_ratio
from torch_tricks.tuning.race import Lane, Race
from torch_tricks.tuning.race import race as run_race
from torch_tricks.tuning.tuner import TUNED_KEYS
from torch_tricks.errors import UserError


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.bn(self.conv(x)))


class TinyNet(nn.Module):
    """Repeated residual blocks (checkpointing applies), activations much larger than the weights."""

    def __init__(self, c: int = 16, n: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(n)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class Flaky(nn.Module):
    """Fails under two configurations, as real models do: ``.view`` of a channels_last tensor raises at
    once, and (standing in for a kernel that breaks after a while) the 8th forward under the switch of the
    candidate the test plants (deterministic algorithms: as fast as plain on any CPU, so it is always
    timed) raises: 5 forwards are its set-up (probe, gradients, 3 drift steps), the 6th its warm-up, the
    8th its second timed round."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 8 * 8, 10)
        self.planted_calls = 0

    def forward(self, x):
        y = self.features(x)
        if torch.are_deterministic_algorithms_enabled():
            self.planted_calls += 1
            if self.planted_calls > 7:
                raise RuntimeError("flaky kernel gave up")
        return self.head(y.view(y.size(0), -1))


def _batch(n=16, size=16, classes=10):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.fixture(scope="module")
def tuned():
    """One real tune of TinyNet, with every timing and memory measurement recorded on the side."""
    races, measured = [], []
    real_mem = builds_mod.measure_memory

    class SpyRace(Race):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            races.append(self)

    def spy_mem(model, config, batch, **kw):
        m = real_mem(model, config, batch, **kw)
        measured.append((dict(config), m))
        return m

    mp = pytest.MonkeyPatch()
    for mod in (racing_mod, contenders_mod, combine_mod):  # every race of the tune
        mp.setattr(mod, "Race", SpyRace)
    mp.setattr(builds_mod, "measure_memory", spy_mem)
    try:
        torch.manual_seed(0)
        report = tune(TinyNet, _batch(), budget_s=40, progress=False, skip=["compile"], name="tinynet")
    finally:
        mp.undo()
    return report, races, measured


@pytest.fixture
def short_races(monkeypatch):
    """The races' cap (a safety net: a race normally ends settled, or at its deadline) lowered, for the tests
    that ask about memory or plumbing rather than a speed verdict: their tunes then take seconds, not the
    150 rounds the noise resolution would spend, while their budgets still leave room for a busy machine."""
    monkeypatch.setattr(racing_mod, "_MAX_ROUNDS", 30)
    monkeypatch.setattr(racing_mod, "_MAX_SIDE_ROUNDS", 20)


def _finite(x):
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def test_every_figure_comes_from_a_measurement(tuned):
    report, races, measured = tuned
    main = {lane.name: lane.times for lane in races[0].lanes}  # the race of all single tricks with both baselines
    assert {"plain", "plain (A/A)"} <= set(main)
    assert report.rounds == races[0].rounds == len(main["plain"]) == len(main["plain (A/A)"]) >= 5
    # the A/A noise is the disagreement of the two identical baselines, as timed
    aa, aa_half = paired_ratio(main["plain (A/A)"], main["plain"])
    assert report.aa_ratio == aa and report.aa_half_ci == aa_half
    assert report.noise == max(abs(aa - 1), aa_half)
    assert report.baseline.step_s == statistics.median(main["plain"])
    timed_singles = [r for r in report.results if r.status == "measured"]
    assert len(timed_singles) >= 3, [(r.name, r.status, r.reason) for r in report.results]
    for r in timed_singles:
        race = _race_of(races, r)  # the speed tricks' race, or (memory and cost tricks) the one after it
        times = {lane.name: lane.times for lane in race.lanes}
        assert r.step_s == statistics.median(times[r.name])
        assert (r.ratio, r.ratio_half_ci) == paired_ratio(times[r.name], times["plain"])
        assert r.rounds == len(times[r.name]) >= 5 and r.race_rounds == race.rounds
        assert r.speedup == pytest.approx(1 / r.ratio)
        for figure in (r.peak_bytes, r.state_bytes, r.activation_bytes, r.grad_drift, r.loss_drift, r.first_call_s):
            assert _finite(figure), (r.name, r)
        # the memory figures are those measure_memory returned for this very configuration
        mems = [m for cfg, m in measured if all(cfg.get(k) == v for k, v in r.changes.items())
                and all(cfg.get(k) in (None, False, "", 1, "fp32") or k in r.changes for k in TUNED_KEYS
                        if k != "threads") and cfg.get("threads") == r.changes.get("threads", report.threads["threads"])]
        assert any(m.peak_bytes == r.peak_bytes and m.activation_bytes == r.activation_bytes for m in mems), r.name
    # a figure not measured is absent, never filled in
    for r in report.results + report.combos:
        if r.status in ("skipped", "failed"):
            assert r.step_s is None and r.ratio is None and r.reason, r
    data = json.loads(json.dumps(report.to_dict()), parse_constant=lambda c: pytest.fail(f"{c} in report.json"))
    assert data["baseline"]["step_s"] == report.baseline.step_s
    assert data["noise"] == report.noise and data["rounds"] == report.rounds
    assert data["stop_reason"] == report.stop_reason and data["phase_s"] == report.phase_s


def _race_of(races, r):
    """The race ``r``'s row was read from: the single speed tricks' (the first), else the memory and cost
    tricks' race after the speed question (the one without an A/A twin that has its lane)."""
    if r.goal == "speed":
        return races[0]
    return next(race for race in races[1:] if race.twin is None and any(lane.name == r.name for lane in race.lanes))


def test_the_race_drops_what_cannot_win_and_says_why(tuned):
    report, races, _ = tuned
    assert report.stop_reason.startswith(("settled: after ", "budget: ", "cap: ")), report.stop_reason
    assert not any(lane.role == "candidate" and lane.contender for lane in races[0].lanes[2:]
                   if next(r for r in report.results if r.name == lane.name).goal != "speed")  # speed first
    for r in report.results:
        if r.status != "measured":
            continue
        lane = next(lane for lane in _race_of(races, r).lanes if lane.name == r.name)
        assert (r.left_round, r.left_reason) == (lane.left_round, lane.left_reason)
        if r.goal != "speed":  # memory and cost tricks are timed for their cost, the least rounds
            assert r.left_round == r.rounds == 5 and "timed for its cost only" in r.left_reason, r
        if r.left_round is None:  # in the race to its end: every round
            assert r.rounds == _race_of(races, r).rounds
        else:
            assert r.rounds == r.left_round <= report.rounds and r.left_reason
    text = report.to_text()
    assert f"stopped: {report.stop_reason}" in text
    for r in report.results:  # (on a busy machine the budget may leave some tricks unmeasured: not asserted)
        if r.left_round is not None:
            assert f"left the race after {r.left_round} rounds: {r.left_reason}" in text
    assert set(report.phase_s) >= {"set-up", "race", "combinations"} and all(v >= 0 for v in report.phase_s.values())


def test_skipped_tricks_carry_reasons_and_every_trick_is_accounted_for(tuned):
    report = tuned[0]
    seen = {r.name.split(":")[0] for r in report.results} | {s.name.split(":")[0] for s in report.skipped}
    assert {t.name for t in list_tricks()} <= seen
    for s in report.skipped:
        assert s.reason.strip(), s
    why = {s.name: s.reason for s in report.skipped}
    assert "CUDA" in why["cudnn_benchmark"]  # does not apply on a CPU, and says why
    assert "--deploy" in why["fuse"] and "--data" in why["loader_defaults"]
    assert why["compile"] == "left out by the caller (skip)"
    text = report.to_text()
    assert "skipped: cudnn.benchmark only affects CUDA convolutions" in text
    assert "noise ±" in text and "plain again (A/A)" in text


def test_a_failing_trick_is_reported_and_the_tune_goes_on(monkeypatch, short_races):
    # the failure mid-timing is planted in a candidate of the test's own, as fast as plain on any CPU (a
    # dtype such as bf16 is emulated on some CPUs and rightly stopped after a probe, before any timing)
    real = tuner_mod.training_candidates

    def with_planted(*a, **kw):
        cands, skipped = real(*a, **kw)
        return cands + [Candidate("planted_flaky", {"deterministic": True}, "speed")], skipped

    monkeypatch.setattr(tuner_mod, "training_candidates", with_planted)
    x, y = _batch(16, 8)
    report = tune(Flaky, (x, y), budget_s=30, progress=False,
                  skip=["compile", "ema", "deterministic", "mixed_precision", "memory_efficient_bn"])
    by = {r.name: r for r in report.results}
    cl = by["channels_last"]  # fails at once: .view of a channels_last tensor
    assert cl.status == "failed" and cl.verdict == "failed"
    assert "view" in cl.reason and cl.step_s is None
    planted = by["planted_flaky"]  # fails in the middle of the timed rounds (its 2nd)
    assert planted.status == "failed" and "raised while timed" in planted.reason and "flaky" in planted.reason
    assert planted.step_s is None and planted.ratio is None
    # ... and everything else was measured anyway
    assert report.baseline.step_s and report.rounds >= 5
    others = [r for r in report.results if r.name not in ("channels_last", "planted_flaky")]
    assert others and all(r.status == "measured" and r.ratio for r in others), others
    assert "failed: RuntimeError" in report.to_text()


def test_memory_limit_below_the_plain_need_finds_a_configuration_that_fits(short_races):
    batch = _batch(16, 32)
    cfg = {"device": "cpu", "fused_optimizer": False}
    plain = measure_memory(TinyNet(), cfg, batch, loss_fn=None, optimizer_fn=None)
    limit = int(plain.state_bytes + 0.6 * (plain.peak_bytes - plain.state_bytes))
    report = tune(TinyNet, batch, budget_s=40, memory_limit=limit, progress=False,
                  skip=["compile", "mixed_precision", "ema", "deterministic"])
    assert report.baseline.peak_bytes > limit
    best = report.best_throughput
    assert best is not report.baseline and report.fits_with
    fit = next(r for r in report.results + report.combos if r.name == report.fits_with)
    assert fit.changes.get("checkpointing") or fit.changes.get("accumulate", 1) > 1
    assert fit.peak_bytes <= limit and best.peak_bytes <= limit  # measured at the batch, not estimated
    assert fit.changes.items() <= best.changes.items()  # speed tricks may come on top, if they still fit
    assert any(n.startswith("fits with") for n in report.notes)
    assert "does not fit under the limit; it fits with " + fit.name in report.to_text()
    cfg = report.recommended_config()
    assert (cfg.get("checkpointing", ""), cfg.get("accumulate", 1)) == (best.changes.get("checkpointing", ""),
                                                         best.changes.get("accumulate", 1))
    assert cfg.get("batch_size", 16) * cfg.get("accumulate", 1) == 16  # the effective batch is the one asked for


def test_nothing_fits_is_said_plainly(short_races):
    report = tune(TinyNet, _batch(8, 16), budget_s=20, memory_limit=4096, progress=False,
                  skip=["compile", "mixed_precision", "ema", "deterministic", "channels_last", "fused_optimizer"])
    assert report.fits_with is None and report.best_throughput is report.baseline
    assert any("no configuration tried fits" in n for n in report.notes)


def test_tricks_toml_round_trips_into_trainconfig_and_fit(tuned, tmp_path):
    report = tuned[0]
    paths = report.write(tmp_path)
    for name in ("report.md", "report.json", "report.png", "tricks.toml", "tricks-largest-batch.toml"):
        assert paths[name].is_file() and paths[name].stat().st_size > 0, name
    assert paths["report.png"].read_bytes()[:4] == b"\x89PNG"
    toml = tomllib.loads(paths["tricks.toml"].read_text())["train"]
    assert toml == report.recommended_config()  # exactly the recommendation: the keys the tune decided
    # the chosen switches, and those of the speed tricks measured (a memory or cost trick left off is not written)
    decided = {k for r in report.results + report.combos if r.goal == "speed" and r.status.startswith("measured")
               for k in r.changes} & set(TUNED_KEYS) | set(report.best_throughput.changes)
    assert set(toml) - {"optimizer", "batch_size", "distributed"} == decided, (toml, decided)
    loaded = load_config(paths["tricks.toml"])
    config = TrainConfig.from_dict(loaded)
    for k, v in toml.items():
        assert getattr(config, k) == v
    # fit takes the file as it is
    data = [_batch(8, 16) for _ in range(2)]
    history = fit(TinyNet(), data, config=str(paths["tricks.toml"]), epochs=1, progress=False)
    for k, v in toml.items():
        assert history.config[k] == v
    assert history.steps >= 1
    # ... and so does Tricks, in the user's own loop, as the file's header and report.md show
    text, md = paths["tricks.toml"].read_text(), paths["report.md"].read_text()
    for how in ('torch-tricks train --config tricks.toml', 'tricks = torch_tricks.Tricks("tricks.toml")',
                "tricks.backward(loss)", "tricks.step()"):
        assert how in text and how in md, how
    from torch_tricks import Tricks

    tricks = Tricks(paths["tricks.toml"])
    assert {k: getattr(tricks.config, k) for k in toml} == toml
    model, optimizer = tricks.prepare(TinyNet())
    x, y = tricks.to_device(data[0])  # the file names no device: auto, CUDA where there is one
    with tricks.autocast():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    tricks.backward(loss)
    assert tricks.step() == (tricks.config.accumulate == 1)


def test_recommended_switches_reach_fit_exactly(tmp_path, short_races):
    """A recommendation with several switches: the file holds them, fit applies them and nothing else."""
    report = tune(TinyNet, _batch(8, 16), budget_s=20, progress=False,
                  skip=["compile", "mixed_precision", "ema", "deterministic", "memory_efficient_bn", "inplace_activations"])
    for r in report.results + report.combos:  # every recommendation the tune could make must round-trip
        report.best_throughput = r
        path = tmp_path / f"{r.name.replace(':', '_')}.toml"
        path.write_text(report.tricks_toml())
        toml = tomllib.loads(path.read_text())["train"]
        assert {k: toml[k] for k in r.changes} == r.changes
        history = fit(TinyNet(), [_batch(8, 16)], config=str(path), epochs=1, progress=False)
        applied = set(history.applied)
        assert ("channels_last" in applied) == bool(r.changes.get("channels_last"))
        assert any(a.startswith("checkpointing") for a in applied) == bool(r.changes.get("checkpointing"))
        assert history.config["accumulate"] == r.changes.get("accumulate", 1)
        # a faster trick whose combination with this pick was not measured is not written: fit's default stays
        assert "fused_optimizer" in toml or "fused_optimizer" in report.open_keys()
        fused = toml.get("fused_optimizer", TrainConfig().fused_optimizer)
        assert history.config["fused_optimizer"] == fused
        if "fused_optimizer" in toml:
            assert ("fused_optimizer" in applied or "foreach_optimizer" in applied) == fused


def test_bad_inputs_are_one_line_user_errors():
    with pytest.raises(UserError, match="cannot run a training step"):
        tune(TinyNet, (torch.randn(4, 5, 8, 8), torch.randint(0, 10, (4,))), budget_s=5, progress=False)
    with pytest.raises(UserError, match="unknown trick"):
        tune(TinyNet, _batch(4, 8), budget_s=5, progress=False, skip=["no_such_trick"])
    with pytest.raises(UserError, match="budget"):
        tune(TinyNet, _batch(4, 8), budget_s=0, progress=False)
    with pytest.raises(UserError, match="forward failed in module 'stem'"):
        example_batch(TinyNet(), torch.randn(4, 5, 8, 8))
    (x, y), loss = example_batch(TinyNet(), torch.randn(4, 3, 8, 8))
    assert y.shape == (4,) and y.dtype == torch.int64 and int(y.max()) < 10
    assert parse_size("8GiB") == 8 << 30 and parse_size("512MB") == 512 * 10**6
    with pytest.raises(UserError):
        parse_size("lots")


def test_report_of_a_tune_reads_back(tuned, tmp_path):
    report: TuneReport = tuned[0]
    report.write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "![speed-up and memory per trick](report.png)" in md and "tricks.toml" in md
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["recommended"] == report.recommended_config()
    assert data["recommended_tricks"] == report.recommended_tricks()
    names = {r["name"] for r in data["results"]}
    assert "checkpointing" in names and "fused_optimizer" in names


# -- the race, with fake runners: planted speeds, planted noise --------------------------------------

class Sleeper:
    """A fake training step: sleeps ``base / speed`` seconds times ``1 + noise * U(-1, 1)``.

    The planted noise is real noise in the measured times (the sleep is what is timed), on top of the
    machine's own jitter. ``fail_after``: the call after that many raises.
    """

    def __init__(self, speed: float, *, base: float = 0.008, noise: float = 0.1, seed: int = 0,
                 fail_after: int | None = None) -> None:
        self.speed, self.base, self.noise = speed, base, noise
        self.rng = random.Random(seed)
        self.calls = 0
        self.fail_after = fail_after

    def __call__(self) -> None:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("planted failure")
        time.sleep(self.base / self.speed * (1 + self.noise * self.rng.uniform(-1, 1)))


def _lanes(**speeds):
    lanes = [Lane("plain", Sleeper(1.0, seed=1), role="baseline"), Lane("plain (A/A)", Sleeper(1.0, seed=2), role="twin")]
    for k, (name, speed) in enumerate(speeds.items()):
        runner = speed if callable(speed) else Sleeper(speed, seed=10 + k)
        lanes.append(Lane(name, runner))
    return lanes


def test_the_race_keeps_a_planted_faster_runner_and_drops_a_slower_one_early():
    race = run_race(_lanes(fast=1.3, slow=0.7), until=time.perf_counter() + 10, min_rounds=5, settle_rounds=12,
                    max_rounds=60)
    state = race.state
    by = {lane.name: lane for lane in race.lanes}
    # the planted noise is in the measured times
    plain = by["plain"].times
    assert (max(plain) - min(plain)) / statistics.median(plain) > 0.05
    # 0.7x: out at an early check (5, 6 or 8 rounds), as it cannot be faster; the others went on
    slow = by["slow"]
    assert slow.left_round is not None and slow.left_round <= 8 and len(slow.times) == slow.left_round
    assert "cannot be 2% faster than plain" in slow.left_reason
    assert 1 / paired_ratio(slow.times, plain)[0] == pytest.approx(0.7, rel=0.15)
    # 1.3x: kept, faster beyond the margin, and the race stops as soon as that is settled
    fast = by["fast"]
    assert fast.live and len(fast.times) == race.rounds == len(plain)
    assert state == "settled" and race.settled and 12 <= race.rounds < 60
    r, h = race.ratio(2)
    assert race.faster(2) and 1 / r == pytest.approx(1.3, rel=0.15) and h < 0.3
    assert race.open_lanes() == []  # settled: nothing is open


class Clock:
    """A fake clock, for races whose outcome must not depend on the machine: the fake steps advance it."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Ticker(Sleeper):
    """A fake step that advances a fake clock by what Sleeper would sleep: the same planted speed and noise."""

    def __init__(self, clock: Clock, speed: float, **kw) -> None:
        super().__init__(speed, **kw)
        self.clock = clock

    def __call__(self) -> None:
        self.calls += 1
        self.clock.t += self.base / self.speed * (1 + self.noise * self.rng.uniform(-1, 1))


def _ticking(clock, noise=0.1, **speeds):
    lanes = [Lane("plain", Ticker(clock, 1.0, noise=noise, seed=1), role="baseline"),
             Lane("plain (A/A)", Ticker(clock, 1.0, noise=noise, seed=2), role="twin")]
    for k, (name, (speed, n)) in enumerate(speeds.items()):
        lanes.append(Lane(name, Ticker(clock, speed, noise=n, seed=10 + k)))
    return lanes


def test_more_rounds_among_fewer_runners_decide_a_small_gain():
    """A 1.12x runner inside the noise of the first rounds: once the losers are out, the rounds go on
    among it and the baselines until its gain is beyond the narrowing margin, and the race stops there."""
    clock = Clock()
    race = Race(_ticking(clock, small_gain=(1.12, 0.3), bad=(0.6, 0.1), worse=(0.5, 0.1)),
                min_rounds=5, settle_rounds=12, max_rounds=500, clock=clock)
    state = race.run(until=1e9)
    gain, bad, worse = race.lanes[2:]
    assert bad.left_round == worse.left_round == 5 and "cannot be 2% faster" in bad.left_reason
    first = paired_ratio(gain.times[:5], race.lanes[0].times[:5])
    assert not first[0] < 1 - max(first[1], 0.02)  # not decidable on the first rounds ...
    assert gain.live and state == "settled" and race.faster(2) and race.rounds > 12  # ... decided on more
    r, h = race.ratio(2)
    assert h < first[1] / 2 and race.noise() < 1 - r and 1 / r == pytest.approx(1.12, rel=0.05)


def test_an_open_race_runs_to_its_deadline_and_can_go_on():
    # a 1.03x gain under ±20% noise cannot be told from the noise in 50 rounds
    clock = Clock()
    race = Race(_ticking(clock, noise=0.2, maybe=(1.03, 0.2)), min_rounds=5, max_rounds=500, clock=clock)
    assert race.run(until=1.2) == "budget" and race.lanes[2].live  # 1.2 fake s: ~50 rounds of 3 steps of 8 ms
    assert 40 < race.rounds <= 50 and clock.t <= 1.2
    assert race.open_lanes()[0].startswith("maybe 1.0")
    n = race.rounds
    assert race.run(until=clock.t + 0.3) == "budget"  # resumed: more rounds, appended
    assert race.rounds > n and len(race.lanes[0].times) == race.rounds == len(race.lanes[2].times)
    assert race.run(until=clock.t + 100) in ("settled", "cap")  # given the time, it is answered (or capped)


def test_a_gain_resolved_to_within_the_noise_leaves_and_the_race_settles():
    """A planted systematic A/A disagreement of 3% (the twin is 3% slower, as two identical copies can be
    for their memory placement): a 1.025x gain can never be called faster beyond that noise, nor ruled
    out; once its interval and the noise's are narrower than ±1%, more rounds cannot change that."""
    clock = Clock()
    lanes = [Lane("plain", Ticker(clock, 1.0, noise=0.01, seed=1), role="baseline"),
             Lane("plain (A/A)", Ticker(clock, 0.97, noise=0.01, seed=2), role="twin"),
             Lane("small", Ticker(clock, 1.025, noise=0.01, seed=3))]
    race = Race(lanes, min_rounds=5, settle_rounds=12, max_rounds=500, clock=clock)
    assert race.run(until=1e9) == "settled" and race.rounds == 12
    small = race.lanes[2]
    assert small.left_round == 12 and small.left_reason.startswith("resolved to ±")
    assert f"not faster beyond the noise (±{race.noise():.1%}) and 2%" in small.left_reason
    assert 0.025 < race.noise() < 0.035  # the planted 3%
    r, h = race.ratio(2)
    assert not race.faster(2) and r - h < 0.98 and h <= 0.01


def test_with_a_noise_resolution_the_race_goes_on_until_the_noise_is_known_that_well():
    clock = Clock()
    quick = Race(_ticking(clock, noise=0.1, fast=(1.5, 0.1)), min_rounds=5, settle_rounds=12, clock=clock,
                 max_rounds=2000)
    assert quick.run(until=1e9) == "settled" and quick.rounds == 12 and quick.noise_half() > 0.02
    clock = Clock()
    race = Race(_ticking(clock, noise=0.1, fast=(1.5, 0.1)), min_rounds=5, settle_rounds=12, clock=clock,
                max_rounds=2000, noise_resolution=0.005)
    assert race.run(until=1.0) == "budget" and race.open_lanes()[-1].startswith("the noise, known to ±")
    assert race.run(until=1e9) == "settled" and race.rounds > 100 and race.noise_half() <= 0.005
    assert race.lanes[2].live and race.faster(2)


def test_a_faster_runner_slower_than_the_best_leaves_settled():
    race = Race(_lanes(best=2.0, good=1.3), min_rounds=5, settle_rounds=12, max_rounds=60)
    assert race.run(time.perf_counter() + 10) == "settled"
    best, good = race.lanes[2:]
    assert best.live and good.left_round is not None
    assert good.left_reason.startswith("faster than plain, and slower than best beyond the interval")


def test_the_race_drops_a_runner_that_raises_and_a_non_contender_after_the_least_rounds():
    lanes = _lanes(breaks=Sleeper(1.0, fail_after=3), fast=2.0, cost=0.9)
    lanes[-1].contender, lanes[-1].why_not = False, "a memory trick: timed for its cost only"
    race = Race(lanes, min_rounds=5, settle_rounds=6, max_rounds=40)
    race.run(time.perf_counter() + 10)
    breaks, fast, cost = race.lanes[2:]
    assert breaks.error == "RuntimeError: planted failure" and breaks.left_round == 2  # warm-up + 2 rounds
    assert breaks.left_reason == "raised: RuntimeError: planted failure" and len(breaks.times) == 2
    assert cost.left_round == 5 and cost.left_reason == "a memory trick: timed for its cost only"
    assert fast.live and race.state == "settled"
    # a baseline that raises ends the race
    dead = Race([Lane("plain", Sleeper(1.0, fail_after=2), role="baseline"), Lane("x", Sleeper(1.0))], min_rounds=5)
    assert dead.run(time.perf_counter() + 5) == "failed" and dead.rounds == 2


class _SlowStep(nn.Module):
    """A step of ~0.3 s: a 3 s budget cannot hold the A/A twin, memory and one trick's least race."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        time.sleep(0.3)
        return self.head(x)


def test_a_budget_too_short_for_one_trick_stops_after_the_plain_step_and_says_what_would_do(tmp_path):
    report = tune(_SlowStep(), (torch.randn(16, 8), torch.randint(0, 4, (16,))), budget_s=3, progress=False)
    assert report.rounds == 0 and report.aa_grad_drift is None  # no twin built, no race run
    assert report.baseline.step_s and report.baseline.step_s >= 0.3
    assert report.best_throughput is report.baseline
    assert not set(report.recommended_config()) & set(TUNED_KEYS)  # nothing measured: nothing decided
    assert report.stop_reason.startswith("budget: one plain step takes") and "raise --budget-seconds to about" in \
        report.stop_reason
    suggested = int(report.stop_reason.split("raise --budget-seconds to about ")[1].split()[0])
    assert suggested > 3
    assert report.results and all(r.status == "skipped" and "raise --budget-seconds" in r.reason
                                  for r in report.results)
    paths = report.write(tmp_path)
    assert "no trick was measured" in paths["tricks.toml"].read_text()
    assert "(memory not measured)" in report.to_text()


# -- every verdict has its reason ------------------------------------------------------------------

def test_every_row_of_the_default_tune_has_its_reason(tuned, tmp_path):
    report = tuned[0]
    paths = report.write(tmp_path)
    data = json.loads(paths["report.json"].read_text())
    assert data["run_steps"] == tuner_mod.ASSUMED_RUN_STEPS and data["run_steps_source"] == "assumed"
    verdicts = data["verdicts"]
    names = {v["name"] for v in verdicts}
    assert {r.name for r in [report.baseline] + report.results + report.combos} | {s.name for s in report.skipped} \
        <= names  # every row, skipped ones included
    for v in verdicts:
        assert v["decision"] and v["verdict"], v
        if v["decision"] != "recommended":
            assert v["reason"].strip(), v
    for r in data["results"] + data["combinations"] + [data["baseline"]]:
        assert r["decision"], r
        if r["decision"] != "recommended":
            assert r["why"].strip(), r
    rec = [v for v in verdicts if v["decision"] == "recommended"]
    assert [v["name"] for v in rec] == [report.best_throughput.name]  # one recommendation, the one tricks.toml has
    # ... and the same reasons in the printed table, report.md and tricks.toml's comments
    text, md, toml = report.to_text(), paths["report.md"].read_text(), paths["tricks.toml"].read_text()
    comments = [line for line in toml.splitlines() if line.startswith("#")]
    for r in report.results + report.combos:
        assert r.why in text and r.why in md, r.name
        assert any(line.startswith(f"#   {r.name}") and r.why in line for line in comments), r.name
    why = {v["name"]: v for v in verdicts}
    assert why["compile"]["advice"].startswith("drop --skip compile")  # what would get it measured
    assert "CUDA" in why["cudnn_benchmark"]["reason"] and "--device cuda" in why["cudnn_benchmark"]["advice"]
    assert tomllib.loads(toml)["train"] == report.recommended_config()  # the comments leave the keys as they were


def _report_with_compile(run_steps: int, source: str = "assumed") -> tuple[TuneReport, dict]:
    """A report put together from given figures (nothing timed): bf16 is the best single trick, compile was
    measured on top of it, faster per step beyond the margin, with a first call 38 s longer than bf16's."""
    from torch_tricks.tuning.candidates import Skipped
    from torch_tricks.tuning.report import Result

    report = TuneReport(model="net", batch=32, device="cpu", optimizer="adamw", memory_limit=1 << 30,
                        memory_limit_source="given", budget_s=60.0, noise=0.01, aa_ratio=1.0, aa_half_ci=0.01,
                        drift_tolerance={"loss": 0.05}, rounds=30, run_steps=run_steps, run_steps_source=source,
                        stop_reason="settled: after 30 rounds")
    mib = 1 << 20
    r = {
        "plain": Result("plain", "baseline", {}, (), status="measured", verdict="baseline", step_s=1.0, ratio=1.0,
                        first_call_s=2.0, peak_bytes=100 * mib, losses=[2.3, 2.2, 2.1]),
        "bf16": Result("mixed_precision:bf16", "speed", {"precision": "bf16"}, ("T1",), status="measured",
                       verdict="faster", step_s=0.5, ratio=0.5, ratio_half_ci=0.01, first_call_s=2.0,
                       peak_bytes=80 * mib, loss_drift=0.01, rounds=30),
        "fused": Result("fused_optimizer", "speed", {"fused_optimizer": True}, ("T5",), status="measured",
                        verdict="faster", step_s=0.51, ratio=0.51, ratio_half_ci=0.02, first_call_s=2.0,
                        peak_bytes=80 * mib, loss_drift=0.0, rounds=30),
        "fp16": Result("mixed_precision:fp16", "speed", {"precision": "fp16"}, ("T1",), status="measured",
                       verdict="drifts", step_s=0.5, ratio=0.5, ratio_half_ci=0.02, peak_bytes=60 * mib, rounds=30,
                       loss_drift=0.2),
        "cl": Result("channels_last", "speed", {"channels_last": True}, ("T3",), status="measured",
                     verdict="faster, over the memory limit", step_s=0.9, ratio=0.9, ratio_half_ci=0.01,
                     peak_bytes=2 << 30, rounds=30),
        "inplace": Result("inplace_activations", "speed", {"inplace": True}, ("T8",), status="measured",
                          verdict="no measurable change", step_s=0.99, ratio=0.99, ratio_half_ci=0.03,
                          peak_bytes=90 * mib, rounds=30),
        "ema": Result("ema", "cost", {"ema": True}, ("T6",), status="skipped", verdict="skipped",
                      reason="over --budget-seconds before it could be measured: raise it"),
        "compile": Result("compile", "speed", {"compile": True}, ("T2",), status="measured", verdict="faster",
                          reason="measured on top of mixed_precision:bf16: see mixed_precision:bf16+compile"),
        # 1.33x the speed of bf16 in its own race: 500 ms -> 375 ms a step; first call 40 s against bf16's 2 s
        "target": Result("mixed_precision:bf16+compile", "speed", {"precision": "bf16", "compile": True},
                         ("T1", "T2"), status="measured", verdict="faster", step_s=0.375, ratio=0.375,
                         ratio_half_ci=0.01, vs_current=0.75, vs_current_half_ci=0.01,
                         vs_current_name="mixed_precision:bf16", vs_current_step_s=0.5, first_call_s=40.0,
                         loss_drift=0.01, rounds=12),
    }
    r["bf16"].chosen = True
    report.baseline, report.best_throughput = r["plain"], r["bf16"]
    report.results = [r[k] for k in ("bf16", "fused", "fp16", "cl", "inplace", "ema", "compile")]
    report.combos = [r["target"]]
    report.skipped = [Skipped("cudnn_benchmark", ("T4",), "train", "cudnn.benchmark only affects CUDA convolutions")]
    return report, r


def _decide_compile(report: TuneReport, r: dict) -> Any:
    """The tuner's own decision on compile, on the given figures (no runner, nothing timed)."""
    job = tuner_mod._Tune.__new__(tuner_mod._Tune)
    job.report, job.limit, job.choice_notes = report, report.memory_limit, []
    job.compile_target, job.compile_base, job.compile_row = r["target"], r["bf16"], r["compile"]
    job.compile_modes = [(r["mode"], r["mode_target"])] if "mode" in r else []
    job._compile_decide()
    return job


def _with_a_compile_mode(r: dict, vs_default: float, first_call_s: float) -> None:
    """compile's max-autotune-no-cudagraphs measured on top of bf16 too, raced against the compiled default."""
    from torch_tricks.tuning.report import Result

    name = "mixed_precision:bf16+compile:max-autotune-no-cudagraphs"
    r["mode"] = Result("compile:max-autotune-no-cudagraphs", "speed", {"compile": "max-autotune-no-cudagraphs"},
                       ("T35",), status="measured", verdict="faster", reason=f"measured on top of "
                       f"mixed_precision:bf16: see {name}")
    step = 0.375 * vs_default
    r["mode_target"] = Result(name, "speed", {"precision": "bf16", "compile": "max-autotune-no-cudagraphs"},
                              ("T1", "T35"), status="measured", verdict="faster", step_s=step, ratio=step,
                              ratio_half_ci=0.01, vs_current=vs_default, vs_current_half_ci=0.01,
                              vs_current_name="mixed_precision:bf16+compile", vs_current_step_s=0.375,
                              first_call_s=first_call_s, loss_drift=0.01, rounds=12)


def _report_with_a_compile_mode(run_steps: int, vs_default: float, first_call_s: float = 80.0):
    report, r = _report_with_compile(run_steps=run_steps)
    _with_a_compile_mode(r, vs_default, first_call_s)
    report.results.append(r["mode"])
    report.combos.append(r["mode_target"])
    return report, r


def test_a_compile_mode_faster_than_the_default_replaces_it_and_is_what_tricks_toml_says(tmp_path):
    report, r = _report_with_a_compile_mode(run_steps=100_000, vs_default=0.8)
    _decide_compile(report, r)
    assert report.best_throughput is r["mode_target"] and r["mode_target"].chosen and not r["target"].chosen
    assert tomllib.loads(report.tricks_toml())["train"]["compile"] == "max-autotune-no-cudagraphs"
    # its longer first call is paid back against the default's: 40 s more, 75 ms saved a step
    pb = report.payback(r["mode_target"])
    assert pb["ref"] == "mixed_precision:bf16+compile" and pb["steps"] == math.ceil(40.0 / 0.075)
    report.explain()
    assert r["mode_target"].decision == "recommended"
    assert f"break-even after {pb['steps']} steps" in r["mode_target"].why


def test_a_compile_mode_inside_the_noise_or_slower_leaves_the_default_and_one_not_paid_back_too():
    for vs_default in (0.99, 1.2):
        report, r = _report_with_a_compile_mode(run_steps=100_000, vs_default=vs_default)
        _decide_compile(report, r)
        assert report.best_throughput is r["target"] and not r["mode_target"].chosen
        assert tomllib.loads(report.tricks_toml())["train"]["compile"] is True
    report, r = _report_with_a_compile_mode(run_steps=300, vs_default=0.8)  # 534 steps to pay back: not in 300
    _decide_compile(report, r)
    assert not r["mode_target"].chosen
    # measured against a default that is not recommended (not paid back in 100 steps): not recommended either
    report, r = _report_with_a_compile_mode(run_steps=100, vs_default=0.5)
    job = _decide_compile(report, r)
    assert report.best_throughput is r["bf16"] and not r["mode_target"].chosen
    assert any("which is not recommended: not recommended either" in n for n in job.choice_notes)


def test_a_faster_compile_not_paid_back_in_the_run_says_its_break_even_step_count(tmp_path):
    report, r = _report_with_compile(run_steps=100)
    _decide_compile(report, r)
    assert report.best_throughput is r["bf16"]  # 1.33x bf16's speed beyond the margin, and still not recommended
    n = math.ceil((40.0 - 2.0) / (0.5 - 0.375))  # extra one-off seconds / seconds saved a step
    assert n == 304
    paths = report.write(tmp_path)
    target = r["target"]
    assert target.decision == "not recommended" and target.break_even_steps == n
    assert target.why.startswith("compile not amortised within the 100 steps the tune assumes for a run")
    assert f"break-even after {n} steps" in target.why and "38.0 s more than mixed_precision:bf16's" in target.why
    assert f"at least {n} steps" in target.advice and "steps=" in target.advice
    assert r["compile"].why.endswith(target.why) and r["compile"].decision == "not recommended"
    # in every view: the table, report.md, report.json, and tricks.toml's comments (which leave compile off)
    assert f"break-even after {n} steps" in report.to_text()
    assert f"break-even after {n} steps" in paths["report.md"].read_text()
    data = json.loads(paths["report.json"].read_text())
    assert data["combinations"][0]["break_even_steps"] == n and data["combinations"][0]["why"] == target.why
    toml = paths["tricks.toml"].read_text()
    line = next(x for x in toml.splitlines() if x.startswith("#   mixed_precision:bf16+compile"))
    assert f"break-even after {n} steps" in line and "not recommended" in line
    assert tomllib.loads(toml)["train"]["compile"] is False and tomllib.loads(toml)["train"]["precision"] == "bf16"
    # told a run long enough, the tuner recommends it, and says it pays back within the run
    report, r = _report_with_compile(run_steps=n, source="given")
    _decide_compile(report, r)
    assert report.best_throughput is r["target"] and r["target"].chosen
    report.explain()
    assert r["target"].decision == "recommended" and f"break-even after {n} steps, within your run of {n} steps" \
        in r["target"].why
    assert r["compile"].decision == r["bf16"].decision == "part of the recommendation"
    assert tomllib.loads(report.tricks_toml())["train"]["compile"] is True


def test_compile_inside_the_noise_of_what_it_extends_says_so_with_its_interval():
    report, r = _report_with_compile(run_steps=100_000)
    t = r["target"]
    t.vs_current, t.vs_current_half_ci, t.left_round = 0.97, 0.05, None  # 1.03x bf16's speed, interval over 1.00x
    _decide_compile(report, r)
    assert report.best_throughput is r["bf16"]
    report.explain()
    assert t.why.startswith("inside the noise of mixed_precision:bf16, which it extends: 1.03x the speed of "
                            "mixed_precision:bf16 (95% interval 0.98-1.09x) (its interval reaches 1.00x")
    assert "a change must exceed ±5.0%" in t.why and "break-even after 304 steps" in t.why  # the payback, too
    assert "raise --budget-seconds" in t.advice  # its race was still open


def test_the_other_reasons_memory_drift_noise_of_the_best_and_skipped():
    report, r = _report_with_compile(run_steps=100)
    why = {v["name"]: v for v in report.explain()}
    assert why["mixed_precision:bf16"]["decision"] == "recommended"
    assert why["mixed_precision:bf16"]["reason"].startswith("the fastest, faster than plain beyond the margin: 2.00x")
    assert why["plain"]["decision"] == "reference" and "mixed_precision:bf16 is faster" in why["plain"]["reason"]
    # faster than plain, but inside the noise of the best: the speed-up intervals overlap
    fused = why["fused_optimizer"]
    assert fused["decision"] == "not recommended"
    assert fused["reason"].startswith("inside the noise of mixed_precision:bf16, the best: 1.96x ±0.08 against "
                                      "2.00x ±0.04 the plain step (overlapping intervals)")
    # memory over the limit
    cl = why["channels_last"]
    assert cl["reason"] == "its peak 2.0 GiB is over the memory limit 1.0 GiB (given)" and "--memory-limit" in cl["advice"]
    # drift
    assert why["mixed_precision:fp16"]["reason"] == ("its loss drifts 20.0% from fp32's over 3 steps (relative to the "
                                                     "first fp32 loss), beyond the 5% tolerance")
    # inside the noise of plain
    assert why["inplace_activations"]["reason"].startswith("inside the noise of plain: 1.01x the speed of plain")
    assert why["inplace_activations"]["advice"] == "more rounds narrow its interval: raise --budget-seconds"
    # skipped: why, and what would get it measured
    assert why["ema"]["decision"] == "skipped" and why["ema"]["advice"] == "raise --budget-seconds"
    assert why["cudnn_benchmark"]["advice"] == "tune on a CUDA GPU (--device cuda)"
    for v in why.values():
        if v["decision"] != "recommended":
            assert v["reason"], v
    text = report.to_text()
    assert "faster, not recommended: mixed_precision:bf16+compile: compile not amortised" in text
    assert "skipped: cudnn.benchmark only affects CUDA convolutions; what would change it: tune on a CUDA GPU" in text


def test_a_run_length_that_is_not_a_whole_number_of_steps_is_a_user_error():
    with pytest.raises(UserError, match="steps"):
        tune(TinyNet, _batch(), budget_s=5, progress=False, steps=0)


def test_drift_is_measured_with_dropout_off_so_it_shows_the_trick_not_the_masks():
    """Accumulation draws dropout masks per micro-batch (and CUDA's bf16 kernel draws them unlike the
    fp32 one): with dropout on, the first gradients of accumulate=2 differed from plain's by 80% here,
    and GPT-2's bf16 loss on an H100 drifted 11%. The drift compares with dropout off; the step the
    race times keeps it."""
    from torch_tricks.tuning.measure import build_runner, dropout_off, relative_diff

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 10))
    batches = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(3)]
    cfg = {"device": "cpu", "optimizer": "adamw", "lr": 1e-3, "fused_optimizer": False, "seed": 0}
    plain = build_runner("plain", model, cfg, batches, loss_fn=None, optimizer_fn=None, probe=False)
    acc = build_runner("acc", model, {**cfg, "accumulate": 2}, batches, loss_fn=None, optimizer_fn=None, probe=False)
    assert relative_diff(acc.grads, plain.grads) < 1e-5  # the same sums, in two halves: only rounding differs
    assert max(abs(a - b) for a, b in zip(acc.losses, plain.losses)) < 1e-5 * plain.losses[0]
    assert acc.step.model[2].p == 0.3  # dropout is back on for the timed steps
    with dropout_off(acc.step.model) as had:
        assert had and acc.step.model[2].p == 0.0
    assert acc.step.model[2].p == 0.3
    with dropout_off(nn.Linear(2, 2)) as had:
        assert not had


def test_the_summary_says_its_parts_in_order():
    """The lines under the table, on given figures: the set-up and the race, the choice, what compile costs,
    the faster rows not recommended, the run length, then how to apply it and the time."""
    report, r = _report_with_compile(run_steps=100)
    report.notes = ["a note"]
    lines = report.summary_lines()
    starts = ["net: batch 32", "30 interleaved rounds; noise ±1.0%", "race: all 5 tricks", "stopped: settled",
              "plain fp32 step: 1000.0 ms, peak 100.0 MiB", "throughput: mixed_precision:bf16: 2.00x",
              "compile (mixed_precision:bf16+compile): first call 40.0 s",
              "faster, not recommended: fused_optimizer: inside the noise of mixed_precision:bf16",
              "faster, not recommended: channels_last: its peak 2.0 GiB is over the memory limit",
              "faster, not recommended: mixed_precision:bf16+compile: compile not amortised",
              "run length: 100 steps (assumed)", "note: a note", "tricks.toml switches on: precision=bf16",
              "tune took 0 s (budget 60 s)"]
    assert len(lines) == len(starts), lines
    for line, start in zip(lines, starts):
        assert line.startswith(start), (line, start)
    assert "pays back after 304 steps, beyond the 100 steps the tune assumes for a run" in lines[6]


_FRESH_PEAK = """
import json, sys
import torch
sys.path.insert(0, {tests!r})
from test_tune import TinyNet, _batch
from torch_tricks.tuning.measure import measure_memory
from torch_tricks.tuning.fit import tiled as _tiled
torch.manual_seed(0)
cfg, sizes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps([measure_memory(TinyNet(), cfg, _tiled(_batch(16, 32), n), loss_fn=None, optimizer_fn=None,
                                 per_sample=False).peak_bytes for n in sizes]))
"""


def test_the_largest_batch_stated_was_run_and_runs_again_in_a_fresh_process_under_the_limit(short_races):
    """No straight-line estimates: the report's largest batch is a batch a step ran at under the limit, and the
    next size it ran did not fit; a fresh process measures the same."""
    import subprocess
    import sys
    from pathlib import Path

    batch = _batch(16, 32)
    cfg = {"device": "cpu", "fused_optimizer": False}
    plain = measure_memory(TinyNet(), cfg, batch, loss_fn=None, optimizer_fn=None)
    limit = int(plain.state_bytes + 3.0 * (plain.peak_bytes - plain.state_bytes))  # room for ~3x the batch
    report = tune(TinyNet, batch, budget_s=12, memory_limit=limit, progress=False,
                  skip=["compile", "mixed_precision", "ema", "deterministic", "channels_last", "fused_optimizer",
                        "optimizer_in_backward", "inplace_activations", "gradient_accumulation",
                        "low_precision_optimizer_state"])
    bb = report.best_batch
    assert bb is not None and bb.max_batch and bb.max_batch > 16, bb
    assert bb.max_batch_bound is None or bb.max_batch < bb.max_batch_bound
    line = next(x for x in report.to_text().splitlines() if x.startswith("largest batch under the limit"))
    assert f"{bb.max_batch} with {bb.name}" in line and "straight" not in line and "each a step run at" in line, line
    sizes = [bb.max_batch] + ([bb.max_batch_bound] if bb.max_batch_bound else [])
    cfg = {**cfg, "seed": 0, "batch_size": 16, **bb.changes}
    code = _FRESH_PEAK.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cfg), json.dumps(sizes)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    assert peaks[0] <= limit, (peaks, limit)  # the stated largest batch fits in a fresh process too
    if len(peaks) > 1:
        assert peaks[1] > limit  # and the first size that did not fit does not


def test_without_a_memory_limit_on_a_cpu_the_largest_batch_is_not_searched_and_says_so(tuned):
    report = tuned[0]
    assert report.memory_limit_source != "given"
    assert all(r.max_batch is None for r in report.results + report.combos + [report.baseline])
    assert any(n.startswith("largest batch: not searched") and "--memory-limit" in n for n in report.notes)


class _SlowFullBatch(nn.Module):
    """Sleeps on full-batch (16) calls: on the first only (a one-time cost, as CUDA's first bf16 step has),
    or on every one (a trick that is slow)."""

    def __init__(self, every: bool) -> None:
        super().__init__()
        self.lin, self.every, self.slept = nn.Linear(8, 3), every, 0

    def forward(self, x):
        if x.shape[0] == 16 and (self.every or not self.slept):
            self.slept += 1
            time.sleep(0.6)
        return self.lin(x)


@pytest.mark.parametrize("every", [False, True])
def test_a_slow_first_full_step_is_judged_on_the_next_one(every):
    """Found on an H200: GPT-2's first bf16 step (cuBLAS's kernel choice, the allocator growing) took 13x
    plain's and the tune called bf16 slower without measuring it. A one-time cost passes; a slow step does not."""
    from torch_tricks.tuning.measure import TooSlow, build_runner

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))] * 2
    kw = {"loss_fn": nn.functional.cross_entropy, "optimizer_fn": None, "first_limit_s": 0.3}
    if every:
        with pytest.raises(TooSlow) as e:
            build_runner("slow", _SlowFullBatch(True), {"device": "cpu"}, batches, **kw)
        assert e.value.what == "first" and e.value.seconds > 0.3
    else:
        r = build_runner("once", _SlowFullBatch(False), {"device": "cpu"}, batches, **kw)
        assert r.first_call_s > 0.3 and len(r.losses) == 3  # measured, its first call kept as it was

