"""benchmarks/tune_regret.py's pure parts, with fake arms and fake timings: no tune and no model runs here.
The grid and its labels, the successive halving (who leaves, who races every round, the last stage the
regret is read from), the bf16 flag test, the regret's verdict and the budget wall's table."""

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import statistics

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import tune_regret as tr  # noqa: E402
from _trust import UNRELIABLE  # noqa: E402

from torch_tricks.tuning.result import Result  # noqa: E402


def _case(image: bool) -> tr.Case:
    return tr.Case("x", "x", make=lambda: None, batch=None, loss=lambda m, b: None, image=image)


def _arm(name: str, t: float) -> tr.Arm:
    """A fake arm: its step is never called (``timed`` is replaced); its time is ``t`` (cfg["t"])."""
    return tr.Arm(name, {"t": t}, 1, step=lambda: None)


@pytest.fixture
def fake_clock(monkeypatch):
    """``timed`` returns the arm's cfg["t"] and logs the order of the calls (warm-up calls included)."""
    calls = []

    def timed(arm):
        assert arm.step is not None, f"{arm.name} was timed after it left"
        calls.append(arm.name)
        return arm.cfg["t"]
    monkeypatch.setattr(tr, "timed", timed)
    return calls


# --------------------------------------------------------------------------- grid, label, bf16


def test_grid_is_every_combination_that_applies():
    image = tr.grid(_case(True), 2, bf16=False)
    assert len(image) == 8 and {c["precision"] for c in image} == {"fp32"}
    assert {(c["fused_optimizer"], c["channels_last"], c["threads"]) for c in image} == {
        (f, cl, t) for f in (False, True) for cl in (False, True) for t in (1, 2)}
    assert len(tr.grid(_case(True), 2, bf16=True)) == 16
    tokens = tr.grid(_case(False), 4, bf16=True)
    assert len(tokens) == 8 and not any(c["channels_last"] for c in tokens)
    assert {c["threads"] for c in tr.grid(_case(False), 1, bf16=False)} == {1}  # one core: one thread count


def test_the_pick_is_built_as_tricks_applies_the_file():
    """A switch tricks.toml does not write keeps TrainConfig's default in the pick's arm (a user's run)."""
    assert tr.as_applied({"threads": 1}) == {"precision": "fp32", "fp32_matmul": "", "attention": "",
                                             "fused_optimizer": True, "channels_last": False, "compile": False,
                                             "threads": 1}
    written = {"precision": "bf16", "fused_optimizer": False, "compile": True}
    assert tr.as_applied(written) == {**written, "channels_last": False, "fp32_matmul": "", "attention": ""}


def test_the_fast_fp32_matmul_mode_is_an_axis_of_the_fp32_arms_only():
    arms = tr.grid(_case(False), 2, bf16=True, fast_fp32="bf16")
    assert {(c["precision"], c["fp32_matmul"]) for c in arms} == {("fp32", ""), ("fp32", "bf16"), ("bf16", "")}
    assert len(arms) == 3 * 2 * 2 and tr.label(arms[4], 1) == "fp32_matmul=bf16 @1t"
    lm = tr.grid(_case(False), 2, bf16=False, attention=("eager",))  # a transformers model: its own and eager
    assert len(lm) == 2 * 2 * 2 and {c["attention"] for c in lm} == {"", "eager"}
    assert tr.label(next(c for c in lm if c["attention"]), 1) == "attention=eager @1t"


def test_label_names_what_is_on():
    assert tr.label({"precision": "fp32", "fused_optimizer": False, "channels_last": False, "threads": 2}, 2) \
        == "plain @2t"
    assert tr.label({"precision": "bf16", "fused_optimizer": True, "channels_last": False, "threads": 1}, 1) \
        == "precision=bf16 + fused_optimizer @1t"
    assert tr.label({"compile": True, "accumulate": 1, "threads": 2}, 4) == "compile @4t"  # the arm's threads


def test_bf16_only_where_the_cpu_flags_say_native():
    assert not tr.cpu_bf16_native("processor\t: 0\nflags\t\t: fpu avx512f avx512bw avx512_vnni\n")
    assert tr.cpu_bf16_native("flags\t\t: fpu avx512f avx512_bf16\n")
    assert tr.cpu_bf16_native("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert not tr.cpu_bf16_native("bugs\t\t: avx512_bf16\n")  # only the flags line counts
    assert not tr.cpu_bf16_native("")
    assert tr.EMULATED_BF16 == "bf16 left out of the grid: this CPU emulates it"


# --------------------------------------------------------------------------- the halving


@pytest.mark.parametrize("contenders, plan", [
    (6, [(6, 4), (3, 12)]),  # ResNet-18 on this CPU: 8 arms less the 2 plain ones
    (14, [(14, 4), (7, 8), (4, 16), (2, 32)]),  # bf16 native: twice the rounds each stage, the last >= 12
    (3, [(3, 4), (3, 12)]),  # already few: the first stage, then the last (compile needs the best two)
    (2, [(2, 4), (2, 12)]),
])
def test_halving_plan(contenders, plan):
    assert tr.halving_plan(contenders, 4, 12) == plan


def test_halving_plan_rules_hold_for_any_size():
    for n in range(40):
        plan = tr.halving_plan(n, 3, 10)
        assert plan[0] == (n, 3) and len(plan) >= 2 and plan[-1][1] >= 10
        assert plan[-1][0] == (n if n <= tr.KEEP else plan[-2][0] - plan[-2][0] // 2) <= max(n, 0)
        assert plan[-1][0] <= tr.KEEP or n <= tr.KEEP
        for (a, ra), (b, rb) in zip(plan[:-2], plan[1:-1]):
            assert b == a - a // 2 > tr.KEEP and rb == 2 * ra  # the faster half stays, with twice the rounds


def test_halving_races_the_faster_half_and_keeps_the_checks_arms(fake_clock):
    contenders = [_arm(f"g{i}", 1.0 + i / 10) for i in range(6)]  # g0 fastest
    kept = [_arm("plain @1t", 3.0), _arm("plain @2t", 2.0)]
    aa, pick = _arm("plain (A/A)", 2.0), _arm("pick", 1.05)
    joined = []

    def join(arms):
        joined.extend(_arm(a.name + " + compile", a.cfg["t"] * 0.9) for a in tr.faster(arms, 2))
        return joined
    last = tr.run_halving(contenders, kept, [aa, pick], tr.halving_plan(6, 4, 12), join)
    assert {a.name for a in last} == {"g0", "g1", "g2", "plain @1t", "plain @2t", "g0 + compile", "g1 + compile"}
    for a in contenders[3:]:
        assert a.step is None and len(a.times) == 4 and not a.last  # left after the first stage
    for a in contenders[:3] + kept + [aa, pick]:
        assert len(a.times) == 16 and len(a.last) == 12
    assert all(len(a.times) == len(a.last) == 12 for a in joined)
    warm = {a.name: fake_clock.count(a.name) for a in contenders + kept + joined}
    assert warm["g0"] == 16 + 2 and warm["g5"] == 4 + 2  # the warm-up's two calls, once per arm


def test_each_round_is_a_new_random_order(fake_clock):
    arms = [_arm(f"a{i}", 1.0) for i in range(5)]
    tr.race(arms, 6, random.Random(0))
    rounds = [tuple(fake_clock[10 + 5 * r: 15 + 5 * r]) for r in range(6)]  # after the warm-up's 10 calls
    assert all(sorted(r) == sorted(a.name for a in arms) for r in rounds)  # each arm once a round
    assert len(set(rounds)) > 1


def test_regret_is_read_over_the_last_stage_only():
    best = _arm("bf16 + fused", 1.0)
    best.times, best.last = [1.0] * 8, [1.0] * 4
    pick = _arm("pick", 1.0)
    pick.times, pick.last = [0.5] * 8 + [1.2] * 4, [1.2] * 4  # fast early rounds do not count
    plain1, plain2, aa = _arm("plain @1t", 3), _arm("plain @2t", 2), _arm("plain (A/A)", 2)
    for a, t in ((plain1, 3.0), (plain2, 2.0), (aa, 2.05)):
        a.times, a.last = [t] * 8, [t] * 4
    args = SimpleNamespace(busy=True)
    r = tr.judge([best, plain1, plain2], aa, pick, [plain1, plain2], None, args, 2)
    assert r["best"] is best and r["regret"] == pytest.approx(1.2) and r["status"] == "FAIL"
    assert r["target"] == tr.BUSY_TARGET
    pick.last = [1.08] * 4
    assert tr.judge([best, plain1, plain2], aa, pick, [plain1, plain2], None, args, 2)["status"] == "PASS"
    aa.last = [2.5] * 4  # the A/A twin off by 25%: no verdict
    assert tr.judge([best, plain1, plain2], aa, pick, [plain1, plain2], None, args, 2)["status"] == UNRELIABLE
    plain2.last, aa.last = [3.5] * 4, [3.5] * 4  # all cores slower than one: what a busy core does, on purpose
    assert tr.judge([best, plain1, plain2], aa, pick, [plain1, plain2], None, args, 2)["status"] == "PASS"
    quiet = SimpleNamespace(busy=False)  # on a quiet machine it means the race is not to be trusted
    r = tr.judge([best, plain1, plain2], aa, pick, [plain1, plain2], SimpleNamespace(load=[]), quiet, 2)
    assert r["status"] == UNRELIABLE and not r["checks"][1].ok


def test_a_pick_that_is_a_grid_configuration_is_pooled_with_its_arm_and_the_aa_must_resolve_the_claim():
    """The pick's configuration timed twice (its own arm and the grid's) is one configuration: 1.0 when it is the
    best, whatever the two arms' own spread; and a quiet claim of 3% needs identical arms within 3%."""
    fused = tr.Arm("fused @2t", {"precision": "fp32", "fused_optimizer": True, "channels_last": False}, 2)
    other = tr.Arm("fused + cl @2t", {"precision": "fp32", "fused_optimizer": True, "channels_last": True}, 2)
    pick = tr.Arm("the tune's pick", {"fused_optimizer": True, "threads": 2}, 2)
    plain1 = tr.Arm("plain @1t", {}, 1)
    plain2, aa = tr.Arm("plain @2t", {}, 2), tr.Arm("plain (A/A)", {}, 2)
    for a, t in ((fused, 1.0), (other, 1.02), (pick, 1.07), (plain1, 3.0), (plain2, 2.0), (aa, 2.02)):
        a.times, a.last = [t] * 4, [t] * 4
    assert tr.same_configuration(pick, [other, fused, plain2]) is fused
    assert tr.same_configuration(tr.Arm("p", {"fused_optimizer": True, "accumulate": 2}, 2), [fused]) is None
    args = SimpleNamespace(busy=False)
    r = tr.judge([fused, other, plain1, plain2], aa, pick, [plain1, plain2], SimpleNamespace(load=[]), args, 2)
    assert r["best"] is fused and r["regret"] == 1.0
    other.last = [0.95] * 4  # another configuration the best: the pick's two arms pooled against it
    r = tr.judge([fused, other, plain1, plain2], aa, pick, [plain1, plain2], SimpleNamespace(load=[]), args, 2)
    assert r["regret"] == pytest.approx(statistics.median([1.0] * 4 + [1.07] * 4) / 0.95)
    aa.last = [2.08] * 4  # identical arms 4% apart: a 3% claim cannot be resolved
    assert tr.judge([fused, other, plain1, plain2], aa, pick, [plain1, plain2], SimpleNamespace(load=[]), args,
                    2)["checks"][0].ok is False


def test_arm_table_puts_the_arms_that_left_last():
    a, b, gone = _arm("a", 1), _arm("b", 1), _arm("gone", 1)
    a.times, a.last, b.times, b.last, gone.times = [2.0] * 3, [2.0] * 3, [1.0] * 3, [1.0] * 3, [0.5]
    lines = tr.arm_lines([gone, a, b], b)
    assert [line.split()[0] for line in lines[1:]] == ["b", "a", "gone"]
    assert "2.00x" in lines[2] and "left" in lines[3] and "1000.0ms" in lines[1]


def _run(seconds=100.0, budget=100.0, skipped=(), first="tune: the machine is shared (1.0 cores of others)"):
    return tr.TuneRun("resnet18", budget, seconds, {}, list(skipped), first)


def test_regret_overall_says_which_claim_did_not_hold():
    ok = {"status": "PASS", "regret": 1.01, "case": _case(True), "tune": _run()}
    assert tr.regret_overall([ok], busy=True) == "overall: PASS (regret: x 1.010)"
    late = dict(ok, tune=_run(seconds=106.0))
    assert tr.regret_overall([ok, late], busy=False).endswith("; not held: budget")
    quiet = dict(ok, tune=_run(first="tune: ResNet"))
    assert "not held: first line says shared" in tr.regret_overall([quiet], busy=True)
    assert tr.regret_overall([quiet], busy=False).startswith("overall: PASS")
    shaky = dict(ok, status=UNRELIABLE)
    assert tr.regret_overall([shaky], busy=False).startswith(f"overall: {UNRELIABLE}")


# --------------------------------------------------------------------------- the budget wall


def test_budget_table_holds_each_tune_against_1_05_x_its_budget():
    runs = [_run(31.5, 30.0), _run(31.6, 30.0, skipped=["compile", "channels_last"], first="tune: ResNet")]
    lines = tr.budget_table(runs, busy=False)
    assert "seconds" in lines[0] and "shared" not in lines[0]
    assert "1.05x" in lines[1] and "PASS" in lines[1] and lines[1].endswith("none")
    assert "FAIL" in lines[2] and lines[2].endswith("compile, channels_last")
    assert lines[-1] == ("overall: FAIL (within 1.05x the budget: 1 of 2; every speed trick measured: 1 of 2)")
    busy = tr.budget_table(runs[:1], busy=True)
    assert "shared" in busy[0] and " yes " in busy[1]
    assert busy[-1].startswith("overall: PASS") and "first line says shared: 1 of 1" in busy[-1]


def test_only_speed_tricks_skipped_over_the_budget_count():
    def res(name, goal, status, reason):
        return Result(name, goal, {}, (name,), status=status, reason=reason)
    report = SimpleNamespace(results=[
        res("channels_last", "speed", "skipped", "over --budget-seconds before it could be measured: raise it"),
        res("compile", "speed", "skipped", "over --budget-seconds: compiling takes about 28 s here"),
        res("checkpointing", "memory", "skipped", "over --budget-seconds before it could be measured: raise it"),
        res("fused_optimizer", "speed", "measured", ""),
        res("cudnn_benchmark", "speed", "skipped", "no CUDA device")])
    assert tr.skipped_over_budget(report) == ["channels_last", "compile"]


def test_the_examples_are_the_readmes_command_lines():
    readme = (ROOT / "README.md").read_text()
    for ref, hf, spec, batch in tr.EXAMPLES.values():
        hf_flag = f" --hf-config {','.join(f'{k}={v}' for k, v in hf.items())}" if hf else ""
        assert f"tune --model {ref}{hf_flag} --input {spec} --batch {batch}" in readme


def test_bad_arguments_exit_2(capsys):
    for argv in (["--budgets", "30", "--models", "encoder"], ["--rounds", "0"], ["--budgets", "0"]):
        with pytest.raises(SystemExit) as e:
            tr.parse_args(argv)
        assert e.value.code == 2
    assert "--budgets needs --models cnn or lm" in capsys.readouterr().err
    assert tr.parse_args(["--budgets", "30", "60"]).budgets == [30.0, 60.0]
