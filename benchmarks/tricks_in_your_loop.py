"""The tune's predicted speed-up next to the one its recommendation realises in your own loop (issue 13).

Claim: the speed-up ``torch_tricks.tune`` predicts for its recommended configuration is
the speed-up that configuration gives a training loop the user keeps, through
``torch_tricks.Tricks('tricks.toml')``. Checked on ResNet-18 (64x64 images, batch 16)
and a small GPT-2 (4 layers, 256 wide, 128 tokens, batch 8), each in one run:

1. ``tune`` (seeded, ``--budget`` seconds; by default 120 for ResNet-18 and 360 for GPT-2,
   whose 4 s step on one AVX2 core left a 120 s tune time for the two baselines only) on
   the model, one example batch and its loss;
   its report is written (``tricks.toml`` among it) and the prediction read off it: the
   recommended configuration's speed-up over the plain step, with its ~95% interval,
   and the tune's noise (plain against an identical plain, A/A). A tune that keeps the
   plain step predicts 1.00x.
2. The user's loop (:func:`user_loop`: ``for`` over batches, forward, loss, backward,
   step, as one writes it) runs twice through ``Tricks``: once from the ``tricks.toml``
   the tune wrote, once with the plain configuration the tune measured against (the same
   file with every tuned switch at its plain value: fp32, ``fused_optimizer = false``,
   no compile ...). The optimizer is the one ``tricks.prepare(model)`` builds from the
   config, so both arms run exactly the optimizer the tune timed (AdamW, fit's no-decay
   groups; plain: the for-loop step, tuned: fused if recommended). ``--optimizer own``
   passes the user's ``torch.optim.AdamW(model.parameters())`` instead, which ``Tricks``
   switches to its fused step in place; on a CPU its default step is the tune's plain
   one, but on CUDA a default AdamW already takes the foreach step, so the plain arm is
   faster than the tune's plain and a fused gain comes out smaller than predicted.
   Same model weights (a copy each), the tune's batch and loss function. The two loops run
   in a fresh Python process (``--loop fresh``, the default), as a training script run
   after the tune would: it rebuilds the model and batch from the seed, checks they sum to
   what the tune got, and reads ``tricks.toml`` from the folder the tune wrote.
   ``--loop same`` runs them in the tune's process instead, after it.
3. After warm-up steps (the first call, which compiles under ``compile``, is timed
   apart), the two loops are stepped interleaved: every round one step of each, in a
   new random order, each step timed alone (``torch.cuda.synchronize`` around it on
   CUDA). Realised speed-up = the median over rounds of plain step time / tuned step
   time; its ~95% interval is the distribution-free one of a median (order statistics
   ``n/2 -+ 0.98 sqrt(n)``: the tune's own rule), half its width printed as ``±``.
   Process-wide switches (``deterministic``, ``cudnn_benchmark``) are set around each
   arm's step and put back after it, as the tune does, so one arm's never leaks into the
   other's (a real run has one configuration per process).
4. AGREE when ``|realised - predicted| <= max(tune noise, predicted half-interval,
   realised half-interval, the tune's min effect)``, else DISAGREE; the script prints the
   rule, one line per model and an overall line. The exit code is 0 unless something
   raised: it is a benchmark, not a test.
5. Before a verdict counts, the run checks its baselines (issue 16, ``benchmarks/_trust.py``);
   a model whose check fails is UNRELIABLE, neither AGREE nor DISAGREE, and the overall
   line is not PASS: the tune's A/A (plain against an identical plain, its "noise") must
   be within 10% (a wider noise widens the tolerance until anything agrees); and other
   processes may use at most a quarter of a core on average during the tune and during
   the interleaved rounds of the loops (``/proc/stat`` less this process tree's CPU time;
   the loop process measures its own). The threads check does not apply: every arm runs
   on ``--threads`` threads, none on one for comparison.

``--threads`` defaults to 1: on 2 shared cores, two OpenMP threads per process next to
any other busy process make each step 10-20x slower and erratic; the tune and the loop
run under the same count, so the comparison holds at any count.

The allocator, on a CPU: with glibc's defaults a small process hands freed memory back
to the OS and takes fresh pages again every step; the plain step's for-loop AdamW makes
a temporary per parameter, so in a fresh process ResNet-18's plain step cost ~20,000
minor page faults (226 ms, against 207 ms for the same step in the tune), the fused bf16
step ~7,000. Inside the tune, where a dozen model copies kept the heap warm, the race's
steps page-faulted not at all, so it timed the plain step faster than a user's process
ran it and under-predicted a fused optimizer's gain (measured before the fix: 1.36x
predicted, 1.46x realised: DISAGREE). Since then ``Tricks`` keeps the heap on a CPU
(``keep_heap``, on by default: :func:`torch_tricks.train.speed.keep_heap`), in the tune's
process and in the user's alike, so both time a step without those faults.
``--no-keep-heap`` runs the two loops with ``keep_heap = false`` (the tune keeps its own),
which shows what the allocator alone does to a prediction on this machine. The minor page
faults per step of each arm are printed for this reason. GPT-2's 200 MB logits stay
mapped either way (over glibc's 32 MiB cap), the same in tune and loop.

    python benchmarks/tricks_in_your_loop.py                       # both models, 120 s tunes, 30 rounds
    python benchmarks/tricks_in_your_loop.py --models resnet18 --budget 60 --rounds 20
    python benchmarks/tricks_in_your_loop.py --optimizer own --out tune-reports --json loop.json
    python benchmarks/tricks_in_your_loop.py --no-keep-heap     # the loops on glibc's default heap
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/_trust.py, when imported from elsewhere
from _trust import UNRELIABLE, ForeignLoad, LoadMonitor, aa_check, load_check, why  # noqa: E402
from _trust import verdict as trust_verdict  # noqa: E402  (verdict below is this benchmark's AGREE rule)

# name -> (load_model reference, hf_config, input spec with {size}/{seq}, batch option, default tune budget s)
MODELS = {
    "resnet18": ("resnet18", None, "3x{size}x{size}", "resnet_batch", 120.0),
    "gpt2": ("hf:gpt2", "n_layer=4,n_embd=256,n_head=4", "long:{seq}:50257", "gpt_batch", 360.0),
}


# -- the user's loop -------------------------------------------------------------------------

def user_loop(model: Any, batches: Any, loss_fn: Callable[..., Any], config: Any, device: str,
              optimizer: Any = None) -> Iterator[Any]:
    """A training loop as one writes it, through ``Tricks``; yields after each step so the
    benchmark can interleave two of them (a plain loop would just run on)."""
    from torch_tricks import Tricks

    tricks = Tricks(config, device=device)  # config: the path of tricks.toml, or a dict
    model, optimizer = tricks.prepare(model, optimizer)
    model.train()
    for batch in batches:
        inputs, target = tricks.to_device(batch)
        with tricks.autocast():
            loss = loss_fn(model(*inputs), target)
        tricks.backward(loss)
        tricks.step()
        yield loss.detach(), tricks


# -- one model ---------------------------------------------------------------------------------

def build(name: str, args: argparse.Namespace) -> tuple[Any, Any, Callable[..., Any], str]:
    """``(model, batch, loss_fn, description)``: the model, seeded, and the tune's example batch and loss."""
    import torch

    from torch_tricks.batches import example_batch
    from torch_tricks.inspect.inputs import make_inputs
    from torch_tricks.models import load_model

    ref, hf_config, spec, batch_opt, _ = MODELS[name]
    spec = spec.format(size=args.resnet_size, seq=args.gpt_seq)
    n = getattr(args, batch_opt)
    torch.manual_seed(args.seed)
    model, _ = load_model(ref, hf_config=hf_config)
    inputs = make_inputs(spec, n, model=model, seed=args.seed)
    batch, loss_fn = example_batch(model, inputs, seed=args.seed)
    return model, batch, loss_fn, f"{name} ({ref}{', ' + hf_config if hf_config else ''}), input {spec}, batch {n}"


def plain_config(report: Any) -> dict[str, Any]:
    """The configuration the tune's speed-ups are relative to: the recommendation with every tuned switch plain."""
    from torch_tricks.train.config import TrainConfig
    from torch_tricks.tuning.tuner import TUNED_KEYS

    cfg = report.recommended_config("throughput")
    defaults = TrainConfig()
    cfg.update({k: getattr(defaults, k) for k in TUNED_KEYS})
    cfg["fused_optimizer"] = False  # TrainConfig's default is on; the tune's plain step has it off
    cfg.update(report.baseline.changes if report.baseline else {})
    cfg["batch_size"] = report.batch
    return cfg


def fingerprint(model: Any, batch: Any) -> str:
    """Sums of the weights and of the batch: the child process checks it builds what the tune got."""
    import torch

    def tensors(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, dict):
            return [t for v in x.values() for t in tensors(v)]
        if isinstance(x, (tuple, list)):
            return [t for v in x for t in tensors(v)]
        return []

    w = sum(float(p.detach().double().sum()) for p in model.parameters())
    b = sum(float(t.double().sum()) for t in tensors(batch))
    return f"{w!r}/{b!r}"


def run_tune(name: str, args: argparse.Namespace, out_root: Path) -> dict[str, Any]:
    """1. The tune and its prediction; writes its report (tricks.toml) and plain.json into ``out_root/name``."""
    import torch

    from torch_tricks import tune

    model, batch, loss_fn, what = build(name, args)
    with LoadMonitor() as window:
        report = tune(model, batch, loss_fn, device=torch.device(args.device), budget_s=budget(name, args),
                      seed=args.seed, progress=False, name=name)
    out = out_root / name
    report.write(out)
    (out / "plain.json").write_text(json.dumps(plain_config(report), indent=2))
    best = report.best_throughput
    if best is None or best is report.baseline or best.speedup is None:
        predicted, pred_half, chosen = 1.0, None, "the plain step"
    else:
        predicted, pred_half, chosen = best.speedup, best.speedup_half_ci, best.name
    return {
        "model": name, "what": what, "device": args.device, "chosen": chosen,
        "switches": report.recommended_tricks("throughput") if report.baseline else [],
        "predicted": predicted, "predicted_half": pred_half,
        "noise": None if math.isnan(report.noise) else report.noise, "min_effect": report.min_effect,
        "tune_rounds": report.rounds, "tune_stop": report.stop_reason, "tune_s": report.elapsed_s,
        "tune_plain_step_s": report.baseline.step_s if report.baseline else None,
        "report_dir": str(out), "fingerprint": fingerprint(model, batch),
        "tune_load": _load_dict(window.load),
    }


def run_loops(name: str, args: argparse.Namespace, report_dir: Path) -> dict[str, Any]:
    """2-3. The user's loop twice, plain and tricks.toml, warmed up, then timed interleaved."""
    import torch
    from tqdm import tqdm

    from torch_tricks.inspect.timing import synchronize
    from torch_tricks.train.config import load_config
    from torch_tricks.tuning.measure import paired_ratio, switches

    model, batch, loss_fn, _ = build(name, args)
    dev = torch.device(args.device)
    arms: dict[str, dict[str, Any]] = {
        "plain": {"config": json.loads((report_dir / "plain.json").read_text())},
        "tuned": {"config": str(report_dir / "tricks.toml")},  # the file, as the user's loop reads it
    }
    if args.no_keep_heap:  # glibc's default heap in both loops (the tune kept its own)
        arms["plain"]["config"]["keep_heap"] = False
        arms["tuned"]["config"] = {**load_config(arms["tuned"]["config"]), "keep_heap": False}
    for arm in arms.values():
        m = copy.deepcopy(model)  # the same initial weights for both
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3) if args.optimizer == "own" else None
        arm["cfg"] = arm["config"] if isinstance(arm["config"], dict) else load_config(arm["config"])
        arm["loop"] = user_loop(m, _forever(batch), loss_fn, arm["config"], str(dev), optimizer=opt)
        arm["times"], arm["losses"], arm["faults"] = [], [], []

    def step(arm: dict[str, Any]) -> float:
        with switches(arm["cfg"]):
            synchronize(dev)
            f0 = _minor_faults()
            t0 = time.perf_counter()
            loss, tricks = next(arm["loop"])
            synchronize(dev)
            dt = time.perf_counter() - t0
            f1 = _minor_faults()
        arm["losses"].append(loss)
        arm["tricks"] = tricks
        if f0 is not None:
            arm["faults"].append(f1 - f0)
        return dt

    # warm-up (the first call apart: it compiles under compile), then interleaved rounds
    for arm in arms.values():
        arm["first_call_s"] = step(arm)
        for _ in range(args.warmup):
            step(arm)
    rng = random.Random(args.seed)
    order = list(arms)
    with LoadMonitor() as window:  # foreign load while the rounds are timed (this process and its children are ours)
        for _ in tqdm(range(args.rounds), desc=f"{name}: interleaved rounds", file=sys.stderr, leave=False):
            rng.shuffle(order)
            for k in order:
                arms[k]["times"].append(step(arms[k]))
    realised, real_half = paired_ratio(arms["plain"]["times"], arms["tuned"]["times"])  # per round plain / tuned
    return {
        "realised": realised, "realised_half": real_half, "rounds": args.rounds,
        "fingerprint": fingerprint(model, batch),
        "applied": {k: list(a["tricks"].applied) for k, a in arms.items()},
        "step_s": {k: _median(a["times"]) for k, a in arms.items()},
        "first_call_s": {k: a["first_call_s"] for k, a in arms.items()},
        "final_loss": {k: float(a["losses"][-1]) for k, a in arms.items()},
        "faults_per_step": {k: _median(a["faults"][-args.rounds:]) if a["faults"] else None for k, a in arms.items()},
        "steps": 1 + args.warmup + args.rounds,
        "loop_load": _load_dict(window.load),
    }


def loops_in_child(name: str, args: argparse.Namespace, report_dir: Path) -> dict[str, Any]:
    """:func:`run_loops` in a fresh Python process (the user's training script): its result as JSON on stdout."""
    import subprocess

    argv = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-dir", str(report_dir),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--resnet-batch", str(args.resnet_batch),
            "--resnet-size", str(args.resnet_size), "--gpt-batch", str(args.gpt_batch), "--gpt-seq", str(args.gpt_seq),
            "--threads", str(args.threads), "--device", args.device, "--optimizer", args.optimizer,
            "--seed", str(args.seed)] + (["--no-keep-heap"] if args.no_keep_heap else [])
    r = subprocess.run(argv, stdout=subprocess.PIPE, text=True)  # stderr (its progress bar) passes through
    if r.returncode != 0:
        raise RuntimeError(f"the loop process for {name} exited with {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def verdict(t: dict[str, Any], loop: dict[str, Any]) -> dict[str, Any]:
    """4. AGREE when |realised - predicted| <= the larger of the noise, both half-intervals and the min effect."""
    if loop["fingerprint"] != t["fingerprint"]:
        raise RuntimeError(f"{t['model']}: the loop process built other weights or another batch than the tune "
                           f"({loop['fingerprint']} != {t['fingerprint']})")
    terms = {"tune noise": t["noise"], "predicted half-interval": t["predicted_half"],
             "realised half-interval": loop["realised_half"], "min effect": t["min_effect"]}
    tolerance = max(v for v in terms.values() if v is not None and not math.isnan(v))
    diff = loop["realised"] - t["predicted"]
    checks = [load_check(ForeignLoad(**t["tune_load"]), what=f"{t['model']} tune"),
              load_check(ForeignLoad(**loop["loop_load"]), what=f"{t['model']} loops")]
    if t["noise"] is not None:
        checks.append(aa_check(None, None, ratio=1.0 + t["noise"],
                               what=f"{t['model']}: the tune's plain step (its noise, max(|A/A - 1|, half-interval))"))
    agree = abs(diff) <= tolerance
    status = trust_verdict(agree, checks)
    return {**t, **loop, "tolerance": tolerance, "tolerance_from": next(k for k, v in terms.items() if v == tolerance),
            "diff": diff, "agree": agree, "status": "AGREE" if status == "PASS" else "DISAGREE" if status == "FAIL"
            else UNRELIABLE, "unreliable_because": why(checks), "checks": [c.to_dict() for c in checks]}


def _load_dict(load: ForeignLoad) -> dict[str, Any]:
    """A :class:`ForeignLoad` as JSON (the loop process sends its own back)."""
    return {"wall_s": load.wall_s, "own_s": load.own_s, "foreign_s": load.foreign_s, "source": load.source,
            "loadavg": load.loadavg}


def budget(name: str, args: argparse.Namespace) -> float:
    """The tune's budget for ``name``: ``--budget``, else the model's default."""
    return args.budget if args.budget is not None else MODELS[name][4]


def _forever(batch: Any) -> Iterator[Any]:
    """The tune's one example batch, again and again (what the tune timed)."""
    while True:
        yield batch


def _minor_faults() -> int | None:
    """Minor page faults of this process so far (None where ``resource`` is missing: Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[(n - 1) // 2] + s[n // 2]) / 2 if n else math.nan


# -- output ------------------------------------------------------------------------------------

def _pm(x: float, half: float | None) -> str:
    return f"{x:.2f}x" + (f" ±{half:.2f}" if half is not None and math.isfinite(half) else "")


def print_results(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from torch_tricks._format import table

    rows = [[r["model"], ", ".join(r["switches"]) or "nothing (plain)", _pm(r["predicted"], r["predicted_half"]),
             _pm(r["realised"], r["realised_half"]), f"±{r['noise']:.1%}" if r["noise"] is not None else "n/a",
             f"{r['diff']:+.3f}", f"±{r['tolerance']:.3f} ({r['tolerance_from']})",
             r["status"]] for r in results]
    print(table(["model", "tricks.toml switches on", "predicted", "realised in loop", "tune noise",
                 "realised - pred.", "tolerance", "verdict"], rows, "llrrrrll"))
    print("\npredicted: the tune's speed-up of its recommendation over its plain step (± half its ~95% interval); "
          f"realised: median over {args.rounds} interleaved rounds of plain / tuned step time in the user's loop "
          f"through Tricks, in {'a fresh process' if args.loop == 'fresh' else 'the process of the tune'} "
          "(± half the order-statistics ~95% interval of that median)")
    print("rule: AGREE when |realised - predicted| <= max(tune noise, predicted half-interval, realised "
          "half-interval, the tune's min effect)\n")
    for r in results:
        ms = {k: v * 1e3 for k, v in r["step_s"].items()}
        tune_plain = f", the tune's plain step {r['tune_plain_step_s'] * 1e3:.0f} ms" if r["tune_plain_step_s"] else ""
        print(f"{r['what']}, {r['device']}:")
        stop = r["tune_stop"].split(":")[0]
        unmeasured = r["tune_stop"].partition("not measured for the budget: ")[2]
        print(f"  tune: {r['tune_s']:.0f} s, {r['tune_rounds']} rounds in its race of single tricks, stopped: {stop}"
              + (f" (not measured for the budget: {unmeasured})" if unmeasured else "")
              + f"; recommends {r['chosen']}")
        pf = r["faults_per_step"]
        faults = (f"; minor page faults per step: plain {pf['plain']:,.0f}, tuned {pf['tuned']:,.0f}"
                  if pf["plain"] is not None else "")
        print(f"  loop: plain {ms['plain']:.0f} ms/step, tuned {ms['tuned']:.0f} ms/step (medians{tune_plain}); "
              f"first call plain {r['first_call_s']['plain']:.2f} s, tuned {r['first_call_s']['tuned']:.2f} s"
              + faults)
        print(f"  Tricks applied: plain [{', '.join(r['applied']['plain'])}], "
              f"tuned [{', '.join(r['applied']['tuned'])}]; loss after {r['steps']} steps on the batch: "
              f"plain {r['final_loss']['plain']:.4f}, tuned {r['final_loss']['tuned']:.4f}")
        for c in r["checks"]:
            print(f"  baseline check {'ok  ' if c['ok'] else 'FAIL'}  {c['kind']}: {c['detail']}")
        print(f"  {r['status']}: predicted {_pm(r['predicted'], r['predicted_half'])}, "
              f"realised {_pm(r['realised'], r['realised_half'])}: |{r['diff']:+.3f}| "
              f"{'<=' if r['agree'] else '>'} {r['tolerance']:.3f} ({r['tolerance_from']})"
              + (f" -- {UNRELIABLE}: {r['unreliable_because']}" if r["status"] == UNRELIABLE else ""))
        if not r["agree"] and pf["plain"] and "keep_heap" not in r["applied"]["plain"]:
            print("  hint: the loop's steps page-fault in fresh memory, which the tune's process (its heap kept) does "
                  "not; keep_heap = true (the default) runs the loop as the tune timed it (see the module doc)")
    n_ok = sum(r["status"] == "AGREE" for r in results)
    n_bad = sum(r["status"] == UNRELIABLE for r in results)
    overall = "PASS" if n_ok == len(results) else "FAIL" if n_ok + n_bad < len(results) else UNRELIABLE
    print(f"\noverall: {overall}: the tune's prediction and the speed-up realised "
          f"in the user's loop agree for {n_ok} of {len(results)} models"
          + (f" ({n_bad} {UNRELIABLE}: a baseline check failed)" if n_bad else ""))


def plot(results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(2.6 * len(results) + 3, 4.5))
    w = 0.36
    for i, r in enumerate(results):
        ax.fill_between([i - w - 0.04, i + w + 0.04], r["predicted"] - r["tolerance"], r["predicted"] + r["tolerance"],
                        color="grey", alpha=0.3, zorder=3, lw=0,
                        label="predicted ± agreement tolerance" if i == 0 else None)
        for dx, key, color, label in ((-w / 2, "predicted", "tab:blue", "predicted by the tune"),
                                      (w / 2, "realised", "tab:orange", "realised in your loop (Tricks)")):
            half = r[key + "_half"]
            half = half if half is not None and math.isfinite(half) else 0.0
            ax.bar(i + dx, r[key] - 1.0, bottom=1.0, width=w, color=color, label=label if i == 0 else None,
                   yerr=half, capsize=4, zorder=2)
            ax.text(i + dx, max(r[key], 1.0) + half + 0.005, f"{r[key]:.2f}x" + (f" ±{half:.2f}" if half else ""),
                    ha="center", va="bottom", fontsize=9, zorder=4)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(results)),
                  [f"{r['model']}\n{', '.join(r['switches']) or 'plain'}\n{r['status']}"
                   for r in results])
    ax.set_ylabel("training-step speed-up over the plain step")
    lo = min(min(r["predicted"], r["realised"]) - r["tolerance"] for r in results)
    hi = max(max(r["predicted"] + r["tolerance"], r["realised"] + (r["realised_half"] or 0)) for r in results)
    ax.set_ylim(min(lo, 1.0) - 0.05, hi + 0.08)
    ax.set_title(f"tune's prediction vs your loop, {results[0]['device']}, {args.threads or 'default'} thread(s), "
                 f"{args.rounds} rounds", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,gpt2", help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--budget", type=float, help="tune budget per model, seconds (default: resnet18 120, gpt2 360)")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved timed rounds of the two loops")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per loop after its first call")
    ap.add_argument("--resnet-batch", type=int, default=16)
    ap.add_argument("--resnet-size", type=int, default=64, help="image side for ResNet-18")
    ap.add_argument("--gpt-batch", type=int, default=8)
    ap.add_argument("--gpt-seq", type=int, default=128, help="tokens per sequence for GPT-2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    ap.add_argument("--optimizer", choices=("config", "own"), default="config",
                    help="config: tricks.prepare(model) builds the tune's optimizer; own: your AdamW, passed in")
    ap.add_argument("--no-keep-heap", action="store_true",
                    help="run the two loops with keep_heap = false (glibc's default heap: steps page-fault in "
                         "memory freed a step ago); the tune keeps its own (see the module doc)")
    ap.add_argument("--loop", choices=("fresh", "same"), default="fresh",
                    help="fresh: the two loops in a new Python process, as a training script runs after the tune; "
                         "same: in this process, after the tune (its heap state: see the module doc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: run the loops of this model, print JSON
    ap.add_argument("--child-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="keep the tune reports (tricks.toml, report.md ...) here, one folder per model")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--png", default=str(HERE / "tricks_in_your_loop.png"), help="bar plot path ('' for none)")
    args = ap.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        ap.error(f"unknown model(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(MODELS)}")

    import warnings

    import torch
    from tqdm import tqdm

    heap = ("glibc's defaults in the loops (--no-keep-heap), kept in the tune" if args.no_keep_heap
            else "kept by Tricks (keep_heap, the default) in tune and loops")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    warnings.filterwarnings("ignore")  # torch/inductor chatter would break the table
    if args.child:
        print(json.dumps(run_loops(args.child, args, Path(args.child_dir))))
        return 0
    print(f"tune's prediction vs the user's loop through Tricks: {', '.join(names)}; {args.device}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; tune budget {', '.join(f'{budget(n, args):.0f}' for n in names)} s, "
          f"{args.rounds} interleaved rounds after {args.warmup} warm-up steps, optimizer: {args.optimizer}; "
          f"loops: {'a fresh process' if args.loop == 'fresh' else 'this process, after the tune'}; heap: {heap}\n")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        out_root = Path(args.out) if args.out else Path(tmp)
        with tqdm(total=2 * len(names), desc="models", file=sys.stderr, unit="phase") as bar:
            for name in names:
                bar.set_description(f"{name}: tune ({budget(name, args):.0f} s)")
                t = run_tune(name, args, out_root)
                bar.update(1)
                bar.set_description(f"{name}: the two loops ({args.loop} process)")
                loop = loops_in_child(name, args, Path(t["report_dir"])) if args.loop == "fresh" else \
                    run_loops(name, args, Path(t["report_dir"]))
                bar.update(1)
                results.append(verdict(t, loop))
    print_results(results, args)
    if args.json:
        from torch_tricks._io import atomic_path

        with atomic_path(args.json) as tmp_path:
            tmp_path.write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))
    if args.png:
        png = plot(results, args, Path(args.png))
        if png is not None:
            print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
