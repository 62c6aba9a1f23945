"""What the memory tricks save on a training step, each configuration in a fresh process (issue 21).

Claim: on a GPT-2-class causal LM (transformers, vocabulary 50,257, 4 layers x 256, sequence
512, batch 4, AdamW) the memory tricks together bring the step's peak to at most 0.40x the
plain fp32 step's, at the same first loss and within the tune's drift tolerance (5%) over the
steps. ResNet-50 (3x128x128, batch 16) shows what the same tricks do to a convolutional net.

Each configuration (``TrainConfig`` keys, applied through ``Tricks``: the switches ``fit``,
the tune and your own loop get) runs in a fresh Python process: the model and batch are built
from the seed, ``tricks.prepare`` applies the switches, and the resident memory is read
(``/proc/self/status``); the kernel's high-water mark is then reset (``/proc/self/clear_refs``,
Linux >= 4.0) and ``--steps`` training steps run. **Step peak** = the high-water mark during
the steps over the memory after building: activations, logits, gradients and the optimizer
state (allocated at the first step). On CUDA (``--device cuda``) it is
``torch.cuda.max_memory_allocated`` over the allocated memory after building. **Step time**
is the median of the steps after the first. The first loss of each configuration must equal
plain's (the same weights and batch; bf16 within the drift tolerance) and the mean loss over
the steps must stay within the drift tolerance of plain's.

The rows: plain fp32; each memory trick alone; combinations of them (on CUDA also activation
offload, T31); and the tune's memory-optimal configuration: a tune of the model (``--tune-budget``
seconds, a fresh process) names the configuration that fits the most samples (``best_batch``: the
memory tricks it measured together), which then runs as a row like the others. The LM's target is
checked on that row (on the lowest measured peak of the combinations with ``--tune-budget 0``). The script prints one line per configuration (peak and time as ratios
to plain), PASS or FAIL for the LM's target, and writes ``benchmarks/memory.png``. The verdict
is on memory and losses, which other processes on the machine do not change, so the load
checks of ``benchmarks/_trust.py`` (they guard time ratios) do not gate it; the step times
are printed beside it, from configurations run one after another, as steady as the machine.

    python benchmarks/memory.py                      # both models, 20 steps each configuration
    python benchmarks/memory.py --models lm --steps 10 --tune-budget 60
    python benchmarks/memory.py --models lm --device cuda --rows offload --tune-budget 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGET = 0.40  # the LM's memory-optimal configuration against plain fp32
DRIFT = 0.05  # the tune's drift tolerance (torch_tricks.tuning.tuner.DRIFT_TOLERANCE["loss"])

CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "lm": {
        "plain fp32": {},
        "checkpointing": {"checkpointing": "blocks"},
        "bf16 autocast": {"precision": "bf16"},
        "chunked LM-head loss": {"chunked_lm_loss": True},
        "8-bit AdamW state": {"optimizer_state": "8bit"},
        "4-bit AdamW state": {"optimizer_state": "4bit"},
        "bf16 AdamW state": {"optimizer_state": "bf16"},
        "optimizer step in backward": {"optimizer_in_backward": True},
        "ckpt + bf16 + chunked": {"checkpointing": "blocks", "precision": "bf16", "chunked_lm_loss": True},
        "ckpt + bf16 + chunked + in-backward": {"checkpointing": "blocks", "precision": "bf16", "chunked_lm_loss": True,
                                                "optimizer_in_backward": True},
        "ckpt + bf16 + chunked + 8-bit": {"checkpointing": "blocks", "precision": "bf16", "chunked_lm_loss": True,
                                          "optimizer_state": "8bit"},
    },
    "resnet50": {
        "plain fp32": {},
        "checkpointing": {"checkpointing": "blocks"},
        "bf16 autocast": {"precision": "bf16"},
        "in-place activations": {"inplace": True},
        "memory-efficient BN": {"memory_efficient_bn": True},
        "8-bit AdamW state": {"optimizer_state": "8bit"},
        "bf16 AdamW state": {"optimizer_state": "bf16"},
        "optimizer step in backward": {"optimizer_in_backward": True},
        "ckpt + bf16 + inplace": {"checkpointing": "blocks", "precision": "bf16", "inplace": True},
        "ckpt + bf16 + inplace + 8-bit": {"checkpointing": "blocks", "precision": "bf16", "inplace": True,
                                          "optimizer_state": "8bit"},
    },
}
# Activation offload (T31) moves saved activations to pinned host memory: a CUDA trick, refused on a CPU.
CUDA_ONLY: dict[str, dict[str, dict[str, Any]]] = {
    "lm": {"activation offload": {"offload_activations": True},
           "bf16 + chunked + offload": {"precision": "bf16", "chunked_lm_loss": True, "offload_activations": True}},
    "resnet50": {"activation offload": {"offload_activations": True}},
}
TITLES = {"lm": "GPT-2-class LM (vocab 50257, 4 x 256, seq 512, batch 4, AdamW)",
          "resnet50": "ResNet-50 (3x128x128, batch 16, AdamW)"}


def build(name: str) -> tuple[Any, Any]:
    """(model, batch) from the seed: the LM takes its ids as labels; ResNet-50 (images, classes)."""
    import torch

    from torch_tricks.models import get_model, load_model

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "lm":
        model = load_model("hf:gpt2", hf_config={"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 512})[0]
        ids = torch.randint(0, 50257, (4, 512), generator=g)
        return model, {"input_ids": ids, "labels": ids}
    model = get_model("resnet50", num_classes=1000)
    return model, (torch.randn(16, 3, 128, 128, generator=g), torch.randint(0, 1000, (16,), generator=g))


def child(name: str, config: dict[str, Any], steps: int, device: str, *, warm: bool = True) -> dict[str, Any]:
    """One configuration in this (fresh) process: memory after building, step peak, step times, losses."""
    import torch
    import torch.nn.functional as F

    from torch_tricks.train import Tricks

    if warm and config.get("optimizer_state"):
        _warm_up(name, config, device)
    model, batch = build(name)
    tricks = Tricks({"device": device, "progress": False, "seed": 0, "nan_guard": False, **config})
    model, _ = tricks.prepare(model)
    batch = tricks.to_device(batch)
    cuda = tricks.device.type == "cuda"
    base = _rss() if not cuda else torch.cuda.memory_allocated(tricks.device)
    _reset_peak(cuda, tricks.device)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with tricks.autocast():
            loss = model(**batch).loss if isinstance(batch, dict) else F.cross_entropy(model(batch[0]), batch[1])
        tricks.backward(loss)
        tricks.step()
        losses.append(float(loss))
        if cuda:
            torch.cuda.synchronize(tricks.device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(tricks.device) if cuda else _hwm()) - base
    return {"base_bytes": base, "peak_bytes": peak, "step_s": statistics.median(times[1:] or times),
            "losses": losses, "applied": tricks.applied}


def tune_choice(name: str, budget_s: float, device: str) -> dict[str, Any]:
    """The tune's memory-optimal configuration for the model (in this fresh process): the configuration it
    names for the largest batch (``best_batch``: the memory tricks that, measured together, fit the most
    samples), as ``TrainConfig`` keys, with its name."""
    from torch_tricks import tune

    model, batch = build(name)
    report = tune(lambda: model, batch, device=device, budget_s=budget_s, progress=False,
                  skip=["compile", "deterministic", "ema"])  # no memory in them: the budget goes to the rest
    best = report.best_batch
    return {"name": best.name if best is not None else "plain", "changes": dict(best.changes) if best else {},
            "notes": report.notes + report.choice_notes if hasattr(report, "choice_notes") else report.notes,
            "phase_s": report.phase_s}


def _warm_up(name: str, config: dict[str, Any], device: str) -> None:
    """One step on a throwaway copy, so that torchao's step is compiled (once per parameter shape, seconds to
    tens of seconds on a CPU) before anything is measured; what it leaves is freed and handed back."""
    import ctypes
    import gc

    child(name, config, 1, device, warm=False)
    gc.collect()
    if torch_device(device).type == "cpu":
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: give the freed pages back, so they are not counted


def torch_device(device: str) -> Any:
    import torch

    return torch.device("cuda" if device == "auto" and torch.cuda.is_available() else device.replace("auto", "cpu"))


def run(name: str, label: str, config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """:func:`child` in a fresh Python process."""
    argv = [sys.executable, __file__, "--child", name, json.dumps(config), "--steps", str(args.steps),
            "--device", args.device]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        return {"label": label, "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    return {"label": label, **json.loads(r.stdout.strip().splitlines()[-1])}


TUNED = "tune's choice: "


def run_tune(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """:func:`tune_choice` in a fresh Python process (None, with the reason on stderr, if it failed)."""
    argv = [sys.executable, __file__, "--tune-child", name, "--tune-budget", str(args.tune_budget),
            "--device", args.device]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        print(f"the tune of {name} failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def judge(rows: list[dict[str, Any]]) -> None:
    """Each row's ratios to plain, and whether it trains the same (first loss, mean loss within DRIFT)."""
    plain = rows[0]
    for r in rows:
        if "error" in r or "error" in plain:
            continue
        r["peak_ratio"] = r["peak_bytes"] / plain["peak_bytes"]
        r["time_ratio"] = r["step_s"] / plain["step_s"]
        first = abs(r["losses"][0] - plain["losses"][0]) / abs(plain["losses"][0])
        mean = abs(statistics.mean(r["losses"]) - statistics.mean(plain["losses"])) / abs(statistics.mean(plain["losses"]))
        r["first_loss_diff"], r["mean_loss_drift"] = first, mean
        r["same_training"] = first <= DRIFT and mean <= DRIFT


def report(name: str, rows: list[dict[str, Any]]) -> bool | None:
    """Print the model's table; the target's verdict for the LM (None for the others)."""
    print(f"\n{TITLES[name]}")
    print(f"  {'configuration':<36} {'step peak':>12} {'x plain':>8} {'step time':>10} {'x plain':>8}  "
          f"{'first loss':>10} {'drift':>7}")
    for r in rows:
        if "error" in r:
            print(f"  {r['label']:<36} failed: {r['error']}")
            continue
        print(f"  {r['label']:<36} {r['peak_bytes'] / 2**20:9.0f} MiB {r.get('peak_ratio', 0):7.2f}x "
              f"{r['step_s']:9.3f}s {r.get('time_ratio', 0):7.2f}x  {r['losses'][0]:10.4f} "
              f"{r.get('mean_loss_drift', 0):6.1%}")
    if name != "lm":
        return None
    tuned = [r for r in rows if r["label"].startswith(TUNED) and "peak_ratio" in r]
    if tuned:
        best, which = tuned[0], "the tune's memory-optimal configuration"
    else:  # no tune run (--tune-budget 0): the lowest measured peak of the combinations
        if not any(" + " in r["label"] for r in rows):
            print("  target: not judged: no combination among these rows (--rows)")
            return None
        combos = [r for r in rows if " + " in r["label"] and r.get("same_training")]
        if not combos:
            print("  target: no combination ran and trained the same: FAIL")
            return False
        best, which = min(combos, key=lambda r: r["peak_ratio"]), "the lowest measured peak of the combinations"
    ok = best["peak_ratio"] <= TARGET and best.get("same_training")
    print(f"  target: {which} ('{best['label']}') at most {TARGET:.2f}x plain's step peak, training the same: "
          f"{best['peak_ratio']:.2f}x, {'same training' if best.get('same_training') else 'trains differently'}: "
          f"{'PASS' if ok else 'FAIL'}")
    return bool(ok)


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], results.items()):
        ok = [r for r in rows if "peak_ratio" in r]
        ax.barh([r["label"] for r in ok], [r["peak_ratio"] for r in ok], color="tab:blue")
        for i, r in enumerate(ok):
            ax.text(r["peak_ratio"], i, f" {r['peak_ratio']:.2f}x mem, {r['time_ratio']:.2f}x time", va="center")
        if name == "lm":
            ax.axvline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET:.2f}x")
            ax.legend(loc="center right")
        ax.invert_yaxis()
        ax.set_xlim(0, 2.1)
        ax.set_xlabel("step peak memory / plain fp32")
        ax.set_title(TITLES[name], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tune-budget", type=float, default=240.0,
                   help="seconds of the tune that names each model's memory-optimal configuration (0: no tune)")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG_JSON"), help=argparse.SUPPRESS)
    p.add_argument("--tune-child", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--rows", nargs="+", metavar="LABEL",
                   help="only the configurations whose label contains one of these (plain fp32 always runs)")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]), args.steps, args.device)))
        return 0
    if args.tune_child:
        print(json.dumps(tune_choice(args.tune_child, args.tune_budget, args.device)))
        return 0
    from tqdm import tqdm

    on_cuda = torch_device(args.device).type == "cuda"
    jobs = [(name, label, cfg) for name in args.models
            for label, cfg in {**CONFIGS[name], **(CUDA_ONLY[name] if on_cuda else {})}.items()
            if not args.rows or label == "plain fp32" or any(r in label for r in args.rows)]
    if args.tune_budget > 0:
        for name in tqdm(args.models, desc="the tune's memory-optimal configuration", file=sys.stderr):
            choice = run_tune(name, args)
            if choice is not None:
                jobs.append((name, f"{TUNED}{choice['name']}", choice["changes"]))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.models}
    for name, label, cfg in tqdm(jobs, desc="configurations (a fresh process each)", file=sys.stderr):
        results[name].append(run(name, label, cfg, args))
        if args.json:  # each row as it comes: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=1))
    verdicts = []
    for name, rows in results.items():
        judge(rows)
        verdicts.append(report(name, rows))
    png = plot(results, Path(__file__).with_suffix(".png"))
    if png:
        print(f"\nplot: {png}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


# -- memory of this process -------------------------------------------------------------------

def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _rss() -> int:
    return _status("VmRSS")


def _hwm() -> int:
    return _status("VmHWM")


def _reset_peak(cuda: bool, device: Any) -> None:
    """Start the high-water mark from now: the kernel's (``clear_refs`` 5), or CUDA's peak counter."""
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    Path("/proc/self/clear_refs").write_text("5")


if __name__ == "__main__":
    sys.exit(main())
