"""How far the plain and the tuned training step are from this machine's limit: MFU, side by side (issue 22).

Claim: nanoGPT-style MFU against a fixed A100 figure says nothing on another machine; measured against
the peak matmul rate of *this* machine (per dtype, ``torch-tricks peak``, measured once and cached),
the plain step and the tune's recommendation of a GPT-2-style model (transformers GPT-2, 4 layers x
256, vocabulary 50,257, sequence 128, batch 8) and of ResNet-18 (3x64x64, batch 32) show how much a
trick can still give. The script measures (or reads from the cache) the peaks, tunes each model in
this process (``--budget`` seconds each; compile left out unless ``--with-compile``), and prints one
line per model: model FLOPs per step (the package's counter), the plain step's time and MFU against
the fp32 peak, the recommendation's time and MFU against the peak of the dtype it computes in. All
figures come from this one run; ``benchmarks/mfu.png`` shows them.

    python benchmarks/mfu.py                      # both models, 90 s of tune each
    python benchmarks/mfu.py --device cuda --budget 60
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def build(name: str) -> tuple[Any, Any]:
    import torch

    from torch_tricks.models import get_model, load_model

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "gpt2":
        model = load_model("hf:gpt2", hf_config={"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 128})[0]
        ids = torch.randint(0, 50257, (8, 128), generator=g)
        return model, {"input_ids": ids, "labels": ids}
    model = get_model("resnet18", num_classes=1000)
    return model, (torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 1000, (32,), generator=g))


TITLES = {"gpt2": "GPT-2-style (4 x 256, vocab 50257, seq 128, batch 8)", "resnet18": "ResNet-18 (3x64x64, batch 32)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(TITLES), default=list(TITLES))
    p.add_argument("--device", default="auto")
    p.add_argument("--budget", type=float, default=90.0, help="seconds of tune per model")
    p.add_argument("--with-compile", action="store_true", help="let the tune measure torch.compile too")
    p.add_argument("--refresh", action="store_true", help="measure the peaks again (not from the cache)")
    args = p.parse_args(argv)

    from torch_tricks import tune
    from torch_tricks.inspect.peak import device_peak

    peak = device_peak(args.device, refresh=args.refresh)
    print(peak.to_text())
    rows = []
    for name in args.models:
        model, batch = build(name)
        print(f"\ntuning {TITLES[name]} ({args.budget:.0f} s) ...", file=sys.stderr)
        report = tune(lambda: model, batch, device=args.device, budget_s=args.budget, progress=False,
                      skip=[] if args.with_compile else ["compile"])
        eff = report.efficiency or {}
        if eff.get("status") != "measured":
            print(f"{TITLES[name]}: MFU not measured: {eff.get('reason', 'no efficiency in the report')}")
            continue
        rows.append((name, eff))
    print(f"\n{'model':<52} {'GFLOP/step':>10}  {'plain':>9} {'MFU':>5}  {'recommended':<36} {'step':>9} {'MFU':>5}")
    for name, eff in rows:
        plain, rec = eff["rows"]["plain"], eff["rows"]["recommended"]
        print(f"{TITLES[name]:<52} {eff['flops_per_step'] / 1e9:10.2f}  {plain['step_s'] * 1e3:7.1f}ms "
              f"{_pct(plain['mfu'])}  {rec['name'][:28] + ' (' + rec['dtype'] + ')':<36} {rec['step_s'] * 1e3:7.1f}ms "
              f"{_pct(rec['mfu'])}")
    for reason in {eff["withheld"] for _, eff in rows if eff.get("withheld")}:
        print(f"MFU withheld: {reason}")
    png = _plot(rows, Path(__file__).with_suffix(".png"), peak.device)
    if png:
        print(f"\nplot: {png}")
    return 0


def _pct(mfu: float | None) -> str:
    """An MFU as a percentage, or "  -  " where the report withheld it (a step beat the cached peak)."""
    return f"{mfu:5.0%}" if mfu is not None else "  -  "


def _plot(rows: list[tuple[str, dict[str, Any]]], path: Path, device: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [(e["rows"]["plain"]["mfu"] or 0) * 100 for _, e in rows], 0.4, label="plain fp32")
    ax.bar([x + 0.2 for x in xs], [(e["rows"]["recommended"]["mfu"] or 0) * 100 for _, e in rows], 0.4,
           label="tune's recommendation")
    ax.set_xticks(list(xs), [TITLES[n].split(" (")[0] for n, _ in rows])
    ax.set_ylabel("MFU, % of this machine's peak")
    ax.set_title(f"MFU against the measured matmul peak: {device}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
