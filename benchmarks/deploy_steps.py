"""Side-by-side speed of the structural deploy steps on ResNet-18 (CPU, eval mode).

Candidates, timed interleaved by :func:`torch_tricks.deploy.report.report` against the
eager model: Conv+BN fused, channel-pruned to half the MACs (unfused and fused), and
the ONNX export run in ONNX Runtime (fp32, and ORT's static int8 when ``--int8``).
Prints one JSON object. Usage::

    .venv/bin/python benchmarks/deploy_steps.py [--size 224] [--batches 1 16] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from torch_tricks.deploy.export import OrtModule, export_onnx_checked, onnx_size_bytes, ort_quantize_static
from torch_tricks.deploy.fuse import fuse
from torch_tricks.deploy.prune import prune_channels_with_report
from torch_tricks.deploy.report import report
from torch_tricks.models import get_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--int8", action="store_true", help="also ORT static int8 (QDQ, per channel)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = get_model(args.model).eval()
    with torch.no_grad():  # realistic BN statistics: a few forward passes in train mode
        model.train()
        for _ in range(3):
            model(torch.randn(8, 3, args.size, args.size))
        model.eval()
    inputs = {b: torch.randn(b, 3, args.size, args.size) for b in args.batches}
    x1 = torch.randn(1, 3, args.size, args.size)

    fused = fuse(model)
    pruned, prep = prune_channels_with_report(model, x1, target_macs=0.5)
    pruned.eval()
    candidates = {"fused": fused, "pruned": pruned, "pruned+fused": fuse(pruned)}
    sizes = {}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.onnx"
        exp = export_onnx_checked(model, inputs[max(inputs)], path)
        candidates["ort_fp32"] = OrtModule(path)
        sizes["ort_fp32"] = onnx_size_bytes(path)
        if args.int8:
            q = ort_quantize_static(path, Path(d) / "int8.onnx",
                                    [torch.randn(8, 3, args.size, args.size) for _ in range(4)])
            candidates["ort_int8"] = OrtModule(q)
            sizes["ort_int8"] = onnx_size_bytes(q)
        reps = report(model, candidates, inputs, warmup=args.warmup, repeats=args.repeats, sizes=sizes)

    out = {
        "model": args.model,
        "input": f"3x{args.size}x{args.size}",
        "threads": torch.get_num_threads(),
        "pruned_mac_ratio": round(prep.mac_ratio, 3),
        "pruned_amount": round(prep.amount, 3),
        "onnx_max_abs_diff": exp.max_abs_diff,
        "steps": {
            name: {
                "speedup": {b: round(s, 3) for b, s in r.speedup.items()},
                "latency_ms": {b: round(t * 1e3, 2) for b, t in r.latency_s.items()},
                "iqr_ms": {b: round(t * 1e3, 2) for b, t in r.latency_iqr_s.items()},
                "params": r.params,
                "size_bytes": r.size_bytes,
                "max_abs_diff": r.agreement.max_abs_diff if r.agreement else 0.0,
                "top1_agreement": r.agreement.top1_agreement if r.agreement else 1.0,
            }
            for name, r in reps.items()
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
