"""A tune's verdict texts never contradict the numbers beside them.

Every verdict (``TuneReport.verdicts()``, and the verdict column of the table) is read and
each speed word is checked against its figure: "faster" needs an interval (or, without one,
a speed-up) above 1.00x, "slower" one below, and "(its interval reaches 1.00x)" an interval
whose bounds hold 1.00. A word is matched with the first figure after it against the same
reference ("faster than X" with "...x the speed of X"); a bare word (the verdict column's
"faster", against plain) with the row's own figure against plain, the speed-up column. The
reports are put together from planted figures (nothing timed), plus one short real tune.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from torch_tricks.tuning import TuneReport, tune
from torch_tricks.tuning.candidates import Skipped
from torch_tricks.tuning.report import Result

_NAME = r"[^\s,;()]+"
_FIGURE = re.compile(rf"(?P<x>\d+\.\d+)x the speed of (?P<ref>{_NAME})"
                     r"(?: \(95% interval (?P<lo>\d+\.\d+)-(?:(?P<hi>\d+\.\d+)x|inf)\))?")
_WORD = re.compile(rf"(?<!not )(?<!the )\b(?P<w>faster|slower)\b(?: than (?:the )?(?P<ref>{_NAME}))?")
_IS_FASTER = re.compile(rf"(?P<name>{_NAME}) is faster: (?P<a>\d+\.\d+)x(?: ±(?P<ah>\d+\.\d+))?"
                        r"(?: against (?P<b>\d+\.\d+)x(?: ±(?P<bh>\d+\.\d+))?)?")
_CANNOT = re.compile(r"cannot be \S+ (?:faster|slower)")  # a race's 'cannot be 2% faster than plain': no claim
_REACHES = re.compile(r"\(95% interval (?P<lo>\d+\.\d+)-(?P<hi>\d+\.\d+)x\)[^;]*?\(its interval reaches 1\.00x")
_MIB = 1 << 20


def _ref(name: str | None) -> str:
    return (name or "plain").rstrip(":.").removesuffix("'s")


def _row_figure(row: Result | None, ref: str) -> tuple[float, float] | None:
    """(low, high) speed against ``ref`` from the row's own figures; None where it has none."""
    if row is None:
        return None
    ratio, half = None, 0.0
    if ref == "plain":
        ratio, half = row.ratio, row.ratio_half_ci or 0.0
        if ratio is None and row.probe_ratio is not None:
            ratio = row.probe_ratio
    elif ref == row.vs_current_name:
        ratio, half = row.vs_current, row.vs_current_half_ci or 0.0
    if ratio is None:
        return None
    return 1 / (ratio + half), (1 / (ratio - half) if ratio > half else float("inf"))


def _figures(text: str) -> list[tuple[int, str, float, float]]:
    """(position, reference, low, high) of each '...x the speed of REF (95% interval lo-hi)' in ``text``."""
    out = []
    for m in _FIGURE.finditer(text):
        x = float(m["x"])
        lo = float(m["lo"]) if m["lo"] else x
        hi = float(m["hi"]) if m["hi"] else (float("inf") if m["lo"] else x)
        out.append((m.start(), _ref(m["ref"]), lo, hi))
    return out


def violations(text: str, row: Result | None) -> list[str]:
    """What in ``text`` (a verdict of ``row``) contradicts its figures, or cannot be checked against any."""
    problems: list[str] = []
    masked = _CANNOT.sub(lambda m: " " * len(m[0]), text)
    for m in _IS_FASTER.finditer(text):  # "B is faster: 2.00x ±0.04 against 1.50x ±0.02 the plain step"
        a, ah = float(m["a"]), float(m["ah"] or 0)
        if m["b"] is not None and not a > float(m["b"]):
            problems.append(f"{m[0]!r}: {a} is not faster than {m['b']}")
        if m["b"] is None and not a - ah >= 1.0:
            problems.append(f"{m[0]!r}: not above 1.00x")
        masked = masked[:m.start()] + " " * len(m[0]) + masked[m.end():]
    figures = _figures(text)
    for m in _WORD.finditer(masked):
        ref = _ref(m["ref"])
        after = [f for f in figures if f[0] > m.start() and f[1] == ref]
        lo, hi = (after[0][2], after[0][3]) if after else (_row_figure(row, ref) or (None, None))
        if lo is None:
            problems.append(f"{m[0]!r} against {ref}: no figure to check it by")
        elif m["w"] == "faster" and not lo >= 1.0:
            problems.append(f"{m[0]!r} beside an interval from {lo:.2f}x, not above 1.00x")
        elif m["w"] == "slower" and not hi <= 1.0:
            problems.append(f"{m[0]!r} beside an interval up to {hi:.2f}x, not below 1.00x")
    for m in _REACHES.finditer(text):
        if not float(m["lo"]) <= 1.0 <= float(m["hi"]):
            problems.append(f"'reaches 1.00x' beside the interval {m['lo']}-{m['hi']}x")
    return problems


def all_violations(report: TuneReport) -> list[str]:
    """Every verdict and every verdict cell of the table, checked; skipped rows have no figures to contradict."""
    out = []
    for v in report.explain():
        row = _figures_row(report, v["name"])
        if row is None:
            continue
        text = f"{v['verdict']}; {v['decision']}: {v['reason']}"
        out += [f"{v['name']}: {p} in {text!r}" for p in violations(text, row)]
    for cells in report.rows():
        row = _figures_row(report, cells[0])
        if row is not None:
            out += [f"{cells[0]} (table): {p}" for p in violations(cells[-1], row)]
    return out


def _figures_row(report: TuneReport, name: str) -> Result | None:
    """The row whose figures a verdict speaks of: the row itself, or for a compile row measured on top
    of another configuration ("see X+compile"), the row it points at."""
    row = report._by_name(name)
    if row is not None and row.reason.startswith("measured on top of"):
        return report._by_name(row.reason.rsplit("see ", 1)[-1]) or row
    return row


# -- planted reports ------------------------------------------------------------------------------


def _report(noise: float = 0.01) -> tuple[TuneReport, dict[str, Result]]:
    """bf16 the best single trick (2.00x plain), and one row of each kind of verdict beside it."""
    report = TuneReport(model="net", batch=32, device="cpu", optimizer="adamw", memory_limit=1 << 30,
                        memory_limit_source="given", budget_s=60.0, noise=noise, aa_ratio=1.0, aa_half_ci=noise,
                        drift_tolerance={"loss": 0.05}, rounds=30, run_steps=100_000, run_steps_source="assumed",
                        stop_reason="settled: after 30 rounds")
    r = {
        "plain": Result("plain", "baseline", {}, (), status="measured", verdict="baseline", step_s=1.0, ratio=1.0,
                        first_call_s=2.0, peak_bytes=100 * _MIB, losses=[2.3, 2.2, 2.1]),
        "bf16": Result("mixed_precision:bf16", "speed", {"precision": "bf16"}, ("T1",), status="measured",
                       verdict="faster", step_s=0.5, ratio=0.5, ratio_half_ci=0.01, first_call_s=2.0,
                       peak_bytes=80 * _MIB, loss_drift=0.01, rounds=30),
        "fused": Result("fused_optimizer", "speed", {"fused_optimizer": True}, ("T5",), status="measured",
                        verdict="faster", step_s=0.51, ratio=0.51, ratio_half_ci=0.02, first_call_s=2.0,
                        peak_bytes=80 * _MIB, loss_drift=0.0, rounds=30),
        "ema_speed": Result("foreach", "speed", {"foreach": True}, ("T7",), status="measured", verdict="faster",
                            step_s=0.667, ratio=0.667, ratio_half_ci=0.005, peak_bytes=80 * _MIB, rounds=30),
        "cl": Result("channels_last", "speed", {"channels_last": True}, ("T3",), status="measured",
                     verdict="faster, over the memory limit", step_s=0.9, ratio=0.9, ratio_half_ci=0.01,
                     peak_bytes=2 << 30, rounds=30),
        "inplace": Result("inplace_activations", "speed", {"inplace": True}, ("T8",), status="measured",
                          verdict="slower", step_s=1.2, ratio=1.2, ratio_half_ci=0.02, peak_bytes=90 * _MIB,
                          rounds=30),
        "noise": Result("memory_efficient_bn", "speed", {"memory_efficient_bn": True}, ("T9",), status="measured",
                        verdict="no measurable change", step_s=0.99, ratio=0.99, ratio_half_ci=0.03,
                        peak_bytes=90 * _MIB, rounds=30),
        "probe": Result("mixed_precision:fp16", "speed", {"precision": "fp16"}, ("T1",), status="measured (probe)",
                        verdict="slower", probe_ratio=12.0,
                        reason="probe took 1.2 s, 12x the plain one: not measured further"),
        # compile, measured on top of bf16; its row points at the +compile one and carries its verdict word
        "compile": Result("compile", "speed", {"compile": True}, ("T2",), status="measured", verdict="faster",
                          reason="measured on top of mixed_precision:bf16: see mixed_precision:bf16+compile"),
        "target": Result("mixed_precision:bf16+compile", "speed", {"precision": "bf16", "compile": True},
                         ("T1", "T2"), status="measured", verdict="faster", step_s=0.375, ratio=0.375,
                         ratio_half_ci=0.01, vs_current=0.75, vs_current_half_ci=0.01,
                         vs_current_name="mixed_precision:bf16", vs_current_step_s=0.5, first_call_s=2.0,
                         loss_drift=0.01, rounds=12),
    }
    r["bf16"].chosen = True
    report.baseline, report.best_throughput = r["plain"], r["bf16"]
    report.results = [r[k] for k in ("bf16", "fused", "ema_speed", "cl", "inplace", "noise", "probe", "compile")]
    report.combos = [r["target"]]
    report.skipped = [Skipped("cudnn_benchmark", ("T4",), "train", "cudnn.benchmark only affects CUDA convolutions")]
    return report, r


def _on_top(r: dict[str, Result], ratio: float, half: float) -> None:
    """The +compile row at ``ratio`` (time, against bf16) with ``half``; against plain it follows from bf16's."""
    t = r["target"]
    t.vs_current, t.vs_current_half_ci = ratio, half
    t.ratio, t.ratio_half_ci, t.step_s = 0.5 * ratio, 0.012, 0.5 * ratio
    t.vs_current_step_s = 0.5


def test_the_checker_finds_a_word_that_contradicts_its_interval():
    """The check can fail: the reported text, and each kind of contradiction, are found."""
    reported = ("faster; not recommended: inside the noise of bf16, which it extends: 0.86x the speed of bf16 "
                "(95% interval 0.85-0.88x) (its interval reaches 1.00x: the two overlap)")
    found = violations(reported.replace("inside the noise of", "faster than"), None)
    assert any("faster than bf16" in p for p in found) and any("reaches" in p for p in found)
    assert any("no figure" in p for p in found)  # the bare 'faster' against plain: nothing says it
    assert violations("slower than plain: 1.20x the speed of plain (95% interval 1.10-1.30x)", None)
    assert violations("bf16 is faster: 1.50x ±0.02 against 2.00x ±0.04 the plain step", None)
    assert not violations("slower than plain: 0.83x the speed of plain (95% interval 0.82-0.85x)", None)
    assert not violations("left the race: cannot be 2% faster than plain: 0.78x the speed of plain", None)


def test_every_verdict_of_a_planted_report_agrees_with_its_figures():
    report, r = _report()
    assert all_violations(report) == []
    why = {v["name"]: v for v in report.verdicts()}
    assert why["inplace_activations"]["reason"].startswith("slower than plain: 0.83x the speed of plain")
    assert why["foreach"]["reason"].startswith("mixed_precision:bf16 is faster: 2.00x ±0.04 against 1.50x")


def test_a_compile_row_slower_than_what_it_extends_says_slower_and_not_reaches():
    """The reported case: compile on top of bf16 at 0.86x bf16's speed (95% interval 0.85-0.88x) read
    'faster; ... (its interval reaches 1.00x)'. It is slower than bf16, and its interval stays below 1.00x."""
    report, r = _report()
    _on_top(r, 1.1564, 0.02)
    assert all_violations(report) == []
    t = r["target"]
    assert t.why.startswith("slower than mixed_precision:bf16, which it extends: 0.86x the speed of "
                            "mixed_precision:bf16 (95% interval 0.85-0.88x)")
    assert t.decision == "not recommended"
    for v in report.verdicts():
        if v["name"] in ("compile", t.name):
            assert "reaches 1.00x" not in v["reason"], v
    compile_v = next(v for v in report.verdicts() if v["name"] == "compile")
    compile_cell = next(c for c in report.rows() if c[0] == "compile")[-1]
    for text in (f"{compile_v['verdict']}; {compile_v['reason']}", compile_cell):
        assert "faster" not in text and "reaches 1.00x" not in text, text
        assert text.startswith("slower than mixed_precision:bf16"), text


@pytest.mark.parametrize("ratio, half, noise, word, reaches", [
    (0.97, 0.05, 0.01, "no measurable change on top of", True),  # 1.03x, interval 0.98-1.09x: reaches 1.00x
    (0.975, 0.01, 0.04, "no measurable change on top of", False),  # inside the noise, interval 1.02-1.04x
    (0.75, 0.01, 0.01, "faster than", False),  # 1.33x bf16's speed: recommended on a long run
])
def test_compile_on_top_says_what_its_own_interval_says(ratio, half, noise, word, reaches):
    report, r = _report(noise=noise)
    _on_top(r, ratio, half)
    if word == "faster than":
        report.best_throughput, r["target"].chosen, r["bf16"].chosen = r["target"], True, False
    assert all_violations(report) == []
    compile_v = next(v for v in report.explain() if v["name"] == "compile")
    assert compile_v["verdict"] == f"{word} mixed_precision:bf16"
    assert ("its interval reaches 1.00x" in r["target"].why) is reaches


def test_a_faster_extension_that_is_not_the_recommendation_gives_its_figure():
    report, r = _report()
    _on_top(r, 0.75, 0.01)
    report.best_throughput = r["fused"]  # after more rounds, another configuration is the best
    r["bf16"].chosen, r["fused"].chosen = False, True
    assert all_violations(report) == []
    assert r["target"].why.startswith("faster than mixed_precision:bf16, which it extends: 1.33x the speed of "
                                      "mixed_precision:bf16 (95% interval 1.32-1.35x), but the recommendation")


# -- a real tune -------------------------------------------------------------------------------------


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_every_verdict_of_a_real_tune_agrees_with_its_figures():
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(8, 3, 12, 12, generator=g), torch.randint(0, 10, (8,), generator=g)
    report = tune(_Small, batch, budget_s=12, progress=False, skip=["compile"], name="small")
    assert any(r.status == "measured" for r in report.results)
    assert all_violations(report) == []


def test_a_gain_as_large_as_the_noise_gets_no_call_either_way_and_says_what_would_settle_it():
    """No recommendation from a race whose noise is as large as the effect it would claim (issue 35): the trick
    is neither written on nor off, and the report says so with what would settle it."""
    report = TuneReport(model="net", batch=32, device="cpu", optimizer="adamw", memory_limit=1 << 30,
                        memory_limit_source="ram", budget_s=60.0, noise=0.08, aa_ratio=1.05, aa_half_ci=0.08,
                        drift_tolerance={"loss": 0.05}, rounds=12, stop_reason="budget: the time ran out",
                        machine={"cores": 2, "foreign_cores": 1.1, "shared": True, "text": "..."})
    plain = Result("plain", "baseline", {}, (), status="measured", verdict="baseline", step_s=1.0, ratio=1.0,
                   peak_bytes=100 * _MIB)
    fused = Result("fused_optimizer", "speed", {"fused_optimizer": True}, ("T7",), status="measured",
                   verdict="no measurable change", step_s=0.94, ratio=0.94, ratio_half_ci=0.03, peak_bytes=100 * _MIB)
    slow = Result("channels_last", "speed", {"channels_last": True}, (), status="measured",
                  verdict="no measurable change", step_s=1.01, ratio=1.01, ratio_half_ci=0.03, peak_bytes=100 * _MIB)
    report.baseline = report.best_throughput = plain
    report.results = [fused, slow]
    assert report.undecided() == [fused]  # 6% faster, beyond its own ±3% but inside the noise ±8%
    cfg = report.recommended_config()
    assert "fused_optimizer" not in cfg and cfg["channels_last"] is False  # no gain claimed: decided off
    text = report.to_text()
    line = next(x for x in text.splitlines() if x.startswith("no recommendation on "))
    assert "fused_optimizer 1.06x" in line and "±8.0%" in line and "neither on nor off" in line
    assert "a quieter machine (other processes used 1.1 cores" in line and "--threads 1" in line
    assert "keep the plain step" not in text.split("no recommendation on ")[1].splitlines()[0]
    # faster by 3% but inside its own interval too (0.97-1.10x): no call either (off would be a guess as well)
    fused.ratio, fused.ratio_half_ci = 0.97, 0.07
    assert report.undecided() == [fused] and "fused_optimizer" not in report.recommended_config()
    fused.ratio = 0.985  # under the least effect that counts (2%): decided off, as no measurable change
    assert report.undecided() == [] and report.recommended_config()["fused_optimizer"] is False
    fused.ratio, fused.ratio_half_ci = 0.94, 0.03
    report.noise = 0.01  # on a quiet machine the noise withholds nothing: no line, nothing left open
    assert report.undecided() == []
    assert all_violations(report) == []


def test_a_joint_combination_that_is_not_the_pick_says_which_was_faster_in_the_same_race():
    report, r = _report()
    pick = Result("fused_optimizer+mixed_precision:bf16", "speed", {"precision": "bf16", "fused_optimizer": True},
                  ("T1", "T5"), status="measured", verdict="faster", step_s=0.40, ratio=0.40, ratio_half_ci=0.01,
                  vs_current=0.8, vs_current_half_ci=0.01, vs_current_name="mixed_precision:bf16", rounds=20,
                  race="joint", peak_bytes=80 * _MIB)
    other = Result("channels_last+mixed_precision:bf16", "speed", {"precision": "bf16", "channels_last": True},
                   ("T1", "T3"), status="measured", verdict="faster", step_s=0.45, ratio=0.45, ratio_half_ci=0.01,
                   vs_current=0.9, vs_current_half_ci=0.01, vs_current_name="mixed_precision:bf16", rounds=20,
                   race="joint")
    report.combos = [pick, other]
    for row in report.results + report.combos:
        row.chosen = False
    report.best_throughput, pick.chosen = pick, True
    report.explain()
    assert other.decision == "not recommended"
    assert f"but {pick.name} was faster in the same race" in other.why
    assert "on top of which it was not measured" not in other.why
    assert [v for v in all_violations(report) if v.startswith((other.name, pick.name))] == []
