"""The ``torch-tricks`` command line: parses arguments, calls the library, prints.

Bad input (an unknown model, a wrong shape, a missing file) prints one line on stderr
and exits with status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from torch_tricks.errors import UserError

DEFAULT_MODEL = "resnet18"
_INPUT_HELP = ("input shape without the batch, e.g. 3x224x224; integer tokens as long:128:VOCAB; ones:128 or "
               "zeros:128 for int64 masks; NAME=SPEC passes a keyword input to the forward, e.g. "
               "input_ids=long:128:50257 and attention_mask=ones:128 (name every input or none); repeat or "
               "comma-separate for several inputs (default: the model's own)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("-v", "--verbose") for a in argv)  # accepted before or after the command
    args = parser.parse_args([a for a in argv if a not in ("-v", "--verbose")])
    args.debug = "--debug" in argv  # accepted before or after the command
    verbose = verbose or args.debug
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        import contextlib

        from torch_tricks._quiet import install

        with contextlib.nullcontext() if verbose else install():  # others' import noise stays off unless -v
            return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print(f"torch-tricks: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("torch-tricks: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `torch-tricks ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def build_parser() -> argparse.ArgumentParser:
    from torch_tricks._losses import LOSSES

    p = argparse.ArgumentParser(
        prog="torch-tricks",
        description="Measure which PyTorch speed and memory tricks help your model, then apply them.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors (and what -v shows)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show other libraries' import-time log lines and deprecation warnings, kept "
                        "off the terminal by default")
    p.set_defaults(debug=False)
    sub = p.add_subparsers(title="commands", metavar="COMMAND")

    def model_args(sp: argparse.ArgumentParser, batch: int = 1) -> None:
        sp.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in model name (see `torch-tricks models`) or package.module:factory "
                             f"(default {DEFAULT_MODEL})")
        sp.add_argument("--input", action="append", metavar="[NAME=]SPEC", help=_INPUT_HELP)
        sp.add_argument("--hf-config", metavar="KEY=VALUE,...",
                        help="config overrides of a transformers model (--model hf:gpt2, hf:bert:classification, "
                             "path/to/config.json), e.g. n_layer=2,n_embd=64,n_head=2")
        sp.add_argument("--batch", type=int, default=batch, help=f"batch size (default {batch})")
        sp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")
        sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
        sp.add_argument("--debug", action="store_true", help="show tracebacks for errors")

    def loss_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--loss", choices=LOSSES, metavar="KIND",
                        help=f"loss of the measured training step: {', '.join(LOSSES)}, built against a target "
                             "made for it (auto: the model's own .loss, else cross-entropy for class or token "
                             "logits, mse otherwise); default: the sum of the output means, with no target")

    sp = sub.add_parser("models", help="list the built-in models")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--debug", action="store_true")
    sp.set_defaults(func=cmd_models)

    sp = sub.add_parser("tricks", help="list the registered tricks (catalogue ids, what each trades)")
    sp.add_argument("--kind", choices=["train", "data", "deploy"])
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--debug", action="store_true")
    sp.set_defaults(func=cmd_tricks)

    sp = sub.add_parser("summary", help="per-layer shapes, parameters, MACs/FLOPs, memory access cost, advice")
    model_args(sp)
    sp.add_argument("--depth", type=int, default=3, help="deepest module level shown (default 3)")
    sp.add_argument("--no-advice", dest="advice", action="store_false", help="skip the design advice")
    sp.set_defaults(func=cmd_summary)

    sp = sub.add_parser("memory", help="parameter, gradient, optimizer and activation memory; leak check")
    model_args(sp, batch=8)
    loss_arg(sp)
    sp.add_argument("--optimizer", default="adamw", help="sgd, adam or adamw (default adamw)")
    sp.add_argument("--leak-steps", type=int, default=0,
                    help="also run this many training steps and check that memory stops growing")
    sp.set_defaults(func=cmd_memory)

    sp = sub.add_parser("time", help="forward, forward+backward and training-step time (synchronised median)")
    model_args(sp, batch=8)
    loss_arg(sp)
    sp.add_argument("--optimizer", default="sgd", help="sgd, adam or adamw (default sgd)")
    sp.add_argument("--warmup", type=int, default=3)
    sp.add_argument("--repeats", type=int, default=10)
    sp.set_defaults(func=cmd_time)

    sp = sub.add_parser("profile", help="cProfile and torch.profiler hot spots of a training step")
    model_args(sp, batch=8)
    loss_arg(sp)
    sp.add_argument("--optimizer", default="sgd")
    sp.add_argument("--top-k", type=int, default=15)
    sp.add_argument("--trace", metavar="PATH", help="also write a Chrome trace (open in Perfetto)")
    sp.set_defaults(func=cmd_profile)

    sp = sub.add_parser("train", help="train a model; every trick is a switch (see --help)")
    sp.add_argument("--model", default="small_cnn", help="built-in name or package.module:factory (default small_cnn)")
    sp.add_argument("--data", default="digits", help="built-in data set (default digits)")
    sp.add_argument("--config", metavar="FILE", help="TOML or YAML file with the same keys as the flags below")
    sp.add_argument("--out", metavar="FILE", help="write the history as JSON here")
    sp.add_argument("--json", action="store_true", help="print the history as JSON")
    sp.add_argument("--loss", choices=LOSSES, metavar="KIND",
                    help=f"{', '.join(LOSSES)} (default auto: the model's own .loss, else cross-entropy against "
                         "class targets, mse against float ones)")
    sp.add_argument("--debug", action="store_true")
    _add_config_flags(sp)
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("tune", help="measure every trick on your model and hardware; recommend a config (tricks.toml)")
    model_args(sp, batch=32)
    sp.add_argument("--optimizer", default="adamw", help="sgd, adam or adamw (default adamw)")
    sp.add_argument("--lr", type=float, default=1e-3, help="learning rate of the measured steps (default 1e-3)")
    sp.add_argument("--loss", choices=LOSSES, default="auto", metavar="KIND",
                    help=f"{', '.join(LOSSES)} (default auto: the model's own .loss, else cross-entropy for class "
                         "or token logits, with next-token targets for token models, mse otherwise)")
    sp.add_argument("--data", metavar="PATH", help="also time the data loader on this data set (a pack, an ImageFolder "
                                                   "tree or an HDF5 file): is the step data-bound?")
    sp.add_argument("--deploy", action="store_true", help="also measure the inference chain (fuse, int8, bf16 ...)")
    sp.add_argument("--budget-seconds", type=float, default=120.0, help="wall-clock budget (default 120)")
    sp.add_argument("--memory-limit", metavar="SIZE",
                    help="e.g. 8GiB or 512MiB (default: the GPU's memory, or 80%% of the RAM available)")
    sp.add_argument("--skip", action="append", metavar="TRICK", help="leave this trick out (repeatable)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--steps", type=int, metavar="N",
                    help="optimizer steps of your training run: compile is recommended only if its compile time "
                         "pays back within them (default: 10,000 assumed, and said in the report)")
    sp.add_argument("--processes", type=int, metavar="N",
                    help="also measure ddp, zero1 and fsdp on N processes the tune launches itself (torchrun's "
                         "engine, this machine; --batch is then the global batch, N must divide it): per-rank "
                         "memory and state, throughput against one process, scaling efficiency. Under torchrun "
                         "the tune uses the ranks it was given instead")
    sp.add_argument("--out", metavar="DIR", help="write report.md, report.json, report.png and tricks.toml here")
    sp.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    sp.set_defaults(func=cmd_tune)

    sp = sub.add_parser("graph", help="autograd graph as DOT/SVG, ONNX for Netron, or TensorBoard graph")
    model_args(sp)
    sp.add_argument("--out", required=True, metavar="PATH",
                    help="model.dot, model.svg (needs graphviz), model.onnx, or a directory for TensorBoard")
    sp.set_defaults(func=cmd_graph)

    sp = sub.add_parser("doctor", help="find classic PyTorch pitfalls in code (PATH...) or a running model (--model)",
                        description="Static: lint PATH... (read with ast, never run), one `file:line:col: ID message` "
                                    "per finding. Runtime: --model runs training steps and reports what only a run "
                                    "shows. Exit 0: nothing at or above --fail-on; 1: findings at or above it; "
                                    "2: bad usage.")
    sp.add_argument("paths", nargs="*", metavar="PATH", help=".py files or folders to lint")
    sp.add_argument("--list", action="store_true", help="list every rule (static TT1xx, runtime TT2xx) and exit")
    sp.add_argument("--explain", metavar="ID", help="explain one rule: why it is a pitfall, the fix, its source")
    sp.add_argument("--select", action="append", metavar="IDS",
                    help="only these rules: ids or prefixes, comma-separated (e.g. TT1,TT207); replaces the config's")
    sp.add_argument("--ignore", action="append", metavar="IDS",
                    help="leave out these rules (ids or prefixes); replaces the config's")
    sp.add_argument("--fail-on", choices=["info", "warning", "error"],
                    help="exit 1 when a finding has this severity or higher (default: the config's fail-on, "
                         "else warning)")
    sp.add_argument("--format", dest="fmt", choices=["text", "json", "sarif"], default="text",
                    help="text (default), json, or sarif (SARIF 2.1.0, for code scanning in CI)")
    sp.add_argument("--json", action="store_true", help="same as --format json")
    sp.add_argument("--fix", action="store_true",
                    help="rewrite the findings whose fix is mechanical (TT102, TT108-TT111, TT113, TT118) in place, "
                         "then report what is left")
    sp.add_argument("--diff", action="store_true",
                    help="print the unified diff --fix would apply and write nothing (exit 1 if there is "
                         "anything to fix)")
    g = sp.add_argument_group("runtime check (--model)")
    g.add_argument("--model", help="built-in model name or package.module:factory: run training steps on it "
                                   "instead of linting files")
    g.add_argument("--input", action="append", metavar="[NAME=]SPEC", help=_INPUT_HELP)
    g.add_argument("--hf-config", metavar="KEY=VALUE,...",
                   help="config overrides of a transformers model (--model hf:bert ...), e.g. num_hidden_layers=2")
    g.add_argument("--batch", type=int, default=8, help="batch size (default 8: BatchNorm wants 8 or more)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")
    g.add_argument("--loss", choices=[*LOSSES, "cross-entropy", "bce"], default="auto", metavar="KIND",
                   help=f"loss of the training step: {', '.join(LOSSES)}, or cross-entropy (= ce) and bce, a torch.nn "
                        "loss each (default auto: the model's own .loss, else cross-entropy; none: the mean of the "
                        "outputs)")
    g.add_argument("--optimizer", metavar="NAME",
                   help="build this optimizer (sgd, adam, adamw ...) the way torch-tricks train does, and check "
                        "its parameter groups too (default: plain SGD steps, groups not checked)")
    g.add_argument("--weight-decay", type=float, help="weight decay for --optimizer")
    g.add_argument("--steps", type=int, default=3,
                   help="training steps after the first, for the memory-growth check (default 3; 1 skips it)")
    sp.add_argument("--debug", action="store_true")
    sp.set_defaults(func=cmd_doctor)

    sp = sub.add_parser("pack", help="pack an image folder / list file once into LMDB or our memory-mapped format")
    sp.add_argument("src", help="ImageFolder tree (root/<class>/<image>) or a list file of 'path label' lines")
    sp.add_argument("dst", help="directory to write the pack to")
    sp.add_argument("--format", dest="fmt", choices=["native", "lmdb"], default="native",
                    help="native: memory-mapped shards (default); lmdb: an LMDB store")
    sp.add_argument("--storage", choices=["encoded", "jpeg", "raw"], default=None,
                    help="encoded: the source bytes; jpeg: re-encoded at --quality; raw: decoded uint8, "
                         "no decode at read time (default: jpeg with --resize, else encoded)")
    sp.add_argument("--resize", type=int, metavar="N", help="shorter side to N pixels, keeping the aspect (D1)")
    sp.add_argument("--raw-size", type=int, metavar="N",
                    help="raw storage: shorter side to N then center crop NxN, so batches read as one array")
    sp.add_argument("--quality", type=int, default=90, help="JPEG quality for --storage jpeg (default 90)")
    sp.add_argument("--no-crop-ready", dest="crop_ready", action="store_false",
                    help="--storage jpeg: plain JPEGs, without the restart markers and MCU offsets that let "
                         "crops decode only what they cover (~6%% smaller)")
    sp.add_argument("--workers", type=int, help="packing processes (default: the usable cores)")
    sp.add_argument("--no-resume", dest="resume", action="store_false",
                    help="start over instead of carrying on an interrupted pack")
    sp.add_argument("--overwrite", action="store_true", help="replace a complete pack at DST")
    sp.add_argument("--no-progress", dest="progress", action="store_false")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--debug", action="store_true")
    sp.set_defaults(func=cmd_pack)

    sp = sub.add_parser("loader-tune", help="time the data loader over workers x batch sizes; I/O- or decode-bound?")
    sp.add_argument("path", help="a pack (from `torch-tricks pack`), an ImageFolder tree or an HDF5 file")
    sp.add_argument("--batch", type=int, action="append", metavar="N", help="batch size to try (repeatable; default 64)")
    sp.add_argument("--workers", type=int, action="append", metavar="N",
                    help="worker count to try (repeatable; default 0, 1, 2, 4 ... up to the cores)")
    sp.add_argument("--seconds", type=float, default=2.0, help="seconds per trial (default 2)")
    sp.add_argument("--device", default="cpu", help="cpu or cuda: cuda pins memory and copies batches over")
    sp.add_argument("--warm", action="store_true", help="keep the page cache when measuring the read rate")
    sp.add_argument("--no-progress", dest="progress", action="store_false")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--debug", action="store_true")
    sp.set_defaults(func=cmd_loader_tune)

    sp = sub.add_parser("ckpt", help="training checkpoints: export a sharded (DCP) or full one as a plain state_dict")
    ck = sp.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ex = ck.add_parser("export", help="the model's weights as one state_dict file, for inference")
    ex.add_argument("src", help="a checkpoint_dir (last.dcp.json or last.pt), a step-N.dcp folder, or a last.pt file")
    ex.add_argument("out", help="the state_dict file to write (atomically)")
    ex.add_argument("--json", action="store_true")
    ex.add_argument("--debug", action="store_true")
    ex.set_defaults(func=cmd_ckpt_export)

    sp = sub.add_parser("optimize", help="deploy steps (fuse, reparam, prune, int8, onnx ...) chained, checked, saved")
    model_args(sp, batch=16)
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
    return p


def _add_config_flags(sp: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field; defaults are None so the config file can fill them."""
    import dataclasses
    import typing

    from torch_tricks.train.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    group = sp.add_argument_group("training switches (also the keys of --config)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        typ = hints[f.name]
        if typ is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"(default {f.default})")
        elif f.name == "checkpointing":
            group.add_argument(flag, dest=f.name, nargs="?", const="blocks", default=None,
                               help="checkpoint activations: blocks (default when given), sqrt, or a module-name glob")
        else:
            group.add_argument(flag, dest=f.name, type=typ, default=None, help=f"(default {f.default!r})")


# -- shared ------------------------------------------------------------------------------

def _load(args: argparse.Namespace):
    """Model and example inputs from --model/--input/--batch/--device."""
    from torch_tricks.device import resolve as resolve_device
    from torch_tricks.inspect.inputs import check_input_names, make_inputs, parse_input_specs
    from torch_tricks.models import load_model

    device = resolve_device(args.device, what="--device")
    model, default_input = load_model(args.model, hf_config=getattr(args, "hf_config", None))
    spec = args.input or default_input
    if not spec:
        raise UserError(f"--input is required for {args.model}: give its input shape, e.g. --input 3x224x224")
    inputs = make_inputs(parse_input_specs(spec), args.batch, model=model, device=device)
    if isinstance(inputs, dict):  # keyword inputs: a name the forward does not take would be dropped or raise
        check_input_names(model, inputs)
    return model.to(device), inputs


def _measured_step(args: argparse.Namespace, model: Any, inputs: Any) -> tuple[Any, Any, Any]:
    """``(inputs, target, loss_fn)`` of the step memory/time/profile measure: with ``--loss KIND``
    the batch and loss of :func:`torch_tricks.batches.example_batch` (a dict batch keeps its
    ``labels`` among the inputs); without it the inspector's default (the sum of the output
    means: no target)."""
    if args.loss is None:
        return inputs, None, None
    from torch_tricks.batches import example_batch, unpack

    batch, loss_fn = example_batch(model, inputs, seed=0, loss=args.loss)
    parts = unpack(batch)
    return (parts.kwargs if parts.kwargs else parts.args), parts.target, loss_fn


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


# -- commands ----------------------------------------------------------------------------

def cmd_models(args: argparse.Namespace) -> int:
    from torch_tricks._format import table
    from torch_tricks.models import list_models, model_spec
    from torch_tricks.models.hf import list_families

    specs = [model_spec(n) for n in list_models()]
    models = [{"name": s.name, "input": s.default_input, "description": s.description} for s in specs] + list_families()
    data = {"models": models}
    _emit(args, data, table(["model", "input", "description"],
                            [[m["name"], m["input"] or "-", m["description"]] for m in models], "lll"))
    return 0


def cmd_tricks(args: argparse.Namespace) -> int:
    import torch

    from torch_tricks._format import table
    from torch_tricks.registry import list_tricks

    cpu = torch.device("cpu")
    tricks = list_tricks(args.kind)
    rows, data = [], []
    for t in tricks:
        ok, why = t.check(cpu)
        rows.append([t.name, ",".join(t.ids), t.kind, t.config_key or "-", "yes" if ok else f"no: {why}", t.trades])
        data.append({"name": t.name, "ids": list(t.ids), "kind": t.kind, "config_key": t.config_key,
                     "trades": t.trades, "needs": t.needs, "runs_on_cpu": ok, "why_not": why})
    _emit(args, {"tricks": data}, table(["trick", "ids", "kind", "config key", "runs here", "trades"], rows, "llllll"))
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from torch_tricks._format import human_bytes, shape_str, si, table
    from torch_tricks.inspect.advisor import advise, group_advice
    from torch_tricks.inspect.summarize import summary

    if args.depth < 0:
        raise UserError("--depth must be >= 0")
    model, inputs = _load(args)
    s = summary(model, inputs, depth=args.depth)
    advice = advise(s) if args.advice else []
    data = s.to_dict()
    data["model"] = args.model
    data["advice"] = [a.to_dict() for a in advice]
    rows = [
        ["  " * (r.depth - 1) + r.name + (f" x{r.calls}" if r.calls > 1 else ""), r.type, shape_str(r.output_shapes),
         f"{r.params:,}", si(r.macs), human_bytes(r.mac_bytes), human_bytes(r.activation_bytes)]
        for r in s.rows
    ]
    t = s.totals
    lines = [
        f"{args.model}: input {s.inputs}",
        table(["layer", "type", "output", "params", "MACs", "mem access", "activations"], rows, "lllrrrr"),
        "",
        f"params: {t['params']:,} ({t['trainable_params']:,} trainable, {t['frozen_params']:,} frozen), "
        f"{human_bytes(t['param_bytes'])} with buffers",
        f"MACs: {si(t['macs'])}   FLOPs: {si(t['flops'])} (= 2 x MACs; conv, linear, matmul, attention, RNN)",
        f"memory access cost: {human_bytes(t['mac_bytes'])} "
        f"({t['pointwise_bytes'] / max(t['mac_bytes'], 1):.0%} in element-wise ops)   "
        f"activations (leaf outputs): {human_bytes(t['activation_bytes'])}",
        "by operator: " + ", ".join(f"{k} {si(v)}" for k, v in s.by_operator.items()),
    ]
    if advice:
        grouped = group_advice(advice)
        data["advice_groups"] = [a.to_dict() for a in grouped]
        shown = grouped[:12]
        lines += ["", f"advice ({len(advice)} in {len(grouped)} pattern(s); ShuffleNetV2 G1-G4, tensor-core dims T23):"]
        lines += [f"  [{a.rule} {a.severity}] {a.module}"
                  + (f" (x{a.count}: {', '.join(a.modules)}{', ...' if a.count > len(a.modules) else ''})"
                     if a.count > 1 else "") + f": {a.message}" for a in shown]
        if len(grouped) > len(shown):
            lines.append(f"  ... {len(grouped) - len(shown)} more (use --json for all)")
    _emit(args, data, "\n".join(lines))
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from torch_tricks._format import human_bytes, table
    from torch_tricks.inspect.memory import leak_check, memory_report
    from torch_tricks.inspect.step import Workloads

    model, inputs = _load(args)
    inputs, target, loss_fn = _measured_step(args, model, inputs)
    rep = memory_report(model, inputs, optimizer=args.optimizer, loss_fn=loss_fn, target=target)
    data = {"model": args.model, "batch": args.batch, "loss": args.loss or "sum of output means", **rep.to_dict()}
    rows = [
        ["parameters", human_bytes(rep.param_bytes)],
        ["buffers", human_bytes(rep.buffer_bytes)],
        ["gradients", human_bytes(rep.grad_bytes)],
        [f"optimizer state ({rep.optimizer})", human_bytes(rep.optimizer_state_bytes)],
        ["= model state between steps", human_bytes(rep.model_state_bytes)],
        [f"activations saved for backward ({rep.saved_tensors} tensors)", human_bytes(rep.activation_bytes)],
        ["input batch", human_bytes(rep.input_bytes)],
        ["peak of tensors allocated in a step", human_bytes(rep.step_tensor_peak_bytes)],
    ]
    if rep.device_peak_bytes is not None:
        rows.append(["device peak during a step (max_memory_allocated)", human_bytes(rep.device_peak_bytes)])
    if rep.process_peak_bytes is not None:
        rows.append([f"process peak RSS during a step ({rep.process_peak_method})", human_bytes(rep.process_peak_bytes)])
    text = [f"{args.model}, batch {args.batch}, {rep.device}:", table(["memory", "bytes"], rows)]
    top = list(rep.activation_by_module.items())[:8]
    if top:
        text += ["", "largest saved activations by module:"]
        text += [f"  {name or '(model)'}: {human_bytes(b)}" for name, b in top]
    if args.leak_steps:
        wl = Workloads(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer, target=target)
        leak = leak_check(wl.step, steps=args.leak_steps, device=args.device)
        data["leak_check"] = leak.to_dict()
        text += ["", f"leak check: {'LEAK: ' if leak.leaking else ''}{leak.message}"]
    _emit(args, data, "\n".join(text))
    return 0


def cmd_time(args: argparse.Namespace) -> int:
    from torch_tricks._format import table
    from torch_tricks.inspect.step import Workloads
    from torch_tricks.inspect.timing import benchmark

    if args.repeats < 1 or args.warmup < 0:
        raise UserError("--repeats must be >= 1 and --warmup >= 0")
    model, inputs = _load(args)
    inputs, target, loss_fn = _measured_step(args, model, inputs)
    wl = Workloads(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer, target=target)
    results = {}
    model.eval()
    results["forward (eval, no_grad)"] = benchmark(wl.forward, warmup=args.warmup, repeats=args.repeats, device=args.device)
    model.train()
    results["forward+backward"] = benchmark(wl.forward_backward, warmup=args.warmup, repeats=args.repeats, device=args.device)
    results[f"training step ({args.optimizer})"] = benchmark(wl.step, warmup=args.warmup, repeats=args.repeats, device=args.device)
    data = {"model": args.model, "batch": args.batch, "loss": args.loss or "sum of output means",
            "timings": {k: v.to_dict() for k, v in results.items()}}
    rows = [[k, f"{v.median_s * 1e3:.2f}", f"{v.iqr_s * 1e3:.2f}", f"{args.batch / v.median_s:.1f}"]
            for k, v in results.items()]
    text = f"{args.model}, batch {args.batch}, {args.device} (median of {args.repeats} after {args.warmup} warm-up):\n"
    text += table(["workload", "median ms", "IQR ms", "samples/s"], rows)
    _emit(args, data, text)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from torch_tricks._format import table
    from torch_tricks.inspect.profile import profile_step
    from torch_tricks.inspect.step import Workloads

    model, inputs = _load(args)
    inputs, target, loss_fn = _measured_step(args, model, inputs)
    model.train()
    wl = Workloads(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer, target=target)
    rep = profile_step(wl.step, top_k=args.top_k, trace_path=args.trace)
    data = {"model": args.model, "batch": args.batch, "loss": args.loss or "sum of output means", **rep.to_dict()}
    text = [f"{args.model}, batch {args.batch}: hot spots of one training step"]
    if rep.ops:
        text += ["", f"torch.profiler operators (by self CPU time, {rep.steps} steps):",
                 table(["operator", "calls", "self ms", "total ms"],
                       [[o.name, o.count, f"{o.self_cpu_ms:.2f}", f"{o.cpu_total_ms:.2f}"] for o in rep.ops])]
    if rep.python:
        text += ["", "cProfile functions (by cumulative time):",
                 table(["function", "calls", "cumulative ms", "own ms"],
                       [[f.function[-70:], f.ncalls, f"{f.cumtime_ms:.2f}", f"{f.tottime_ms:.2f}"]
                        for f in rep.python], "lrrr")]
    if args.trace:
        text += ["", f"Chrome trace written to {args.trace}"]
    _emit(args, data, "\n".join(text))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses

    from torch_tricks._io import atomic_path
    from torch_tricks.data import load_dataset
    from torch_tricks.models import load_model
    from torch_tricks.outputs import get_loss
    from torch_tricks.train import TrainConfig, fit, load_config

    values = load_config(args.config) if args.config else {}
    values.update({f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                   if getattr(args, f.name) is not None})
    config = TrainConfig.from_dict(values).validate()
    train_set, val_set = load_dataset(args.data)
    from torch_tricks.seed import seed_everything

    seed_everything(config.seed)  # the initial weights too come from the seed
    model, _ = load_model(args.model, hf_config=getattr(args, "hf_config", None))
    history = fit(model, train_set, val_set, config=config, loss_fn=get_loss(args.loss) if args.loss else None)
    from torch_tricks.train.distributed import cleanup, is_main_process

    main_rank = is_main_process()
    cleanup()  # leave the process group (a no-op outside torchrun)
    if not main_rank:  # under torchrun, rank 0 reports
        return 0
    data = history.to_dict()
    if args.out:
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(data, indent=2, default=str))
    final = history.final
    text = [f"{args.model} on {args.data}: {history.steps} steps, {history.epochs} epochs in {history.wall_s:.1f} s"
            + (f" (switches: {', '.join(history.applied)})" if history.applied else "")]
    if "train_loss" in final:
        text.append(f"final training loss: {final['train_loss']:.4f} (mean of the last logged steps)")
    valid = {k: v for k, v in final.items() if k != "train_loss"}
    if valid:
        text.append("final validation: " + ", ".join(f"{k} {v:.4f}" for k, v in valid.items()))
    if history.skipped_steps:
        text.append(f"fp16 steps skipped by the grad scaler: {history.skipped_steps}")
    if history.compile_s:
        text.append(f"compile: {history.compile_s:.1f} s (apart from the {history.step_s * 1e3:.1f} ms steps)")
    if history.checkpoint:
        text.append(f"checkpoint: {history.checkpoint}")
    _emit(args, data, "\n".join(text))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from torch_tricks.batches import example_batch
    from torch_tricks.tuning import parse_size, tune

    limit = parse_size(args.memory_limit) if args.memory_limit else None
    model, inputs = _load(args)
    batch, loss_fn = example_batch(model, inputs, seed=args.seed, loss=args.loss)
    from torch_tricks.train.distributed import get_rank

    rank = get_rank()  # under torchrun: rank 0 prints and writes
    report = tune(model, batch, loss_fn, optimizer=args.optimizer, lr=args.lr, device=args.device,
                  budget_s=args.budget_seconds, memory_limit=limit, data=args.data, deploy=args.deploy,
                  seed=args.seed, progress=args.progress and rank == 0, name=args.model, skip=args.skip or (),
                  processes=args.processes, steps=args.steps)
    if rank != 0:
        return 0
    text = report.to_text()
    if args.out:
        paths = report.write(args.out)
        text += "\nwritten: " + ", ".join(str(p) for p in paths.values())
    _emit(args, report.to_dict(), text)
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.graph import save_graph

    model, inputs = _load(args)
    path = save_graph(model, inputs, args.out)
    _emit(args, {"model": args.model, "written": str(path)}, f"graph written to {path}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 0 when no finding is at or above --fail-on, 1 when one is; bad usage is a UserError (2)."""
    from torch_tricks.doctor import get_rule, list_rules

    fmt = "json" if args.json else args.fmt
    if args.json and args.fmt == "sarif":
        raise UserError("--json and --format sarif: choose one")
    select, ignore = _rule_codes(args.select, "--select"), _rule_codes(args.ignore, "--ignore")
    if args.fix or args.diff:
        flag = "--fix" if args.fix else "--diff"
        if args.fix and args.diff:
            raise UserError("--fix and --diff: choose one (--diff shows what --fix would write)")
        if args.model or fmt == "sarif":
            raise UserError(f"{flag} works on the files given as PATH...: not with "
                            f"{'--model' if args.model else '--format sarif'}")
    if args.list or args.explain:
        if args.paths or args.model or (args.list and args.explain):
            raise UserError("--list and --explain ID stand alone: run them without PATH or --model")
        if fmt == "sarif":
            raise UserError("--format sarif is for findings: use --json with --list / --explain")
        rules = [get_rule(args.explain)] if args.explain else list_rules()
        if fmt == "json":
            print(json.dumps({"rules": [_rule_dict(r) for r in rules]}, indent=2, ensure_ascii=False))
        elif args.explain:
            print(_explain_text(rules[0]))
        else:
            from torch_tricks._format import table

            from torch_tricks.doctor.fix import FIXABLE

            print(table(["id", "kind", "severity", "fix", "name", "message"],
                        [[r.id, r.kind, r.severity, "yes" if r.id in FIXABLE else "", r.name, r.message]
                         for r in rules], "llllll"))
        return 0
    if args.paths and args.model:
        raise UserError("give PATH... to lint code or --model to check a running model, not both")
    if args.model:
        return _doctor_model(args, fmt, select, ignore)
    if args.input:
        raise UserError("--input goes with --model: name the model to run")
    if not args.paths:
        raise UserError("nothing to check: give PATH... (files or folders) to lint, --model NAME to check a "
                        "running model, or --list / --explain ID")
    return _doctor_paths(args, fmt, select, ignore)


def _rule_codes(values: list[str] | None, flag: str) -> tuple[str, ...] | None:
    """``--select TT1,TT207 --select TT3`` as checked rule codes; None when the flag is absent."""
    from torch_tricks.doctor.static import check_rule_codes

    if values is None:
        return None
    codes = [c.strip() for v in values for c in v.split(",") if c.strip()]
    if not codes:
        raise UserError(f"{flag} needs rule ids or prefixes, e.g. {flag} TT101,TT2")
    return check_rule_codes(codes, flag)


def _doctor_paths(args: argparse.Namespace, fmt: str, select, ignore) -> int:
    from pathlib import Path

    from torch_tricks.doctor.static import exit_code, format_text, lint_paths, load_config, static_rules, to_sarif

    for p in args.paths:
        if not Path(p).exists():
            raise UserError(f"{p}: no such file or folder: give existing .py files or folders to lint")
    groups: dict = {}  # each path is judged by the settings of its own project (nearest pyproject.toml)
    for p in args.paths:
        config = load_config(p)
        groups.setdefault(config.path, (config, []))[1].append(p)
    failed: list = []  # files --fix could not write
    if args.fix or args.diff:
        from torch_tricks.doctor.fix import fix_paths

        fixed = [ff for config, paths in groups.values()
                 for ff in fix_paths(paths, select=select, ignore=ignore, config=config, write=args.fix)]
        if args.diff:
            return _doctor_diff(fixed, fmt)
        failed = [ff for ff in fixed if ff.error and not ff.unreadable]
        for ff in fixed:  # a file that cannot be read or parsed is reported by the lint below
            if ff in failed:
                print(f"{ff.path}: not fixed: {ff.error}", file=sys.stderr)
            elif ff.fixed or ff.unfixed:
                print(f"{ff.path}: {_fixes_count(ff.fixed)} applied"
                      + (f", {len(ff.unfixed)} not fixable there" if ff.unfixed else ""), file=sys.stderr)
        print(f"{_fixes_count(sum(ff.fixed for ff in fixed if ff.written))} applied to "
              f"{sum(ff.written for ff in fixed)} file(s)", file=sys.stderr)
    findings, unreadable, files, seconds, code = [], [], 0, 0.0, int(bool(failed))
    for config, paths in groups.values():
        result = lint_paths(paths, select=select, ignore=ignore, config=config)
        findings += result.findings
        unreadable += result.errors
        files += result.files
        seconds += result.seconds
        code = max(code, exit_code(result.findings, args.fail_on or config.fail_on))
        if result.errors:  # a file that cannot be read or parsed was not checked: an error under any --fail-on
            code = 1
    fail_on = sorted({args.fail_on or c.fail_on for c, _ in groups.values()})
    if fmt == "sarif":
        print(json.dumps(to_sarif(findings, static_rules(), unreadable), indent=2, ensure_ascii=False))
    elif fmt == "json":
        print(json.dumps({"findings": [f.as_dict() for f in findings], "files": files,
                          "unreadable": [{"path": p, "reason": r} for p, r in unreadable],
                          "seconds": round(seconds, 3), "fail_on": fail_on[0] if len(fail_on) == 1 else fail_on,
                          "config": [str(c.path) for c, _ in groups.values() if c.path is not None],
                          "exit_code": code}, indent=2, ensure_ascii=False))
    else:
        for line in format_text(findings):
            print(line)
        for path, reason in unreadable:
            print(f"{path}: not linted: {reason}", file=sys.stderr)
        print(f"{_findings_count(findings) or 'no findings'} in {files} file(s), {seconds:.2f} s"
              + (f"; {len(unreadable)} file(s) could not be read or parsed" if unreadable else ""), file=sys.stderr)
    return code


def _fixes_count(n: int) -> str:
    return f"{n} fix{'es' if n != 1 else ''}"


def _doctor_diff(fixed: list, fmt: str) -> int:
    """--diff: what --fix would change, written nowhere. Exit 1 if anything would change or a file
    could not be fixed (read, parsed), else 0."""
    code = int(any(ff.diff or ff.error for ff in fixed))
    if fmt == "json":
        print(json.dumps({"files": [ff.as_dict() for ff in fixed], "fixes": sum(ff.fixed for ff in fixed),
                          "exit_code": code}, indent=2, ensure_ascii=False))
        return code
    for ff in fixed:
        sys.stdout.write(ff.diff)
    for ff in fixed:
        if ff.error:
            print(f"{ff.path}: not fixed: {ff.error}", file=sys.stderr)
    changed = sum(bool(ff.diff) for ff in fixed)
    print(f"{_fixes_count(sum(ff.fixed for ff in fixed))} would be applied to {changed} file(s)"
          if changed else "nothing to fix", file=sys.stderr)
    return code


def _doctor_model(args: argparse.Namespace, fmt: str, select, ignore) -> int:
    from pathlib import Path

    from torch_tricks.doctor import list_rules
    from torch_tricks.doctor.runtime import check_model
    from torch_tricks.doctor.static import exit_code, filter_findings, load_config, to_sarif

    if args.steps < 1 or args.batch < 1:
        raise UserError("--steps and --batch must be >= 1")
    if args.weight_decay is not None and not args.optimizer:
        raise UserError("--weight-decay goes with --optimizer NAME")
    config = load_config(Path.cwd())
    model, inputs = _load(args)
    optimizer = None
    if args.optimizer:
        from torch_tricks.train.optim import build_optimizer

        optimizer = build_optimizer(model, args.optimizer, weight_decay=args.weight_decay)
    report = check_model(model, inputs, args.loss, optimizer, steps=args.steps, device=args.device)
    findings = filter_findings(report.findings, config.select if select is None else select,
                               config.ignore if ignore is None else ignore)
    code = exit_code(findings, args.fail_on or config.fail_on)
    if fmt == "sarif":
        print(json.dumps(to_sarif(findings, list_rules("runtime")), indent=2, ensure_ascii=False))
        return code
    data = {"model": args.model, "optimizer": args.optimizer, **report.as_dict()}  # loss_fn: the loss it used
    data["findings"] = [f.as_dict() for f in findings]  # after --select/--ignore and the config
    data["counts"] = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    data["ok"] = not (data["counts"]["error"] or data["counts"]["warning"])
    data["exit_code"] = code
    loss = f"{report.loss:.4g}" if report.loss is not None else "-"
    lines = [f"{args.model}: inputs {report.inputs}, outputs {report.outputs or '-'}, target {report.target or '-'}",
             f"loss ({report.loss_fn}) {loss}, {report.steps_run} training step(s) on {report.device}, "
             + (f"optimizer {args.optimizer}" if args.optimizer else "plain SGD steps")]
    if not report.completed:
        lines.append(f"the training step did not complete: {report.error}")
    lines.append("")
    lines += [f"{f.rule} {f.severity:<7} {f.path or '-'}: {f.message}" for f in findings]
    lines.append(_findings_count(findings) or "no findings")
    lines += [f"not checked: {check}: {why}" for check, why in report.skipped.items()]
    lines += [f"note: {n}" for n in report.notes]
    _emit(argparse.Namespace(json=fmt == "json"), data, "\n".join(lines))
    return code


def _findings_count(findings) -> str:
    from collections import Counter

    by = Counter(f.severity for f in findings)
    parts = [f"{by[s]} {s}{'s' if by[s] != 1 and s != 'info' else ''}" for s in ("error", "warning", "info") if by[s]]
    return f"{len(findings)} finding{'s' if len(findings) != 1 else ''} ({', '.join(parts)})" if findings else ""


def _rule_dict(rule) -> dict[str, Any]:
    from torch_tricks.doctor.fix import FIXABLE

    return {"id": rule.id, "name": rule.name, "kind": rule.kind, "severity": rule.severity,
            "message": rule.message, "explanation": rule.explanation, "source": rule.source,
            "fixable": rule.id in FIXABLE}


def _rule_source(rule) -> str:
    """The rule's source for users: its catalogue ids and public references, linked to docs/tricks.md;
    the internal source notes (``seeds/...``, kept in ``rule.source``) are left out."""
    import re

    from torch_tricks._docs import doc_link

    parts = [p.strip() for p in rule.source.split(";") if p.strip() and not p.strip().startswith("seeds/")]
    ids = dict.fromkeys(re.findall(r"\b([TDIP]\d+)\b", "; ".join(parts)))
    links = [link for link in map(doc_link, ids) if link]
    text = f"Source: {'; '.join(parts) or rule.source.split(';')[0]}."
    return text + (f" See {', '.join(links)}." if links else "")


def _explain_text(rule) -> str:
    import textwrap

    silence = (f"Silence one line with `# noqa: {rule.id}`; " if rule.kind == "static" else "")
    silence += f"leave it out with --ignore {rule.id}, or ignore = [\"{rule.id}\"] under [tool.torch-tricks.doctor] " \
               "in pyproject.toml."
    from torch_tricks.doctor.fix import FIXABLE

    if rule.id in FIXABLE:
        silence = "`torch-tricks doctor --fix` rewrites it where the file shows the fix is safe (--diff to preview). " \
                  + silence
    return "\n".join([f"{rule.id} {rule.name} ({rule.kind}, {rule.severity})", "", rule.message, "",
                      textwrap.fill(rule.explanation, 88), "", textwrap.fill(_rule_source(rule), 88), "",
                      textwrap.fill(silence[0].upper() + silence[1:], 88)])


def cmd_pack(args: argparse.Namespace) -> int:
    from torch_tricks._format import human_bytes
    from torch_tricks.data.pack import pack

    storage = args.storage or ("jpeg" if args.resize else "encoded")
    report = pack(args.src, args.dst, fmt=args.fmt, storage=storage, resize=args.resize, raw_size=args.raw_size,
                  quality=args.quality, crop_ready=args.crop_ready, workers=args.workers, progress=args.progress,
                  resume=args.resume, overwrite=args.overwrite)
    lines = [f"packed {report.count:,} samples ({len(report.classes)} classes) into {report.path}: "
             f"{report.fmt}, {report.storage}, {human_bytes(report.bytes)} on disk, {report.seconds:.1f} s"
             + (f", resumed after {report.resumed_from:,}" if report.resumed_from else "")]
    if report.skipped:
        lines.append(f"skipped {len(report.skipped)} unreadable source(s):")
        lines += [f"  {name}: {why}" for name, why in report.skipped]
    _emit(args, report.to_dict(), "\n".join(lines))
    return 0


def cmd_loader_tune(args: argparse.Namespace) -> int:
    from torch_tricks._format import human_bytes, table
    from torch_tricks.data.loader_tune import tune_loader_path

    r = tune_loader_path(args.path, batch_sizes=args.batch or (64,), workers=args.workers,
                         seconds_per_trial=args.seconds, device=args.device, progress=args.progress,
                         cold_read=not args.warm)
    rows = [[t["batch_size"], t["workers"], "yes" if t["pin_memory"] else "no", f"{t['samples/s']:,.0f}",
             f"{t['first batch s']:.2f}", "*" if t["best"] else "", t["error"]] for t in r.rows()]
    lines = [f"{r.dataset}: {r.num_samples:,} samples, {r.cpu_count} CPUs, device {r.device}",
             table(["batch", "workers", "pinned", "samples/s", "first batch s", "best", "error"], rows, "rrlrrll")]
    if r.read_rate_bytes_per_s:
        lines.append(f"storage read rate: {human_bytes(r.read_rate_bytes_per_s)}/s "
                     f"({'cold' if r.read_cold else 'page cache'}, {human_bytes(r.read_bytes)} read)")
    if r.decode_rate_samples_per_s:
        lines.append(f"decode rate, one process: {r.decode_rate_samples_per_s:,.0f} samples/s")
    lines.append(f"verdict: {r.verdict}")
    lines += [f"  {why}" for why in r.reasons]
    if r.advice:
        lines.append("advice:")
        lines += [f"  {a}" for a in r.advice]
    if r.best is not None:
        lines.append("use: make_loader(dataset, " + ", ".join(f"{k}={v}" for k, v in r.loader_kwargs().items()) + ")")
    _emit(args, r.to_dict(), "\n".join(lines))
    return 0


def cmd_ckpt_export(args: argparse.Namespace) -> int:
    from torch_tricks._format import human_bytes
    from torch_tricks.train.sharded_checkpoint import export_checkpoint

    info = export_checkpoint(args.src, args.out)
    _emit(args, info, f"wrote {info['out']}: {info['tensors']} tensors, {info['numel']:,} values, "
                      f"{human_bytes(info['bytes'])}, from {info['source']}; load it with "
                      f"model.load_state_dict(torch.load({info['out']!r}, weights_only=True))")
    return 0


def cmd_optimize(args: argparse.Namespace) -> int:
    """Exit 0 when every step held its tolerance, 1 when one did not (nothing written without --force)."""
    from pathlib import Path

    import torch

    from torch_tricks._format import human_bytes, table
    from torch_tricks.deploy.pipeline import list_steps, optimize
    from torch_tricks.inspect.inputs import describe_inputs, parse_input_specs

    if args.list_steps:
        steps = list_steps()
        _emit(args, {"steps": steps}, table(["step", "what it does"], [[k, v] for k, v in steps.items()], "ll"))
        return 0
    steps = [s.strip() for group in args.steps or () for s in group.split(",") if s.strip()]
    if not steps:
        raise UserError("--steps is required, e.g. --steps fuse,int8; choose from " + ", ".join(list_steps()))
    if args.repeats < 1 or args.warmup < 0 or args.calib_batches < 1:
        raise UserError("--repeats and --calib-batches must be >= 1 and --warmup >= 0")
    if args.data and args.input:
        raise UserError("give --input or --data, not both: --data takes the inputs from the data set")
    out = Path(args.out) if args.out else None
    final_onnx = steps[-1].partition(":")[0].strip().lower().startswith("onnx")
    if out is not None and (out.suffix.lower() == ".onnx") != final_onnx:
        raise UserError(f"--out {out.name}: " + ("the last step runs in ONNX Runtime and writes an .onnx file: "
                                                 "name it .onnx" if final_onnx else
                                                 "only the onnx / onnx-int8 steps write ONNX: name it .pt2 or .pt"))
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.input and any(s.name for s in parse_input_specs(args.input)):
        raise UserError("optimize takes positional inputs: give --input SPEC without NAME=")
    model, inputs = _load(args)
    calib = check = None
    if args.data:
        inputs, check, calib = _data_batches(args, inputs[0].device)
    if args.weights:
        from torch_tricks.train.checkpoint import load_checkpoint

        load_checkpoint(args.weights, model=model, strict=True, restore_rng=False)

    def progress(msg: str) -> None:  # on a terminal only: stderr stays one line for errors
        print(f"optimize: {msg}", file=sys.stderr, flush=True)

    res = optimize(model, steps, inputs, calib=calib, check_inputs=check, device=args.device,
                   batches=args.latency_batch or (1, 16), measure=args.latency,
                   progress=progress if sys.stderr.isatty() else None,
                   warmup=args.warmup, repeats=args.repeats, int8_for=args.int8_for)
    try:
        exceeded = [s for s in res.steps if s.within_tolerance is False]
        if args.save and (not exceeded or args.force):
            res.save(out or Path(_optimize_name(args.model, steps) + res.suggested_suffix))
        compared = describe_inputs(check if check is not None else res.example_inputs)
        lines = [f"{args.model}: {','.join(steps)} on {res.device}, {res.threads} thread(s); outputs compared on "
                 f"{compared}" + (f" from {args.data} (validation)" if args.data else " (random)")]
        if res.measured:
            lines.append(f"latency: median ms of {args.repeats} calls after {args.warmup} warm-up, "
                         "bsN x = speed-up over the original")
        lines += [res.format_table(), ""]
        lines += [f"  {n}" for n in res.notes()]
        if exceeded:
            lines.append("NOT verified: " + "; ".join(f"{s.step} exceeds {s.tolerance}" for s in exceeded))
        else:
            lines.append("verified: every step within its tolerance against the model before it")
        unchecked = [s.step for s in res.steps if s.within_tolerance is None]
        if unchecked:
            lines.append(f"  not held to a tolerance: {', '.join(unchecked)} (changes the outputs by design, "
                         "or they could not be compared: see the notes)")
        saved = res.saved
        if saved is not None:
            check_text = (f"; loaded back, max abs diff {saved.verify_max_abs_diff:.2e}"
                          if saved.verify_max_abs_diff is not None else "")
            lines.append(f"wrote {saved.path}: {saved.format}, {human_bytes(saved.size_bytes)}{check_text}")
            lines += [f"  {saved.why}", f"  load: {saved.load}", *(f"  {n}" for n in saved.notes)]
        elif args.save:
            lines.append("nothing written: a step exceeded its tolerance (--force writes it anyway)")
        data = {"model": args.model, "steps_asked": steps, "data": args.data, "written": saved.path if saved else None,
                **res.as_dict()}
        _emit(args, data, "\n".join(lines))
    finally:
        res.close()
    return 1 if exceeded else 0


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
