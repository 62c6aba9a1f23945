"""Each training trick against the plain fp32 step, side by side in one run, on this machine.

Claim (issue 3): on a deep net (ResNet-50 at batch 8, 224x224) activation checkpointing
cuts the activation memory by >= 60% at <= 40% extra step time; inplace activations and
the memory-efficient BN+ReLU cut it measurably with identical gradients; bf16,
channels_last and torch.compile (its default mode, and max-autotune-no-cudagraphs, T35, with the
steps after which each first call pays back) report whatever their real ratios are on this CPU, and so does
fp32 matmul in bf16 (T33, issue 36: its gradient drift beside it) where the CPU has bf16 units
(AVX512-BF16 or AMX; elsewhere its row says why it does not run); "batch x2" is the plain step at twice the
batch, with its samples a second against plain's (T36).

How to read it: every ratio is trick / plain, measured in this run. Step times come from
``compare``, which interleaves the variants round-robin so machine drift hits all alike;
the IQR column is the noise. "activations" is what autograd saves for backward
(saved_tensors_hooks); "step peak" is the peak of live tensor bytes one training step
allocates (exact on any device). Ratios below 1 are better.

The checkpointing target is judged only on baselines this run checked first (issue 16,
``benchmarks/_trust.py``); when one fails it is UNRELIABLE, not PASS or FAIL, with the check
named: the plain step is timed twice (``plain fp32 (A/A)``, one more interleaved variant)
and the two must agree within 10%; with several threads, the plain step is also timed on
one thread (``plain fp32, 1 thread``), which the multi-thread one must not be slower than;
and other processes may use at most a quarter of a core on average while the steps are timed.

    python benchmarks/train_tricks.py                 # ResNet-50, batch 8, 224x224
    python benchmarks/train_tricks.py --model resnet18 --batch 8 --size 128 --repeats 3
    python benchmarks/train_tricks.py --png train_tricks.png --json train_tricks.json
    python benchmarks/train_tricks.py --model resnet18 --size 64 --memory-model '' --lm   # + attention (T34)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_trust.py, when imported from elsewhere
from _trust import UNRELIABLE, LoadMonitor, aa_check, rules_text, thread_check, verdict, why  # noqa: E402

from torch_tricks._format import human_bytes, table
from torch_tricks.inspect.memory import memory_report, saved_activation_bytes
from torch_tricks.inspect.step import Workloads
from torch_tricks.inspect.timing import compare
from torch_tricks.models import get_model

CHECKPOINT_MEMORY_TARGET = 0.40  # activations kept, as a fraction of plain (>= 60% cut)
CHECKPOINT_TIME_TARGET = 1.40  # step time, as a ratio to plain (<= 40% extra)


def variants(model_name: str) -> dict[str, Callable[[], tuple[nn.Module, Callable[[Any], Any], str]]]:
    """name -> builder returning (model, input transform, precision)."""
    from torch_tricks.train.memory import checkpoint_blocks, inplace_activations, memory_efficient_bn_act
    from torch_tricks.train.speed import channels_last, compile_model, to_channels_last

    def base() -> nn.Module:
        torch.manual_seed(0)
        m = get_model(model_name)
        for mod in m.modules():  # built-in models use inplace activations; the plain baseline must not
            if getattr(mod, "inplace", False) is True:
                mod.inplace = False
        return m

    same = lambda x: x  # noqa: E731
    return {
        "plain fp32": lambda: (base(), same, "fp32"),
        "checkpointing": lambda: (checkpoint_blocks(base()), same, "fp32"),
        "inplace": lambda: (inplace_activations(base()), same, "fp32"),
        "memory-efficient BN": lambda: (memory_efficient_bn_act(base()), same, "fp32"),
        "inplace + mem-eff BN": lambda: (memory_efficient_bn_act(inplace_activations(base())), same, "fp32"),
        "bf16 autocast": lambda: (base(), same, "bf16"),
        FP32_BF16: lambda: (base(), same, "fp32"),
        "channels_last": lambda: (channels_last(base()), to_channels_last, "fp32"),
        "torch.compile": lambda: (compile_model(base()), same, "fp32"),
        COMPILE_MA: lambda: (compile_model(base(), mode="max-autotune-no-cudagraphs"), same, "fp32"),
        BATCH_X2: lambda: (base(), lambda x: torch.cat([x, x]), "fp32"),
    }


BATCH_X2 = "batch x2"  # T36: the same step at twice the batch; its samples a second against plain's
COMPILE_MA = "torch.compile max-autotune-no-cudagraphs"  # T35: inductor's autotuned kernels, no CUDA graphs
FP32_BF16 = "fp32 matmul in bf16"  # T33: fp32 weights and sums, the products of matmuls and convs in bf16 (oneDNN)
MEMORY_VARIANTS = ("plain fp32", "inplace", "memory-efficient BN", "inplace + mem-eff BN")
AA = "plain fp32 (A/A)"  # the plain step timed twice: the A/A pair
ONE_THREAD = "plain fp32, 1 thread"  # the plain step on one thread: the threads check


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated variant names to leave out (e.g. 'torch.compile')")
    ap.add_argument("--memory-model", default="mobilenet_v2",
                    help="second model for the inplace / memory-efficient BN rows ('' to skip): the ReLU6 "
                         "of MobileNetV2 saves its input, so there is something to save")
    ap.add_argument("--lm", action="store_true",
                    help="also the attention implementations (T34) and compile's modes (T35) on a GPT-2 (4 x 256, "
                         "sequence 128, batch 8)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--png", help="write a bar plot here (needs matplotlib)")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    results = {args.model: run_model(args.model, args, skip)}
    ck = results[args.model].get("checkpointing", {})
    checks = results[args.model].pop("_checks", [])
    print(f"\n{rules_text()}:")
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'}  {c}")
    if "activation_ratio" in ck:
        # the memory half needs no timing; the time half stands on the checked baseline
        mem_ok = ck["activation_ratio"] <= CHECKPOINT_MEMORY_TARGET
        ok = mem_ok and ck["time_ratio"] <= CHECKPOINT_TIME_TARGET
        status = verdict(ok, checks, fail_regardless=not mem_ok)
        ck["status"], ck["unreliable_because"] = status, why(checks)
        print(f"\ncheckpointing target (activations <= {CHECKPOINT_MEMORY_TARGET:.0%} of plain at <= "
              f"{CHECKPOINT_TIME_TARGET:.2f}x step time): activations {ck['activation_ratio']:.0%}, "
              f"time {ck['time_ratio']:.2f}x -> {status}"
              + (f" -- {UNRELIABLE}: {why(checks)}" if status == UNRELIABLE else ""))
    if args.memory_model:
        print()
        only = set(variants(args.memory_model)) - set(MEMORY_VARIANTS)
        results[args.memory_model] = run_model(args.memory_model, args, skip | only)
        results[args.memory_model].pop("_checks", None)
    if args.lm:
        print()
        results["gpt2 attention"] = run_attention(args)
        print()
        results["transformer sdpa kernels"] = run_sdpa_kernels(args)
    if args.json:
        from torch_tricks._io import atomic_path

        with atomic_path(args.json) as tmp:
            tmp.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    if args.png:
        _plot(results, args)
    return 0


def run_model(model_name: str, args: argparse.Namespace, skip: set[str]) -> dict[str, dict[str, Any]]:
    """Build every variant of ``model_name``, measure memory, then time all interleaved; print a table."""
    from tqdm import tqdm

    from torch_tricks.train.matmul_mode import check_fp32_matmul
    from torch_tricks.train.precision import check_precision

    x = torch.randn(args.batch, 3, args.size, args.size)
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], Any]] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    built = {k: v for k, v in variants(model_name).items() if k not in skip}
    for name, build in tqdm(built.items(), desc=f"{model_name}: build + memory", file=sys.stderr):
        try:
            if name == "bf16 autocast":
                check_precision("bf16", torch.device("cpu"))
            if name == FP32_BF16:  # where oneDNN has no bf16 units it keeps fp32: the row says so, not a ratio
                check_fp32_matmul("bf16", "cpu")
            model, transform, precision = build()
            xin = transform(x)
            model.train()

            def loss_fn(out: Any, *_: Any, _p: str = precision) -> torch.Tensor:
                return out.float().mean()

            wl = Workloads(model, xin, loss_fn=loss_fn, optimizer="sgd")
            ctx = lambda p=precision, mode=("bf16" if name == FP32_BF16 else ""): _modes(p, mode)  # noqa: E731

            def step(wl: Workloads = wl, ctx: Callable = ctx) -> None:
                with ctx():
                    wl.step()

            if not name.startswith("torch.compile"):
                with ctx():
                    act = saved_activation_bytes(model, xin, loss_fn=loss_fn)
                rep = memory_report(model, xin, loss_fn=loss_fn, optimizer="sgd")
            else:
                act, rep = None, None
            t0 = time.perf_counter()
            step()  # first call: compiles under torch.compile
            first = time.perf_counter() - t0
            steps[name] = step
            rows[name] = {"activation_bytes": act, "step_peak_bytes": rep.step_tensor_peak_bytes if rep else None,
                          "first_call_s": first}
            if name in ("plain fp32", "inplace", "memory-efficient BN", "inplace + mem-eff BN", "checkpointing",
                        FP32_BF16):
                with ctx():
                    grads[name] = _grads(model, xin, loss_fn)
        except Exception as exc:  # a trick that cannot run here is reported, not fatal
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}

    # the baselines the time ratios stand on (issue 16): the plain step again (A/A) and on one thread
    threads = torch.get_num_threads()
    steps[AA] = steps["plain fp32"]
    if threads > 1:
        def one_thread(step: Callable[[], Any] = steps["plain fp32"]) -> None:
            torch.set_num_threads(1)
            try:
                step()
            finally:
                torch.set_num_threads(threads)

        steps[ONE_THREAD] = one_thread
    with LoadMonitor() as window:
        timings = compare(steps, warmup=args.warmup, repeats=args.repeats)
    checks = [window.check(f"{model_name} steps"),
              aa_check(timings["plain fp32"].median_s, timings[AA].median_s, what=f"{model_name} plain fp32 step")]
    if threads > 1:
        checks.append(thread_check(timings[ONE_THREAD].median_s, timings["plain fp32"].median_s, threads,
                                   what=f"{model_name} plain fp32 step"))
    plain = rows["plain fp32"]
    base_t = timings["plain fp32"]
    table_rows = []
    for name, r in rows.items():
        if "error" in r:
            table_rows.append([name, "-", "-", "-", "-", r["error"]])
            continue
        t = timings[name]
        r.update(step_median_s=t.median_s, step_iqr_s=t.iqr_s, time_ratio=t.ratio_to(base_t))
        r["activation_ratio"] = r["activation_bytes"] / plain["activation_bytes"] if r["activation_bytes"] is not None else None
        r["peak_ratio"] = r["step_peak_bytes"] / plain["step_peak_bytes"] if r["step_peak_bytes"] is not None else None
        if name in grads and name != "plain fp32":
            r["max_grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(grads[name], grads["plain fp32"]))
        note = ""
        if name.startswith("torch.compile"):
            note = _payback_note(r, plain, t.median_s, base_t.median_s)
        elif name == BATCH_X2:
            r["samples_ratio"] = 2 / r["time_ratio"]
            note = f"{r['samples_ratio']:.2f}x plain's samples a second (T36)"
        elif name == "bf16 autocast":
            note = "saved set includes autocast's bf16 weight copies"
        elif "max_grad_diff" in r:
            note = f"max |grad diff| {r['max_grad_diff']:.1e}" + (" (drift of the bf16 products)" if name == FP32_BF16
                                                                 else "")
        table_rows.append([
            name, f"{t.median_s * 1e3:.0f} ± {t.iqr_s * 5e2:.0f}", f"{r['time_ratio']:.2f}",
            f"{human_bytes(r['activation_bytes'])} ({r['activation_ratio']:.2f})" if r["activation_ratio"] is not None else "-",
            f"{human_bytes(r['step_peak_bytes'])} ({r['peak_ratio']:.2f})" if r["peak_ratio"] is not None else "-",
            note,
        ])
    print(f"{model_name}, batch {args.batch}, {args.size}x{args.size}, CPU ({torch.get_num_threads()} threads), "
          f"median of {args.repeats} interleaved steps (ms ± IQR/2)")
    for name in (AA, ONE_THREAD):
        if name in timings:
            t = timings[name]
            table_rows.append([name, f"{t.median_s * 1e3:.0f} ± {t.iqr_s * 5e2:.0f}", f"{t.ratio_to(base_t):.2f}",
                               "-", "-", "baseline check (issue 16)"])
    print(table(["trick", "step ms", "time ratio", "activations (ratio)", "step peak (ratio)", "note"],
                table_rows, "lrrrrl"))
    rows["_checks"] = checks  # type: ignore[assignment]  # taken out by main before the JSON
    return rows


def _payback_note(r: dict[str, Any], plain: dict[str, Any], step_s: float, plain_step_s: float) -> str:
    """A compiled row's first call, and the steps after which its faster step has paid it back (T35)."""
    extra, saved = r["first_call_s"] - plain["first_call_s"], plain_step_s - step_s
    r["break_even_steps"] = -(-extra // saved) if saved > 0 else None
    pays = f"pays back after {r['break_even_steps']:.0f} steps" if saved > 0 else "never pays back (no faster)"
    return f"first call (compile) {r['first_call_s']:.1f} s: {pays}"


LM_CONFIG = {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 128,  # dropout off: the losses compare
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


LM_COMPILE = {"sdpa + compile": {}, "sdpa + compile max-autotune-no-cudagraphs": {"mode": "max-autotune-no-cudagraphs"}}


def _compiles() -> tuple[bool, str]:
    from torch_tricks.train.speed import compile_available

    return compile_available("cpu")


def run_attention(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """T34: each attention implementation of a transformers GPT-2 that trains here against its own (sdpa), and
    T35: the model's own compiled in the default mode and in max-autotune-no-cudagraphs, timed interleaved with an
    A/A pair; the LM loss of each beside sdpa's (same weights, after the same first step)."""
    from torch_tricks.models import load_model
    from torch_tricks.train.attention import attention_support, set_attention
    from torch_tricks.train.speed import compile_model

    ids = torch.randint(0, 50257, (8, 128), generator=torch.Generator().manual_seed(0))
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], Any]] = {}
    for mode in ("sdpa", "eager", "flex", "flash2", *LM_COMPILE):
        torch.manual_seed(0)
        model, _ = load_model("hf:gpt2", hf_config=LM_CONFIG)
        ok, why = attention_support(model, mode, "cpu") if mode not in LM_COMPILE else _compiles()
        if not ok:
            rows[mode] = {"error": why}
            continue
        set_attention(model.train(), "sdpa" if mode in LM_COMPILE else mode, "cpu")
        if mode in LM_COMPILE:  # T35: the model's own attention, compiled in this mode
            compile_model(model, **LM_COMPILE[mode])
        wl = Workloads(model, ids, loss_fn=lambda out: out.logits.float().mean(), optimizer="sgd")
        t0 = time.perf_counter()
        wl.step()  # the first call (a compiled one compiles)
        rows[mode] = {"first_call_s": time.perf_counter() - t0}
        with torch.no_grad():
            rows[mode]["loss"] = float(model(input_ids=ids, labels=ids).loss)
        steps[mode] = wl.step
    timings, checks, measured = _against_own(steps, rows, "sdpa", "gpt2", args)
    table_rows = []
    for mode, r in rows.items():
        if mode not in measured:
            table_rows.append([f"attention = {mode}", "-", "-", "-", r["error"]])
            continue
        t = timings[mode]
        note = ("the model's own" if mode == "sdpa" else
                _payback_note(r, rows["sdpa"], t.median_s, timings["sdpa"].median_s) if mode in LM_COMPILE else "")
        table_rows.append([mode if mode in LM_COMPILE else f"attention = {mode}",
                           f"{t.median_s * 1e3:.0f} ± {t.iqr_s * 5e2:.0f}", f"{r['time_ratio']:.2f}",
                           f"{r['loss_diff']:.1e}", note])
    t = timings[AA]
    table_rows.append([AA.replace("plain fp32", "sdpa"), f"{t.median_s * 1e3:.0f} ± {t.iqr_s * 5e2:.0f}",
                       f"{t.ratio_to(timings['sdpa']):.2f}", "-", "baseline check (issue 16)"])
    print(f"GPT-2 (4 x 256, vocab 50257, sequence 128, batch 8), CPU ({torch.get_num_threads()} threads), median of "
          f"{args.repeats} interleaved steps (ms ± IQR/2); loss diff: relative to sdpa's, after the same first step, same batch")
    print(table(["attention / compile", "step ms", "time ratio", "loss diff", "note"], table_rows, "lrrrl"))
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'}  {c}")
    return rows


SDPA_DROPOUT = 0.0  # the encoder's own 0.1 rules out the CPU's flash kernel (no dropout there): the kernels compare


def run_sdpa_kernels(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """T34 for a model that calls SDPA itself (the package's transformer encoder): SDPA held to each kernel that
    runs here against its own choice, timed interleaved with an A/A pair; the loss of each beside the default's."""
    from torch_tricks.train.sdpa_backend import SDPA_BACKENDS, hold_sdpa_backend, sdpa_backend_support

    ids = torch.randint(0, 1000, (16, 128), generator=torch.Generator().manual_seed(0))
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Callable[[], Any]] = {}
    for mode in ("default", *SDPA_BACKENDS):
        ok, why = sdpa_backend_support(mode, "cpu", SDPA_DROPOUT) if mode != "default" else (True, "")
        if not ok:
            rows[mode] = {"error": why}
            continue
        torch.manual_seed(0)
        model = get_model("transformer", dropout=SDPA_DROPOUT).train()
        if mode != "default":
            hold_sdpa_backend(model, mode)
        with torch.no_grad():
            rows[mode] = {"loss": float(model(ids).float().logsumexp(-1).mean())}
        steps[mode] = Workloads(model, ids, loss_fn=lambda out: out.float().mean(), optimizer="sgd").step
    timings, checks, measured = _against_own(steps, rows, "default", "transformer", args)
    table_rows = []
    for mode, r in rows.items():
        if mode not in measured:
            table_rows.append([f"attention = {mode}", "-", "-", "-", r["error"]])
            continue
        t = timings[mode]
        table_rows.append([f"attention = {mode}" if mode != "default" else "SDPA's own choice",
                           f"{t.median_s * 1e3:.0f} ± {t.iqr_s * 5e2:.0f}", f"{r['time_ratio']:.2f}",
                           f"{r['loss_diff']:.1e}", ""])
    t = timings[AA]
    table_rows.append(["SDPA's own choice (A/A)", f"{t.median_s * 1e3:.0f} ± {t.iqr_s * 5e2:.0f}",
                       f"{t.ratio_to(timings['default']):.2f}", "-", "baseline check (issue 16)"])
    print(f"transformer (4-layer encoder, d_model 128, dropout {SDPA_DROPOUT:g}, sequence 128, batch 16), CPU ({torch.get_num_threads()} "
          f"threads), median of {args.repeats} interleaved steps (ms ± IQR/2); loss diff: relative to SDPA's own")
    print(table(["SDPA kernel", "step ms", "time ratio", "loss diff", "note"], table_rows, "lrrrl"))
    for c in checks:
        print(f"  {'ok  ' if c.ok else 'FAIL'}  {c}")
    return rows


def _against_own(steps: dict[str, Callable[[], Any]], rows: dict[str, dict[str, Any]], own: str, what: str,
                 args: argparse.Namespace) -> tuple[dict[str, Any], list[Any], set[str]]:
    """The variants' steps timed interleaved with an A/A pair of ``own`` (the model's own setting), under the load
    monitor; each measured row gets its step time, time ratio and loss difference to ``own``'s. Returns the
    timings, the trust checks, and the rows measured."""
    steps[AA] = steps[own]
    with LoadMonitor() as window:
        timings = compare(steps, warmup=args.warmup, repeats=args.repeats)
    checks = [window.check(f"{what} steps"), aa_check(timings[own].median_s, timings[AA].median_s,
                                                       what=f"{what} {own} step")]
    measured = {mode for mode, r in rows.items() if "error" not in r}
    for mode in measured:
        r, t = rows[mode], timings[mode]
        r.update(step_median_s=t.median_s, time_ratio=t.ratio_to(timings[own]),
                 loss_diff=abs(r["loss"] - rows[own]["loss"]) / abs(rows[own]["loss"]))
    return timings, checks, measured


@contextlib.contextmanager
def _modes(precision: str, fp32_matmul: str) -> Iterator[None]:
    """``precision``'s autocast and the fp32 matmul mode (T33; "" the process's own) around a step."""
    from torch_tricks.train.matmul_mode import fp32_matmul as matmul_mode
    from torch_tricks.train.precision import autocast

    with autocast(precision, torch.device("cpu")), matmul_mode(fp32_matmul, "cpu"):
        yield


def _grads(model: nn.Module, x: torch.Tensor, loss_fn: Callable) -> list[torch.Tensor]:
    """Gradients of one fp32 step from the same weights (copied, so the timed model is untouched)."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    loss_fn(m(x)).backward()
    return [p.grad.detach().clone() for p in m.parameters() if p.grad is not None]


def _plot(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (model_name, rows) in zip(axes[0], results.items()):
        names = [n for n, r in rows.items() if "time_ratio" in r]
        pos = range(len(names))
        ax.bar([p - 0.2 for p in pos], [rows[n]["time_ratio"] for n in names], width=0.4, label="step time")
        ax.bar([p + 0.2 for p in pos], [rows[n]["activation_ratio"] or 0 for n in names], width=0.4,
               label="activation memory")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(pos), names, rotation=25, ha="right")
        ax.set_ylabel("ratio to plain fp32 (lower is better)")
        ax.set_title(f"{model_name}, batch {args.batch}, {args.size}px, CPU")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
