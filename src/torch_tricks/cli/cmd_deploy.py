"""``optimize``: deploy steps (fuse, reparam, prune, int8, onnx ...) chained, checked against the
original, timed, and the final model saved."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

from torch_tricks.cli.common import add_model_options, emit, load
from torch_tricks.errors import UserError


def add_commands(sub: Any) -> None:
    sp = sub.add_parser("optimize", help="deploy steps (fuse, reparam, prune, int8, onnx ...) chained, checked, saved")
    add_model_options(sp, batch=16)
    sp.add_argument("--steps", action="append", metavar="A,B",
                    help="comma-separated steps in order, e.g. fuse,int8 (repeatable; see --list-steps)")
    sp.add_argument("--list-steps", action="store_true", help="list the steps and exit")
    sp.add_argument("--weights", metavar="FILE",
                    help="checkpoint or state_dict to load first (e.g. from `torch-tricks train --checkpoint-dir`)")
    sp.add_argument("--data", metavar="NAME",
                    help="built-in data set (digits): calibrate int8 on its training split and compare outputs on "
                         "its validation split, instead of random inputs")
    sp.add_argument("--calib-batches", type=int, default=8, help="calibration batches from --data (default 8)")
    sp.add_argument("--out", metavar="PATH",
                    help="where to write the final model (default <model>-<steps>.pt2/.pt/.onnx here)")
    sp.add_argument("--no-save", dest="save", action="store_false", help="report only, write nothing")
    sp.add_argument("--force", action="store_true", help="write the model even if a step exceeded its tolerance")
    sp.add_argument("--latency-batch", type=int, action="append", metavar="N",
                    help="batch size to time (repeatable; default 1 and 16)")
    sp.add_argument("--no-latency", dest="latency", action="store_false", help="skip the timings")
    sp.add_argument("--warmup", type=int, default=3)
    sp.add_argument("--repeats", type=int, default=10)
    sp.add_argument("--threads", type=int, metavar="N",
                    help="intra-op threads for every model, ONNX Runtime too (default: torch's)")
    sp.add_argument("--int8-for", default="auto", metavar="auto|vnni|no-vnni",
                    help="int8 setting of the int8 / onnx-int8 step: auto (default) picks the saturation-free one "
                         "(7-bit activations for PT2E, u8 weights for ONNX Runtime) where this CPU's int8 kernels "
                         "have no VNNI; vnni / no-vnni force the setting for CPUs with / without VNNI (e.g. to "
                         "build for another machine)")
    sp.set_defaults(func=cmd_optimize)


def cmd_optimize(args: argparse.Namespace) -> int:
    """Exit 0 when every step held its tolerance, 1 when one did not (nothing written without --force)."""
    from torch_tricks.deploy.pipeline import list_steps, optimize

    if args.list_steps:
        _emit_steps(args, list_steps())
        return 0
    steps = _steps_asked(args, list_steps())
    out = _checked_out(args, steps)
    _set_threads(args.threads)
    model, inputs = load(args)
    if isinstance(inputs, dict):  # NAME=SPEC: the deploy steps trace, export and time model(*inputs)
        from torch_tricks.inspect.inputs import keyword_as_positional

        inputs = keyword_as_positional(model, inputs, "optimize")
    calib = check = None
    if args.data:
        inputs, check, calib = _data_batches(args, inputs[0].device)
    if args.weights:
        from torch_tricks.train.checkpoint import load_checkpoint

        load_checkpoint(args.weights, model=model, strict=True, restore_rng=False)
    res = optimize(model, steps, inputs, calib=calib, check_inputs=check, device=args.device,
                   batches=args.latency_batch or (1, 16), measure=args.latency,
                   progress=_progress if sys.stderr.isatty() else None,
                   warmup=args.warmup, repeats=args.repeats, int8_for=args.int8_for)
    try:
        _save_and_emit(args, res, steps, out)
    finally:
        res.close()
    return 0 if res.ok else 1


# -- internals -------------------------------------------------------------------------------------

def _emit_steps(args: argparse.Namespace, steps: dict[str, str]) -> None:
    from torch_tricks._format import table

    emit(args, {"steps": steps}, table(["step", "what it does"], [[k, v] for k, v in steps.items()], "ll"))


def _save_and_emit(args: argparse.Namespace, res: Any, steps: list[str], out: Path | None) -> None:
    """Save the final model (unless a step exceeded its tolerance and --force is not given), then report."""
    if args.save and (res.ok or args.force):
        res.save(out or Path(_optimize_name(args.model, steps) + res.suggested_suffix))
    saved = res.saved
    data = {"model": args.model, "steps_asked": steps, "data": args.data, "written": saved.path if saved else None,
            **res.to_dict()}
    emit(args, data, res.to_text(model_name=args.model, steps=steps, data_name=args.data, save_asked=args.save))


def _steps_asked(args: argparse.Namespace, known: dict[str, str]) -> list[str]:
    """The steps of ``--steps A,B --steps C`` in order, and the options checked before any work."""
    steps = [s.strip() for group in args.steps or () for s in group.split(",") if s.strip()]
    if not steps:
        raise UserError("--steps is required, e.g. --steps fuse,int8; choose from " + ", ".join(known))
    _check_options(args)
    return steps


def _check_options(args: argparse.Namespace) -> None:
    if args.repeats < 1 or args.warmup < 0 or args.calib_batches < 1:
        raise UserError("--repeats and --calib-batches must be >= 1 and --warmup >= 0")
    if args.data and args.input:
        raise UserError("give --input or --data, not both: --data takes the inputs from the data set")
    if args.threads is not None:
        from torch_tricks.machine import check_threads

        check_threads(args.threads, what="--threads")


def _checked_out(args: argparse.Namespace, steps: Sequence[str]) -> Path | None:
    """``--out`` as a path whose suffix fits the last step (.onnx for the ONNX steps only)."""
    from torch_tricks.deploy.steps import get_step

    out = Path(args.out) if args.out else None
    final_onnx = get_step(steps[-1].partition(":")[0]).writes_onnx
    if out is not None and (out.suffix.lower() == ".onnx") != final_onnx:
        raise UserError(f"--out {out.name}: " + ("the last step runs in ONNX Runtime and writes an .onnx file: "
                                                 "name it .onnx" if final_onnx else
                                                 "only the onnx / onnx-int8 steps write ONNX: name it .pt2 or .pt"))
    return out


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _progress(msg: str) -> None:
    """On a terminal only: stderr stays one line for errors."""
    print(f"optimize: {msg}", file=sys.stderr, flush=True)


def _data_batches(args: argparse.Namespace, device: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], list[Any]]:
    """(example, check, calib) from a built-in data set: --batch validation rows as the example,
    up to 512 validation rows to compare on, --calib-batches training batches to calibrate on."""
    import itertools

    from torch.utils.data import DataLoader

    from torch_tricks.data import load_dataset

    train_set, val_set = load_dataset(args.data)
    val = next(iter(DataLoader(val_set, batch_size=max(args.batch, 512))))[0].to(device)
    calib = [b[0] for b in itertools.islice(DataLoader(train_set, batch_size=args.batch), args.calib_batches)]
    return (val[: args.batch],), (val,), calib


def _optimize_name(model: str, steps: Sequence[str]) -> str:
    """``resnet18-fuse-int8`` for the default output file (a factory reference gives its name)."""
    import re

    stem = model.rpartition(":")[2] or model
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", f"{stem}-{'-'.join(steps)}")
