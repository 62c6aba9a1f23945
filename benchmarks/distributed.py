"""Per-rank training state and 2-rank scaling of ddp, zero1 and fsdp (issue 14).

Claim: sharding splits what each rank must hold. On 2 ranks (gloo, CPU: ``torchrun
--standalone --nproc_per_node 2``, one thread per rank), for ResNet-50 (64x64 images,
batch 8 per rank) and a small GPT-2 (4 layers, 256 wide, 128 tokens, batch 4 per rank),
both with AdamW, the benchmark trains a few steps through ``Tricks`` under each
``distributed`` mode and measures on every rank, side by side in one run:

* **per-rank state bytes**: parameters, gradients (right after backward, before the step
  frees them) and optimizer state (after a step), each counted as the tensors this rank
  holds (a DTensor's local shard under ``fsdp``; ZeRO's local optimizer's state under
  ``zero1``); the largest rank is reported. Target: ``fsdp`` at most 0.55x ``ddp``
  (parameters, gradients and AdamW's two moments all halved, plus padding).
* **scaling efficiency**: the same steps in one process (``distributed = off``, the
  per-rank batch) against 2 ranks (twice the samples per step): efficiency = one-process
  step time / 2-rank step time (1.0: twice the throughput). Median over the timed steps,
  each timed between barriers, the slowest rank's. On 2 shared cores with one thread per
  rank the two processes compete for memory bandwidth; the ratio says what this machine
  gives, not what a cluster would.

The PASS/FAIL lines are about bytes, which no load on the machine changes; the scaling
efficiencies are timings, so each run is watched for foreign load (issue 16,
``benchmarks/_trust.py``: other processes using more than a quarter of a core on average,
from ``/proc/stat`` less this process tree's CPU time, ranks included), and an efficiency
measured under it is marked UNRELIABLE with the load named.

    python benchmarks/distributed.py                       # both models, 6 timed steps each
    python benchmarks/distributed.py --models gpt2 --steps 10 --json dist.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/_trust.py, when imported from elsewhere
from _trust import UNRELIABLE, LoadMonitor, why  # noqa: E402
MODES = ("ddp", "zero1", "fsdp")
TARGET = 0.55  # fsdp per-rank state bytes / ddp's
# name -> (load_model reference, hf_config, input spec, per-rank batch)
MODELS = {
    "resnet50": ("resnet50", None, "3x64x64", 8),
    "gpt2": ("hf:gpt2", "n_layer=4,n_embd=256,n_head=4", "long:128:50257", 4),
}


# -- one worker: a few steps under one mode -------------------------------------------------------

def worker(name: str, mode: str, steps: int, warmup: int) -> dict[str, Any]:
    """Train ``steps`` + ``warmup`` steps of ``name`` under ``mode`` (``off``: one process); rank 0's result."""
    import torch
    import torch.distributed as dist

    from torch_tricks import Tricks
    from torch_tricks.batches import example_batch
    from torch_tricks.inspect.inputs import make_inputs
    from torch_tricks.models import load_model
    from torch_tricks.tuning.distributed import local_bytes, optimizer_state_bytes

    torch.set_num_threads(1)
    ref, hf_config, spec, batch = MODELS[name]
    torch.manual_seed(0)
    model, _ = load_model(ref, hf_config=hf_config)
    inputs = make_inputs(spec, batch, model=model, seed=0)
    example, loss_fn = example_batch(model, inputs, seed=0)
    tricks = Tricks({"distributed": mode, "device": "cpu", "optimizer": "adamw", "lr": 1e-4})
    model, optimizer = tricks.prepare(model)
    model.train()
    xs, target = tricks.to_device(example)
    distributed = dist.is_available() and dist.is_initialized()
    times: list[float] = []
    state: dict[str, int] = {}
    for i in range(warmup + steps):
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        with tricks.autocast():
            loss = loss_fn(model(*xs), target)
        tricks.backward(loss)
        if i == 0:
            state["grads"] = sum(local_bytes(p.grad) for p in tricks.unwrapped_model.parameters()
                                 if p.grad is not None)
        tricks.step()
        if distributed:
            dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    state["params"] = sum(local_bytes(p) for p in tricks.unwrapped_model.parameters())
    state["optimizer"] = optimizer_state_bytes(optimizer)
    state["total"] = state["params"] + state["grads"] + state["optimizer"]
    result = {"state": state, "step_s": sorted(times)[len(times) // 2], "applied": list(tricks.applied),
              "loss": float(loss.detach())}
    if not distributed:
        return {**result, "ranks": 1, "per_rank": [state]}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    largest = max(everyone, key=lambda r: r["state"]["total"])
    return {**largest, "step_s": max(r["step_s"] for r in everyone), "ranks": len(everyone),
            "per_rank": [r["state"] for r in everyone]}


# -- the driver ------------------------------------------------------------------------------------

def run_worker(name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One process (``off``) or ``torchrun --standalone --nproc_per_node 2``; the worker's JSON."""
    argv = [str(Path(__file__).resolve()), "--worker", name, mode, "--steps", str(args.steps),
            "--warmup", str(args.warmup)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    if mode == "off":
        cmd = [sys.executable, *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *argv]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{name} under {mode} exited with {r.returncode}:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,gpt2", help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--png", default=str(HERE / "distributed.png"), help="bar plot path ('' for none)")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        import warnings

        warnings.filterwarnings("ignore")
        out = worker(*args.worker, args.steps, args.warmup)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(out), flush=True)
        from torch_tricks.train.distributed import cleanup

        cleanup()  # collects FSDP's reference cycles before the group goes (else an abort at exit, now and then)
        return 0
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        ap.error(f"unknown model(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(MODELS)}")
    from tqdm import tqdm

    from torch_tricks._format import table

    results: dict[str, dict[str, Any]] = {}
    checks: dict[tuple[str, str], Any] = {}
    with tqdm(total=len(names) * (len(MODES) + 1), desc="runs", file=sys.stderr) as bar:
        for name in names:
            results[name] = {}
            for mode in ("off", *MODES):
                bar.set_description(f"{name}: {'one process' if mode == 'off' else mode + ' on 2 ranks'}")
                with LoadMonitor() as window:  # the ranks are this process's children: their CPU is ours
                    results[name][mode] = run_worker(name, mode, args)
                checks[name, mode] = window.check(f"{name} {mode}")
                bar.update(1)

    print(f"per-rank training state and 2-rank scaling; CPU, gloo, 1 thread per rank, AdamW, "
          f"median of {args.steps} steps after {args.warmup}\n")
    rows, verdicts = [], []
    for name in names:
        r = results[name]
        ddp_total = r["ddp"]["state"]["total"]
        for mode in ("off", *MODES):
            s = r[mode]["state"]
            eff = r["off"]["step_s"] / r[mode]["step_s"] if mode != "off" else None
            trust = [checks[name, "off"], checks[name, mode]]
            r[mode]["unreliable_because"] = why(trust)  # the efficiency has no target: reliable or not
            r[mode]["scaling_status"] = UNRELIABLE if r[mode]["unreliable_because"] else "ok"
            mark = f" {UNRELIABLE}" if r[mode]["scaling_status"] == UNRELIABLE else ""
            rows.append([name, "one process" if mode == "off" else mode, _mib(s["params"]), _mib(s["grads"]),
                         _mib(s["optimizer"]), _mib(s["total"]),
                         f"{s['total'] / ddp_total:.2f}x" if mode != "off" else "",
                         f"{r[mode]['step_s'] * 1e3:.0f}", f"{eff:.2f}{mark}" if eff is not None else mark.strip()])
        ratio = r["fsdp"]["state"]["total"] / ddp_total
        verdicts.append((name, ratio))
    print(table(["model", "mode", "params MiB", "grads MiB", "optimizer MiB", "state MiB", "vs ddp", "step ms",
                 "scaling eff."], rows, "llrrrrrrr"))
    print("\nstate: the largest rank's parameters + gradients + optimizer state (its local shards); scaling "
          "efficiency: one-process step time / 2-rank step time at the same per-rank batch (1.00 = twice the "
          "throughput)")
    loaded = [c for c in checks.values() if not c.ok]
    if loaded:
        print(f"{UNRELIABLE} scaling efficiencies (foreign load during the run; the state bytes are not "
              f"affected):\n" + "\n".join(f"  {c}" for c in loaded))
    for name, ratio in verdicts:  # bytes: no timing, so no baseline check applies
        print(f"{'PASS' if ratio <= TARGET else 'FAIL'}: {name}: fsdp per-rank state {ratio:.2f}x ddp's "
              f"(target <= {TARGET})")
    if args.json:
        from torch_tricks._io import atomic_path

        with atomic_path(args.json) as tmp:
            tmp.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    if args.png:
        png = plot(results, names, Path(args.png))
        if png:
            print(f"\nplot: {png}")
    return 0


def plot(results: dict[str, Any], names: list[str], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: pip install matplotlib)", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    parts = (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green"))
    for ax, name in zip(axes[0], names):
        modes = ["off", *MODES]
        bottom = [0.0] * len(modes)
        for key, color in parts:
            vals = [results[name][m]["state"][key] / 2**20 for m in modes]
            ax.bar(range(len(modes)), vals, bottom=bottom, color=color, label=key)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, m in enumerate(modes):
            if m != "off":
                eff = results[name]["off"]["step_s"] / results[name][m]["step_s"]
                ax.text(i, bottom[i], f"eff {eff:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(modes)), ["1 process", *MODES])
        ax.set_title(f"{name}: per-rank state (MiB), 2 ranks", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
