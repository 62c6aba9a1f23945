"""Regret of the tune: its pick against the best configuration a grid of the speed switches can measure (issue 35).

Claim: ``torch_tricks.tune``'s answer is the best configuration that can be measured on this machine inside
its budget. For each model (a CNN, a transformers causal LM, a small transformer encoder), in one process:
the tune runs as a user runs it (``--budget`` s; its seconds from the call to the report written against
1.05 x the budget) and its ``tricks.toml`` is the pick, as ``Tricks`` applies it (a switch the file leaves
unwritten, undecided, keeps ``TrainConfig``'s default: ``fused_optimizer`` on). The grid: every combination of the speed switches
that apply (bf16 only where native: ``torch.cuda.is_bf16_supported()``, or a CPU flag avx512_bf16/amx_bf16,
since an emulated bf16 cannot win and the tune calls it slower from a probe; fused optimizer; channels_last for a 4-D
input; threads 1 / all cores on a CPU; fp32 matmuls in the device's native fast mode, T33, on the fp32
arms; a transformers model's other attention implementations that train here, T34), each built through
``Tricks`` from one initial model (a copy each).

The race is a successive halving in one process, round-robin, a new random order each round, each step
timed alone: the grid, the pick and a second plain arm (A/A) get ``--first-rounds`` (4) rounds; the slower
half of the grid arms leave (never plain at 1 and at all cores, the A/A or the pick: the trust checks and
the regret need them), the survivors get twice the rounds, until at most 3 grid arms are left; the last
stage gives them, the plain arms, the A/A and the pick at least ``--rounds`` (12), and compile on top of the
best two grid arms joins it (not with ``--no-compile``). An arm's median is over the rounds it was in.
**Regret** = the pick's median step / the best arm's, both over the last stage only (same conditions); where
the pick is a grid configuration, its arm and the pick's are one configuration (their steps pooled; 1.0 when it
is the best). PASS at <= 1.03 (``--busy``: 1.10) with ``_trust``'s checks (A/A within the regret allowed: 3%,
busy 10%: a race whose identical arms differ by more cannot resolve the claim; plain not slower on all cores
than on one and no foreign load during the race, both but under ``--busy``), else UNRELIABLE.
Why halving: raced in full, the grid's 16 arms x 15 rounds (twice) took longer than the tune it judges (over
20 minutes for ResNet-18 alone on 2 shared cores), when a few rounds show most arms plainly slower.

``--busy``: a busy loop on one core throughout; the tune's first line must say the machine is shared, and no
speed trick may be "skipped: over --budget-seconds". ``--budgets 30 60 120``: the budget wall alone (no
grid): the README's two tune examples, built as the CLI builds them (``--models`` cnn: ResNet-18, lm: GPT-2),
tuned at each budget: seconds from the ``tune`` call to the report written against 1.05 x the budget.

``--models lm-readme``: the README's small GPT-2 (2 x 64, sequence 32, batch 4), a causal LM whose step a
120 s tune can measure compile on here (the 4 x 256 ``lm``'s 1.5-s step and 41-s compile need about 240 s).

    python benchmarks/tune_regret.py                         # the three models, 120 s of tune each
    python benchmarks/tune_regret.py --models cnn --budget 30 --rounds 10 [--busy]
    python benchmarks/tune_regret.py --budgets 30 60 120 [--busy]
"""
from __future__ import annotations

import argparse
import os
import signal
import copy
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/_trust.py
from _trust import UNRELIABLE, LoadMonitor, aa_check, load_check, thread_check, verdict  # noqa: E402

QUIET_TARGET, BUSY_TARGET, BUDGET_SLACK = 1.03, 1.10, 1.05
KEEP = 3  # the halving stops when at most this many grid arms (the plain ones apart) are left
EMULATED_BF16 = "bf16 left out of the grid: this CPU emulates it"
GRID_KEYS = ("precision", "fp32_matmul", "attention", "fused_optimizer", "channels_last", "compile")  # the grid's switches (and threads)
EXAMPLES = {  # the README's tune examples as its command lines write them: model, --hf-config, --input, --batch
    "cnn": ("resnet18", None, "3x64x64", 32),
    "lm": ("hf:gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 2}, "input_ids=long:32:50257", 4),
}


# --------------------------------------------------------------------------- the models


@dataclass
class Case:
    """A model to tune: a factory, one batch, its loss, and whether its input is an image (channels_last)."""

    name: str
    title: str
    make: Callable[[], Any]
    batch: Any
    loss: Callable[[Any, Any], Any]
    image: bool = False


def cases() -> dict[str, Case]:
    import torch
    import torch.nn.functional as F

    from torch_tricks.models import get_model, load_model

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50257, (8, 128), generator=g)
    toks = torch.randint(0, 1000, (16, 128), generator=g)
    return {
        "cnn": Case("cnn", "ResNet-18 (3x64x64, batch 32)", lambda: get_model("resnet18", num_classes=1000),
                    (torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 1000, (32,), generator=g)),
                    lambda m, b: F.cross_entropy(m(b[0]), b[1]), image=True),
        "lm": Case("lm", "GPT-2-style causal LM (4 x 256, vocab 50257, seq 128, batch 8)",
                   lambda: load_model("hf:gpt2", hf_config={"n_layer": 4, "n_embd": 256, "n_head": 4,
                                                            "n_positions": 128})[0],
                   {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss),
        "lm-readme": Case("lm-readme", "the README's GPT-2 (2 x 64, vocab 50257, seq 32, batch 4)",
                          lambda: load_model("hf:gpt2", hf_config=EXAMPLES["lm"][1])[0],
                          {"input_ids": ids[:4, :32], "labels": ids[:4, :32]}, lambda m, b: m(**b).loss),
        "encoder": Case("encoder", "built-in transformer encoder (tokens 128 of 1000, batch 16)",
                        lambda: get_model("transformer"), (toks, torch.randint(0, 2, (16,), generator=g)),
                        lambda m, b: F.cross_entropy(_logits(m(b[0])), b[1])),
    }


def _logits(out: Any) -> Any:
    """A classifier's logits from a model that returns a tensor or a tuple (the first element)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def build_example(name: str) -> tuple[Any, Any, Any]:
    """``(model, batch, loss_fn)`` of a README example as ``torch-tricks tune`` builds them (load_with_specs,
    then example_batch with the default loss: a causal LM's own, its ``input_ids`` as ``labels``)."""
    from torch_tricks.batches import example_batch
    from torch_tricks.inspect.inputs import make_inputs, parse_input_specs
    from torch_tricks.models import load_model

    ref, hf_config, spec, batch = EXAMPLES[name]
    model, _ = load_model(ref, hf_config=hf_config)
    inputs = make_inputs(parse_input_specs([spec]), batch, model=model, device="cpu")
    return (model, *example_batch(model, inputs, seed=0, loss="auto"))


# --------------------------------------------------------------------------- the arms


@dataclass(eq=False)
class Arm:
    """One configuration in the race: its [train] keys, threads, and the steps timed (all, and the last stage's)."""

    name: str
    cfg: dict[str, Any]
    threads: int
    times: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)  # the last stage's rounds: what the regret compares
    step: Callable[[], None] | None = None
    first_s: float = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("inf")

    @property
    def last_median(self) -> float:
        return statistics.median(self.last) if self.last else float("inf")


def grid(case: Case, cores: int, bf16: bool, fast_fp32: str | None = None,
         attention: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every combination of the speed switches that apply to ``case`` here (threads under ``"threads"``);
    ``fast_fp32``: the fp32 matmul mode this device runs natively (T33), on the fp32 arms only (under bf16
    autocast the matmuls are bf16 already); ``attention``: the implementations a transformers model can train
    with here besides its own (T34; "" is its own)."""
    axes = {"precision": ["fp32", "bf16"] if bf16 else ["fp32"], "fp32_matmul": ["", fast_fp32] if fast_fp32 else [""],
            "attention": ["", *attention],
            "fused_optimizer": [False, True], "channels_last": [False, True] if case.image else [False],
            "threads": sorted({1, cores})}
    keys = list(axes)
    combos = [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]
    return [c for c in combos if not (c["fp32_matmul"] and c["precision"] != "fp32")]


def label(cfg: dict[str, Any], threads: int) -> str:
    on = [k if v is True else f"{k}={v}" for k, v in cfg.items()
          if k != "threads" and v is not False and v not in ("fp32", "", 0) and not (k == "accumulate" and v == 1)]
    return (" + ".join(on) or "plain") + f" @{threads}t"


def cpu_bf16_native(cpuinfo: str) -> bool:
    """Whether ``/proc/cpuinfo``'s flags name a bf16 unit (avx512_bf16, amx_bf16); elsewhere bf16 is emulated."""
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.partition(":")[2].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def bf16_native() -> tuple[bool, str]:
    """Whether bf16 goes in the grid here, and the note printed when it does not."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(), "bf16 left out of the grid: this GPU does not run it natively"
    info = Path("/proc/cpuinfo")
    return cpu_bf16_native(info.read_text() if info.exists() else ""), EMULATED_BF16


def build_arm(case: Case, model0: Any, cfg: dict[str, Any], threads: int, name: str) -> Arm:
    """``cfg`` through ``Tricks`` on a copy of ``model0``: the arm's one-step closure."""
    import torch

    from torch_tricks.train import Tricks

    keys = {k: v for k, v in cfg.items() if k != "threads"}
    tricks = Tricks({"device": "cpu" if not torch.cuda.is_available() else "cuda", "progress": False,
                     "nan_guard": False, "fused_optimizer": False, **keys})
    model, _ = tricks.prepare(copy.deepcopy(model0))
    batch = tricks.to_device(case.batch)

    def step() -> None:
        with tricks.autocast():
            loss = case.loss(model, batch)
        tricks.backward(loss)
        tricks.step()
    return Arm(name, cfg, threads, step=step)


def timed(arm: Arm) -> float:
    import torch

    torch.set_num_threads(arm.threads)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    arm.step()
    sync()
    return time.perf_counter() - t


# --------------------------------------------------------------------------- the race: successive halving


def halving_plan(contenders: int, first: int, rounds: int, keep: int = KEEP) -> list[tuple[int, int]]:
    """``(grid arms racing, rounds)`` per stage: all for ``first`` rounds, then the faster half with twice the
    rounds until at most ``keep`` are left; the last stage (never the first: the best two must be known before
    compile joins it) has at least ``rounds``."""
    plan, n, r = [(contenders, first)], contenders, first
    while n > keep:
        n, r = n - n // 2, 2 * r
        plan.append((n, r))
    if len(plan) == 1:
        plan.append((n, 2 * r))
    plan[-1] = (n, max(rounds, plan[-1][1]))
    return plan


def faster(arms: list[Arm], n: int) -> list[Arm]:
    """The ``n`` arms with the shortest median over the rounds they were in."""
    return sorted(arms, key=lambda a: a.median)[:n]


def race(arms: list[Arm], rounds: int, rng: random.Random, *, last: bool = False) -> None:
    """Warm-up of new arms (the first call apart), then ``rounds`` rounds, each arm once in a new random order."""
    for arm in arms:
        if not arm.first_s:
            arm.first_s = timed(arm)
            timed(arm)
    for _ in range(rounds):
        for arm in rng.sample(arms, len(arms)):
            t = timed(arm)
            arm.times.append(t)
            if last:
                arm.last.append(t)


def run_halving(contenders: list[Arm], kept: list[Arm], others: list[Arm], plan: list[tuple[int, int]],
                join_last: Callable[[list[Arm]], list[Arm]], seed: int = 0) -> list[Arm]:
    """Race ``plan``'s stages: ``kept`` (grid arms) and ``others`` run every round, ``contenders`` leave by
    halves (their models let go); ``join_last`` adds arms to the last stage. Returns its grid arms."""
    rng = random.Random(seed)
    for i, (n, rounds) in enumerate(plan):
        stay = faster(contenders, n)
        for arm in set(contenders) - set(stay):
            arm.step = None
        contenders = stay
        joined = join_last(contenders + kept) if i == len(plan) - 1 else []
        race(contenders + kept + joined + others, rounds, rng, last=i == len(plan) - 1)
    return contenders + kept + joined


# --------------------------------------------------------------------------- one model


def run_case(case: Case, args: argparse.Namespace, cores: int, bf16: bool) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model0 = case.make()
    torch.set_num_threads(cores)
    run = tune_pick(case, model0, args.budget)
    arms, kept, aa, pick = build_arms(case, model0, run.picked, cores, bf16)
    contenders = [a for a in arms if a not in kept]
    join = partial(compile_arms, case, model0) if args.compile else (lambda _: [])
    with LoadMonitor() as window:
        plan = halving_plan(len(contenders), args.first_rounds, args.rounds)
        last = run_halving(contenders, kept, [aa, pick], plan, join)
    r = judge(last, aa, pick, kept, window, args, cores)
    return r | {"case": case, "tune": run, "arms": arms + [a for a in last if a not in arms] + [aa, pick]}


def build_arms(case: Case, model0: Any, picked: dict[str, Any], cores: int, bf16: bool
               ) -> tuple[list[Arm], list[Arm], Arm, Arm]:
    """The grid's arms, its plain arms at 1 and all cores (kept to the end), the A/A arm, the pick's arm."""
    import torch

    from torch_tricks.train.matmul_mode import fast_fp32_matmul_mode

    from torch_tricks.train.attention import attention_modes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fast = fast_fp32_matmul_mode(device)[0]
    attention = tuple(attention_modes(model0, device)[0])  # none for a model that is not a transformers one
    arms = [build_arm(case, model0, c, c["threads"], label(c, c["threads"]))
            for c in grid(case, cores, bf16, fast, attention)]
    kept = [next(a for a in arms if a.name == f"plain @{t}t") for t in sorted({1, cores})]
    threads = int(picked.get("threads") or cores)
    mine = as_applied(picked)
    return (arms, kept, build_arm(case, model0, kept[-1].cfg, cores, "plain (A/A)"),
            build_arm(case, model0, mine, threads, "the tune's pick: " + label(mine, threads)))


def as_applied(picked: dict[str, Any]) -> dict[str, Any]:
    """The pick as ``Tricks('tricks.toml')`` runs it: a grid switch the file does not write (the tune left it
    undecided) keeps ``TrainConfig``'s default, as in a user's run (``fused_optimizer``: on)."""
    from torch_tricks.train.config import TrainConfig

    defaults = TrainConfig()
    return {**{k: getattr(defaults, k) for k in GRID_KEYS if k not in picked}, **picked}


def tune_pick(case: Case, model0: Any, budget: float) -> TuneRun:
    """The tune as a user runs it on ``case`` (a dict batch: the model's own loss)."""
    import torch.nn.functional as F

    loss_fn = None if isinstance(case.batch, dict) else (lambda out, y: F.cross_entropy(_logits(out), y))
    return timed_tune(case.name, lambda: copy.deepcopy(model0), case.batch, loss_fn, budget)


@dataclass
class TuneRun:
    """A tune timed from its call to its report written, and what the claims read from it."""

    name: str
    budget: float
    seconds: float
    picked: dict[str, Any]  # its tricks.toml's [train]
    skipped: list[str]  # speed tricks "skipped: over --budget-seconds"
    first_line: str  # the report's: says whether the machine is shared
    phase_s: dict[str, float] = field(default_factory=dict)  # the report's seconds per phase (printed on a FAIL)

    @property
    def ok(self) -> bool:
        return self.seconds <= BUDGET_SLACK * self.budget

    @property
    def says_shared(self) -> bool:
        return "shared" in self.first_line.lower()


def timed_tune(name: str, model: Any, batch: Any, loss_fn: Any, budget: float) -> TuneRun:
    from torch_tricks import tune

    with tempfile.TemporaryDirectory(prefix=f"tune-{name.replace(':', '-')}-") as out:
        t0 = time.perf_counter()
        report = tune(model, batch, loss_fn, budget_s=budget, progress=False, name=name)
        report.write(out)
        seconds = time.perf_counter() - t0
        picked = tomllib.loads((Path(out) / "tricks.toml").read_text()).get("train", {})
    return TuneRun(name, budget, seconds, picked, skipped_over_budget(report), report.to_text().splitlines()[0],
                   dict(report.phase_s))


def compile_arms(case: Case, model0: Any, grid_arms: list[Arm]) -> list[Arm]:
    """Compile on top of the best two grid arms so far."""
    return [build_arm(case, model0, {**a.cfg, "compile": True}, a.threads, a.name + " + compile")
            for a in faster(grid_arms, 2)]


def skipped_over_budget(report: Any) -> list[str]:
    """The speed tricks the tune did not measure for want of time."""
    return [r.name for r in report.results
            if r.goal == "speed" and r.status == "skipped" and r.reason.startswith("over --budget-seconds")]


def judge(last: list[Arm], aa: Arm, pick: Arm, kept: list[Arm], window: Any, args: argparse.Namespace,
          cores: int) -> dict[str, Any]:
    """The regret over the last stage, with its trust checks."""
    best = min(last, key=lambda a: a.last_median)
    twin = same_configuration(pick, last)
    # a configuration timed by two arms (the pick, and its grid arm) is one configuration: its steps pooled
    pooled = statistics.median(pick.last + twin.last) if twin is not None else pick.last_median
    regret = 1.0 if twin is best else pooled / best.last_median
    target = BUSY_TARGET if args.busy else QUIET_TARGET
    # the race must resolve the claim: two identical arms may differ by no more than the regret allowed
    checks = [aa_check(kept[-1].last_median, aa.last_median, what="plain vs plain", tolerance=target - 1.0)]
    if cores > 1 and not args.busy:  # a busy core makes all-core steps slower on purpose: the tune's to find out
        checks.append(thread_check(kept[0].last_median, kept[-1].last_median, cores, what="plain step"))
    if not args.busy:
        checks.append(load_check(window.load, what="the race"))
    return {"best": best, "pick": pick, "regret": regret, "target": target, "checks": checks,
            "status": verdict(regret <= target, checks)}


def same_configuration(pick: Arm, arms: list[Arm]) -> Arm | None:
    """The grid arm of exactly the pick's configuration (the grid's switches and threads), if it has one."""
    axes = {"precision": "fp32", "fp32_matmul": "", "attention": "", "fused_optimizer": False, "channels_last": False,
            "compile": False}
    mine = {k: pick.cfg.get(k, v) for k, v in axes.items()}
    if set(pick.cfg) - set(axes) - {"threads"}:
        return None  # the pick switches on something the grid does not have
    return next((a for a in arms if a is not pick and a.threads == pick.threads
                 and {k: a.cfg.get(k, v) for k, v in axes.items()} == mine), None)


def arm_lines(arms: list[Arm], best: Arm) -> list[str]:
    """The race's table: the last stage's arms first (by their last-stage median), then those that left."""
    rows = [f"   {'arm':<58} {'rounds':>6} {'median':>10} {'last stage':>10} {'vs best':>8} {'first call':>11}"]
    for a in sorted(arms, key=lambda a: (a.last_median, a.median)):
        last, vs = (f"{a.last_median * 1e3:8.1f}ms", f"{a.last_median / best.last_median:7.2f}x") if a.last \
            else (f"{'-':>10}", f"{'left':>8}")
        rows.append(f"   {a.name:<58} {len(a.times):>6} {a.median * 1e3:8.1f}ms {last} {vs} {a.first_s:10.2f}s")
    return rows


def print_case(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n== {r['case'].title}")
    print("\n".join(arm_lines(r["arms"], r["best"])))
    failed = "; ".join(str(c) for c in r["checks"] if not c.ok)
    print(f"   regret (last stage): {r['regret']:.3f} (target <= {r['target']:.2f}) -> {r['status']}"
          + (f" ({failed})" if r["status"] == UNRELIABLE else ""))
    run = r["tune"]
    print(f"   budget: the tune took {run.seconds:.0f} s of {run.budget:.0f} s ({run.seconds / run.budget:.2f}x, "
          f"claim <= {BUDGET_SLACK:.2f}x) -> {'PASS' if run.ok else 'FAIL'}")
    if not run.ok:  # where the time went
        print("            phases: " + ", ".join(f"{k} {v:.1f}s" for k, v in run.phase_s.items()))
    print("   every speed trick measured: "
          + ("PASS" if not run.skipped else "FAIL (skipped over the budget: " + ", ".join(run.skipped) + ")"))
    if args.busy:
        print(f"   first line says the machine is shared: {'PASS' if run.says_shared else 'FAIL'} "
              f"({run.first_line!r})")


def regret_overall(results: list[dict[str, Any]], busy: bool) -> str:
    """One line: PASS only when every claim held on every model; else which did not."""
    missed = [claim for claim, ok in _claims(results, busy).items() if not ok]
    unreliable = any(r["status"] == UNRELIABLE for r in results)
    word = "PASS" if not missed else UNRELIABLE if unreliable else "FAIL"
    regrets = ", ".join(f"{r['case'].name} {r['regret']:.3f}" for r in results)
    return f"overall: {word} (regret: {regrets})" + (f"; not held: {', '.join(missed)}" if missed else "")


def _claims(results: list[dict[str, Any]], busy: bool) -> dict[str, bool]:
    return {"regret": all(r["status"] == "PASS" for r in results),
            "budget": all(r["tune"].ok for r in results),
            "every speed trick measured": all(not r["tune"].skipped for r in results),
            "first line says shared": not busy or all(r["tune"].says_shared for r in results)}


# --------------------------------------------------------------------------- the budget wall


def budget_run(name: str, budget: float, threads: int) -> TuneRun:
    """A README example tuned as the CLI tunes it (the model, not a factory; named by its --model), from the
    process's own thread count as a fresh CLI process would (a tune before may have left another)."""
    import torch

    torch.set_num_threads(threads)
    return timed_tune(EXAMPLES[name][0], *build_example(name), budget)


def budget_table(runs: list[TuneRun], busy: bool) -> list[str]:
    """The budget wall's table (``busy``: with whether each first line says shared) and its overall line."""
    head = f"   {'example':<8} {'budget':>7} {'seconds':>8} {'ratio':>6}  {'wall':<5} " + ("shared  " if busy else "")
    rows = [head + "speed tricks skipped: over --budget-seconds"]
    for r in runs:
        shared = f"{'yes' if r.says_shared else 'NO':<7} " if busy else ""
        rows.append(f"   {r.name:<8} {r.budget:6.0f}s {r.seconds:7.1f}s {r.seconds / r.budget:5.2f}x  "
                    f"{'PASS' if r.ok else 'FAIL':<5} {shared}{', '.join(r.skipped) or 'none'}")
        if not r.ok:  # where the time went
            rows.append("            phases: " + ", ".join(f"{k} {v:.1f}s" for k, v in r.phase_s.items()))
    return rows + [budget_overall(runs, busy)]


def budget_overall(runs: list[TuneRun], busy: bool) -> str:
    counts = {f"within {BUDGET_SLACK:.2f}x the budget": sum(r.ok for r in runs),
              "every speed trick measured": sum(not r.skipped for r in runs)}
    if busy:
        counts["first line says shared"] = sum(r.says_shared for r in runs)
    word = "PASS" if all(n == len(runs) for n in counts.values()) else "FAIL"
    return f"overall: {word} (" + "; ".join(f"{k}: {n} of {len(runs)}" for k, n in counts.items()) + ")"


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["cnn", "lm", "lm-readme", "encoder"],
                   default=["cnn", "lm", "encoder"],
                   help="the models (with --budgets: the README examples, cnn = ResNet-18, lm = GPT-2)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds of tune per model (default 120)")
    p.add_argument("--first-rounds", type=int, default=4, help="rounds of the halving's first stage (default 4)")
    p.add_argument("--rounds", type=int, default=12, help="rounds of the last stage, at least (default 12)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="no compile arms on the best two")
    p.add_argument("--busy", action="store_true", help="a busy loop on one core during the tunes and the race")
    p.add_argument("--budgets", type=float, nargs="+", metavar="S",
                   help="the budget wall check only (no grid): the README examples tuned at each of these budgets")
    args = p.parse_args(argv)
    if min([args.budget, *(args.budgets or [])]) <= 0 or min(args.rounds, args.first_rounds) < 1:
        p.error("budgets must be > 0 seconds, --rounds and --first-rounds at least 1")
    if args.budgets and not set(args.models) & set(EXAMPLES):
        p.error("--budgets needs --models cnn or lm: the README has a tune example for those only")
    return args


def check_budgets(args: argparse.Namespace) -> None:
    import torch

    left = [m for m in args.models if m not in EXAMPLES]
    if left:
        print(f"{', '.join(left)}: no tune example in the README, left out of the budget wall check")
    runs, threads = [], torch.get_num_threads()
    for name in [m for m in args.models if m in EXAMPLES]:
        for budget in args.budgets:
            print(f"tuning the README's {name} example at {budget:.0f} s ...", file=sys.stderr)
            runs.append(budget_run(name, budget, threads))
    print(f"\n== the budget wall: seconds from tune() to the report written, against {BUDGET_SLACK:.2f} x the "
          "budget" + (" (a busy loop on one core)" if args.busy else ""))
    print("\n".join(budget_table(runs, args.busy)))


def check_regret(args: argparse.Namespace, cores: int) -> None:
    bf16, note = bf16_native()
    if not bf16:
        print(note)
    results = []
    for name in args.models:
        case = cases()[name]
        print(f"tuning {case.title} ({args.budget:.0f} s), then the grid ...", file=sys.stderr)
        results.append(run_case(case, args, cores, bf16))
        print_case(results[-1], args)
    print("\n" + regret_overall(results, args.busy))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from torch_tricks.machine import available_cores

    busy = start_busy_loop() if args.busy else None
    try:
        if args.budgets:
            check_budgets(args)
        else:
            check_regret(args, available_cores())
    finally:
        if busy is not None:
            os.kill(busy, signal.SIGKILL)
    return 0


def start_busy_loop() -> int:
    """A busy loop on one core that is not in this process's tree (its pid): the tune counts other processes'
    CPU use as the machine's load but its own tree's as its own, so a child of ours would not be "another job"
    (a shell starts it in the background and exits; the loop is re-parented)."""
    out = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


if __name__ == "__main__":
    sys.exit(main())
