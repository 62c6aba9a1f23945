"""tune(): every figure from a measurement, skipped and failed tricks with reasons, the memory
limit, and tricks.toml taken as it is by TrainConfig / fit.

Tiny models: a tune of one finishes in seconds, well inside its budget (the rounds are
capped), and the budgets leave room for a busy shared machine. No absolute times are
asserted, only what the tune did and how the report says it.
"""

import json
import math
import statistics
import tomllib

import pytest
import torch
import torch.nn as nn

import torch_tricks.tuning.tuner as tuner_mod
from torch_tricks.registry import list_tricks
from torch_tricks.train import TrainConfig, fit, load_config
from torch_tricks.tuning import TuneReport, example_batch, parse_size, tune
from torch_tricks.tuning.measure import measure_memory, paired_ratio
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
    """Fails under two tricks, as real models do: ``.view`` of a channels_last tensor raises at once,
    and (standing in for a kernel that breaks after a while) the 8th forward under autocast raises."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 8 * 8, 10)
        self.autocast_calls = 0

    def forward(self, x):
        y = self.features(x)
        if torch.is_autocast_enabled("cpu"):
            self.autocast_calls += 1
            if self.autocast_calls > 7:
                raise RuntimeError("flaky low-precision kernel gave up")
        return self.head(y.view(y.size(0), -1))


def _batch(n=16, size=16, classes=10):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.fixture(scope="module")
def tuned():
    """One real tune of TinyNet, with every timing and memory measurement recorded on the side."""
    timed, measured = [], []
    real_time, real_mem = tuner_mod.time_interleaved, tuner_mod.measure_memory

    def spy_time(runners, rounds, **kw):
        times = real_time(runners, rounds, **kw)
        timed.append({r.name: t for r, t in zip(runners, times)})
        return times

    def spy_mem(model, config, batch, **kw):
        m = real_mem(model, config, batch, **kw)
        measured.append((dict(config), m))
        return m

    mp = pytest.MonkeyPatch()
    mp.setattr(tuner_mod, "time_interleaved", spy_time)
    mp.setattr(tuner_mod, "measure_memory", spy_mem)
    try:
        torch.manual_seed(0)
        report = tune(TinyNet, _batch(), budget_s=40, progress=False, skip=["compile"], name="tinynet")
    finally:
        mp.undo()
    return report, timed, measured


def _finite(x):
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def test_every_figure_comes_from_a_measurement(tuned):
    report, timed, measured = tuned
    main = timed[0]  # the round-robin of all single tricks with both baselines
    assert {"plain", "plain (A/A)"} <= set(main)
    assert report.rounds == len(main["plain"]) >= 5
    # the A/A noise is the disagreement of the two identical baselines, as timed
    aa, aa_half = paired_ratio(main["plain (A/A)"], main["plain"])
    assert report.aa_ratio == aa and report.aa_half_ci == aa_half
    assert report.noise == max(abs(aa - 1), aa_half)
    assert report.baseline.step_s == statistics.median(main["plain"])
    timed_singles = [r for r in report.results if r.status == "measured"]
    assert len(timed_singles) >= 3, [(r.name, r.status, r.reason) for r in report.results]
    for r in timed_singles:
        assert r.name in main, r.name
        assert r.step_s == statistics.median(main[r.name])
        assert (r.ratio, r.ratio_half_ci) == paired_ratio(main[r.name], main["plain"])
        assert r.speedup == pytest.approx(1 / r.ratio)
        for figure in (r.peak_bytes, r.state_bytes, r.activation_bytes, r.grad_drift, r.loss_drift, r.first_call_s):
            assert _finite(figure), (r.name, r)
        # the memory figures are those measure_memory returned for this very configuration
        mems = [m for cfg, m in measured if all(cfg.get(k) == v for k, v in r.changes.items())
                and all(cfg.get(k) in (None, False, "", 1, "fp32") or k in r.changes for k in TUNED_KEYS)]
        assert any(m.peak_bytes == r.peak_bytes and m.activation_bytes == r.activation_bytes for m in mems), r.name
    # a figure not measured is absent, never filled in
    for r in report.results + report.combos:
        if r.status in ("skipped", "failed"):
            assert r.step_s is None and r.ratio is None and r.reason, r
    data = json.loads(json.dumps(report.to_dict()), parse_constant=lambda c: pytest.fail(f"{c} in report.json"))
    assert data["baseline"]["step_s"] == report.baseline.step_s
    assert data["noise"] == report.noise and data["rounds"] == report.rounds


def test_skipped_tricks_carry_reasons_and_every_trick_is_accounted_for(tuned):
    report = tuned[0]
    seen = {r.name.split(":")[0] for r in report.results} | {s.name.split(":")[0] for s in report.skipped}
    assert {t.name for t in list_tricks()} <= seen
    for s in report.skipped:
        assert s.reason.strip(), s
    why = {s.name: s.reason for s in report.skipped}
    assert "CUDA" in why["cudnn_benchmark"]  # does not apply on a CPU, and says why
    assert "--deploy" in why["fuse_conv_bn"] and "--data" in why["loader_defaults"]
    assert why["compile"] == "left out by the caller (skip)"
    text = report.to_text()
    assert "skipped: cudnn.benchmark only affects CUDA convolutions" in text
    assert "noise ±" in text and "plain again (A/A)" in text


def test_a_failing_trick_is_reported_and_the_tune_goes_on():
    x, y = _batch(16, 8)
    report = tune(Flaky, (x, y), budget_s=30, progress=False,
                  skip=["compile", "ema", "deterministic", "mixed_precision:fp16", "memory_efficient_bn"])
    by = {r.name: r for r in report.results}
    cl = by["channels_last"]  # fails at once: .view of a channels_last tensor
    assert cl.status == "failed" and cl.verdict == "failed"
    assert "view" in cl.reason and cl.step_s is None
    bf16 = by["mixed_precision:bf16"]  # fails in the middle of the timed rounds
    assert bf16.status == "failed" and "raised while timed" in bf16.reason and "flaky" in bf16.reason
    assert bf16.step_s is None and bf16.ratio is None
    # ... and everything else was measured anyway
    assert report.baseline.step_s and report.rounds >= 5
    others = [r for r in report.results if r.name not in ("channels_last", "mixed_precision:bf16")]
    assert others and all(r.status == "measured" and r.ratio for r in others), others
    assert "failed: RuntimeError" in report.to_text()


def test_memory_limit_below_the_plain_need_finds_a_configuration_that_fits():
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
    assert (cfg["checkpointing"], cfg["accumulate"]) == (best.changes.get("checkpointing", ""),
                                                         best.changes.get("accumulate", 1))
    assert cfg["batch_size"] * cfg["accumulate"] == 16  # the effective batch is the one asked for


def test_nothing_fits_is_said_plainly():
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
    assert toml == report.recommended_config()  # exactly the recommendation: every tuned switch stated
    assert set(TUNED_KEYS) <= set(toml)
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


def test_recommended_switches_reach_fit_exactly(tmp_path):
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
        assert history.config["fused_optimizer"] == bool(r.changes.get("fused_optimizer", False))
        assert ("fused_optimizer" in applied or "foreach_optimizer" in applied) == \
            bool(r.changes.get("fused_optimizer", False))


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
