"""Regret of the tune: its pick against the best configuration a grid of the speed switches can measure (issue 35).

Claim: ``torch_tricks.tune``'s answer is the best configuration that can be measured on this machine inside
its budget. For each model (a CNN, a transformers causal LM, a small transformer encoder), in one process:

1. **The tune** runs as a user runs it (``--budget`` seconds, default 120; compile allowed), its wall time
   from the call to the report written is measured against the budget (``<= 1.05 x budget`` is the claim),
   and its ``tricks.toml`` is read back: the pick.
2. **The grid**: every combination of the speed switches that apply (precision fp32/bf16 where the CPU or
   GPU runs bf16, fused optimizer off/on, channels_last off/on for a 4-D input, intra-op threads 1 / all
   cores on a CPU), each built through ``torch_tricks.Tricks`` from one initial model (a copy each) with the
   optimizer the tune times (AdamW, lr 1e-3). Compile is then added on top of the best two after the first
   race (its first call timed apart).
3. **The race**: the grid, the pick and a second plain arm (the A/A check) are stepped round-robin, each
   round in a new random order, each step timed alone; an arm's time is the median of its steps. Threads
   are set per arm around its step.
4. **Regret** = the pick's median step time / the best grid arm's. PASS at <= 1.03 (``--busy``: 1.10),
   with the benchmarks' trust checks (``benchmarks/_trust.py``): the A/A within 10%, the plain arm on all
   cores not slower than on one (threads), and at most a quarter core of foreign load during the race (not
   checked under ``--busy``, which makes that load on purpose). A failed check makes the row UNRELIABLE.

``--busy`` starts a busy loop on one core before the tune and stops it after the race: the tune's first
report line must say the machine is shared, and every applicable speed trick must be measured (not
"skipped: over --budget-seconds"); both are printed as checks.

    python benchmarks/tune_regret.py                         # the three models, 120 s of tune each
    python benchmarks/tune_regret.py --models cnn --budget 30 --rounds 10
    python benchmarks/tune_regret.py --busy
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/_trust.py
from _trust import UNRELIABLE, LoadMonitor, aa_check, load_check, thread_check, verdict  # noqa: E402

QUIET_TARGET, BUSY_TARGET, BUDGET_SLACK = 1.03, 1.10, 1.05


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
        "encoder": Case("encoder", "built-in transformer encoder (tokens 128 of 1000, batch 16)",
                        lambda: get_model("transformer"), (toks, torch.randint(0, 2, (16,), generator=g)),
                        lambda m, b: F.cross_entropy(_logits(m(b[0])), b[1])),
    }


def _logits(out: Any) -> Any:
    """A classifier's logits from a model that returns a tensor or a tuple (the first element)."""
    return out[0] if isinstance(out, (tuple, list)) else out


# --------------------------------------------------------------------------- the arms


@dataclass
class Arm:
    """One configuration in the race: its [train] keys, threads, and the steps timed."""

    name: str
    cfg: dict[str, Any]
    threads: int
    times: list[float] = field(default_factory=list)
    step: Callable[[], None] | None = None
    first_s: float = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("inf")


def grid(case: Case, cores: int, bf16: bool) -> list[dict[str, Any]]:
    """Every combination of the speed switches that apply to ``case`` here (threads under ``"threads"``)."""
    axes = {"precision": ["fp32", "bf16"] if bf16 else ["fp32"], "fused_optimizer": [False, True],
            "channels_last": [False, True] if case.image else [False],
            "threads": sorted({1, cores})}
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*(axes[k] for k in keys))]


def label(cfg: dict[str, Any], threads: int) -> str:
    on = [k if v is True else f"{k}={v}" for k, v in cfg.items()
          if k != "threads" and v is not False and v not in ("fp32", "", 0) and not (k == "accumulate" and v == 1)]
    return (" + ".join(on) or "plain") + f" @{threads}t"


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
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    arm.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def race(arms: list[Arm], rounds: int, seed: int = 0) -> None:
    """Warm-up (the first call apart), then ``rounds`` rounds, each arm once a round in a new random order."""
    for arm in arms:
        if not arm.first_s:
            arm.first_s = timed(arm)
            timed(arm)
    rng = random.Random(seed)
    for _ in range(rounds):
        order = arms[:]
        rng.shuffle(order)
        for arm in order:
            arm.times.append(timed(arm))


# --------------------------------------------------------------------------- one model


def run_case(case: Case, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    import torch

    from torch_tricks import tune

    torch.manual_seed(0)
    model0 = case.make()
    torch.set_num_threads(cores)
    out = Path(tempfile.mkdtemp(prefix=f"regret-{case.name}-"))
    t0 = time.perf_counter()
    loss_fn = None if isinstance(case.batch, dict) else _loss_fn(case)  # a dict batch: the model's own loss
    report = tune(lambda: copy.deepcopy(model0), case.batch, loss_fn, budget_s=args.budget, progress=False,
                  name=case.name)
    report.write(out)
    tune_s = time.perf_counter() - t0
    picked = tomllib.loads((out / "tricks.toml").read_text()).get("train", {})
    pick_threads = int(picked.get("threads") or cores)
    bf16 = _bf16_fast()
    arms = [build_arm(case, model0, c, c["threads"], label(c, c["threads"])) for c in grid(case, cores, bf16)]
    plain_all = next(a for a in arms if a.name == f"plain @{cores}t")
    plain_one = next(a for a in arms if a.name == "plain @1t")
    aa = build_arm(case, model0, plain_all.cfg, cores, "plain (A/A)")
    pick = build_arm(case, model0, picked, pick_threads, "the tune's pick: " + label(picked, pick_threads))
    with LoadMonitor() as window:
        race(arms + [aa, pick], args.rounds)
        best_two = sorted(arms, key=lambda a: a.median)[:2]
        compiled = [build_arm(case, model0, {**a.cfg, "compile": True}, a.threads, a.name + " + compile")
                    for a in best_two] if args.compile else []
        race(arms + compiled + [aa, pick], args.rounds)
    return _judge(case, report, tune_s, arms + compiled, aa, pick, plain_one, plain_all, window, args, cores)


def _loss_fn(case: Case) -> Callable[[Any, Any], Any]:
    """``loss_fn(output, target)``, as ``tune`` calls it: the case's loss on the model's output."""
    import torch.nn.functional as F

    return lambda out, target: F.cross_entropy(_logits(out), target)


def _bf16_fast() -> bool:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available()


def _judge(case: Case, report: Any, tune_s: float, grid_arms: list[Arm], aa: Arm, pick: Arm, plain_one: Arm,
           plain_all: Arm, window: Any, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    best = min(grid_arms, key=lambda a: a.median)
    regret = pick.median / best.median
    target = BUSY_TARGET if args.busy else QUIET_TARGET
    checks = [aa_check(plain_all.median, aa.median, what="plain vs plain")]
    if cores > 1:
        checks.append(thread_check(plain_one.median, plain_all.median, cores, what="plain step"))
    if not args.busy:
        checks.append(load_check(window.load, what="the race"))
    over_budget = [r.name for r in report.results if r.status == "skipped" and "--budget-seconds" in r.reason]
    first = report.to_text().splitlines()[0]
    return {"case": case, "best": best, "pick": pick, "regret": regret, "target": target,
            "status": verdict(regret <= target, checks), "checks": checks, "tune_s": tune_s,
            "budget_ok": tune_s <= BUDGET_SLACK * args.budget, "over_budget": over_budget, "first_line": first,
            "says_shared": "shared" in first.lower(), "arms": sorted(grid_arms + [aa, pick], key=lambda a: a.median)}


def print_case(r: dict[str, Any], args: argparse.Namespace) -> None:
    case, best = r["case"], r["best"]
    print(f"\n== {case.title}")
    print(f"   {'arm':<58} {'median':>10} {'vs best':>8} {'first call':>11}")
    for arm in r["arms"]:
        print(f"   {arm.name:<58} {arm.median * 1e3:8.1f}ms {arm.median / best.median:7.2f}x "
              f"{arm.first_s:10.2f}s")
    print(f"   regret: {r['regret']:.3f} (target <= {r['target']:.2f}) -> {r['status']}"
          + (f" ({'; '.join(str(c) for c in r['checks'] if not c.ok)})" if r["status"] == UNRELIABLE else ""))
    print(f"   budget: the tune took {r['tune_s']:.0f} s of {args.budget:.0f} s "
          f"({r['tune_s'] / args.budget:.2f}x, claim <= {BUDGET_SLACK:.2f}x) -> "
          f"{'PASS' if r['budget_ok'] else 'FAIL'}")
    print(f"   every speed trick measured: {'PASS' if not r['over_budget'] else 'FAIL (skipped over the budget: ' + ', '.join(r['over_budget']) + ')'}")
    if args.busy:
        print(f"   first line says the machine is shared: {'PASS' if r['says_shared'] else 'FAIL'} "
              f"({r['first_line']!r})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=["cnn", "lm", "encoder"], default=["cnn", "lm", "encoder"])
    p.add_argument("--budget", type=float, default=120.0, help="seconds of tune per model (default 120)")
    p.add_argument("--rounds", type=int, default=15, help="race rounds (each arm once a round; default 15)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="no compile arms on the best two")
    p.add_argument("--busy", action="store_true", help="a busy loop on one core during the tune and the race")
    args = p.parse_args(argv)

    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        results = []
        for name in args.models:
            case = cases()[name]
            print(f"tuning {case.title} ({args.budget:.0f} s), then the grid ...", file=sys.stderr)
            results.append(run_case(case, args, cores))
            print_case(results[-1], args)
    finally:
        if busy is not None:
            busy.kill()
    statuses = [r["status"] for r in results]
    overall = "PASS" if all(s == "PASS" for s in statuses) and all(r["budget_ok"] for r in results) else (
        UNRELIABLE if UNRELIABLE in statuses else "FAIL")
    regrets = ", ".join(f"{r['case'].name} {r['regret']:.3f}" for r in results)
    print(f"\noverall: {overall} (regret: {regrets})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
