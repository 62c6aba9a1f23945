"""``models``, ``tricks``, ``summary``, ``memory``, ``time``, ``profile``, ``graph``: what a model costs."""

from __future__ import annotations

import argparse
from typing import Any

from torch_tricks.cli.common import add_common, add_loss_option, add_model_options, emit, load, measured_step
from torch_tricks.errors import UserError


def add_commands(sub: Any) -> None:
    sp = sub.add_parser("models", help="list the built-in models")
    add_common(sp)
    sp.set_defaults(func=cmd_models)

    sp = sub.add_parser("tricks", help="list the registered tricks (catalogue ids, what each trades)")
    sp.add_argument("--kind", choices=["train", "data", "deploy"])
    add_common(sp)
    sp.set_defaults(func=cmd_tricks)

    sp = sub.add_parser("summary", help="per-layer shapes, parameters, MACs/FLOPs, memory access cost, advice")
    add_model_options(sp)
    sp.add_argument("--depth", type=int, default=3, help="deepest module level shown (default 3)")
    sp.add_argument("--no-advice", dest="advice", action="store_false", help="skip the design advice")
    sp.set_defaults(func=cmd_summary)

    sp = sub.add_parser("memory", help="parameter, gradient, optimizer and activation memory; leak check")
    add_model_options(sp, batch=8)
    add_loss_option(sp)
    sp.add_argument("--optimizer", default="adamw", help="sgd, adam or adamw (default adamw)")
    sp.add_argument("--leak-steps", type=int, default=0,
                    help="also run this many training steps and check that memory stops growing")
    sp.set_defaults(func=cmd_memory)

    sp = sub.add_parser("time", help="forward, forward+backward and training-step time (synchronised median)")
    add_model_options(sp, batch=8)
    add_loss_option(sp)
    sp.add_argument("--optimizer", default="sgd", help="sgd, adam or adamw (default sgd)")
    sp.add_argument("--warmup", type=int, default=3)
    sp.add_argument("--repeats", type=int, default=10)
    sp.set_defaults(func=cmd_time)

    sp = sub.add_parser("profile", help="cProfile and torch.profiler hot spots of a training step")
    add_model_options(sp, batch=8)
    add_loss_option(sp)
    sp.add_argument("--optimizer", default="sgd")
    sp.add_argument("--top-k", type=int, default=15)
    sp.add_argument("--trace", metavar="PATH", help="also write a Chrome trace (open in Perfetto)")
    sp.set_defaults(func=cmd_profile)

    sp = sub.add_parser("graph", help="autograd graph as DOT/SVG, ONNX for Netron, or TensorBoard graph")
    add_model_options(sp)
    sp.add_argument("--out", required=True, metavar="PATH",
                    help="model.dot, model.svg (needs graphviz), model.onnx, or a directory for TensorBoard")
    sp.set_defaults(func=cmd_graph)


def cmd_models(args: argparse.Namespace) -> int:
    from torch_tricks._format import table
    from torch_tricks.models import list_models, model_spec
    from torch_tricks.models.hf import list_families

    specs = [model_spec(n) for n in list_models()]
    models = [{"name": s.name, "input": s.default_input, "description": s.description} for s in specs] + list_families()
    emit(args, {"models": models}, table(["model", "input", "description"],
                                         [[m["name"], m["input"] or "-", m["description"]] for m in models], "lll"))
    return 0


def cmd_tricks(args: argparse.Namespace) -> int:
    import torch

    from torch_tricks._format import table
    from torch_tricks.registry import list_tricks

    cpu = torch.device("cpu")
    rows, data = [], []
    for t in list_tricks(args.kind):
        ok, why = t.check(cpu)
        rows.append([t.name, ",".join(t.ids), t.kind, t.config_key or "-", "yes" if ok else f"no: {why}", t.trades])
        data.append({"name": t.name, "ids": list(t.ids), "kind": t.kind, "config_key": t.config_key,
                     "trades": t.trades, "needs": t.needs, "runs_on_cpu": ok, "why_not": why})
    emit(args, {"tricks": data}, table(["trick", "ids", "kind", "config key", "runs here", "trades"], rows, "llllll"))
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.advisor import advise, group_advice
    from torch_tricks.inspect.summarize import summary

    if args.depth < 0:
        raise UserError("--depth must be >= 0")
    model, inputs = load(args)
    s = summary(model, inputs, depth=args.depth)
    advice = advise(s) if args.advice else []
    grouped = group_advice(advice) if advice else []
    data = {**s.to_dict(), "model": args.model, "advice": [a.to_dict() for a in advice]}
    if grouped:
        data["advice_groups"] = [a.to_dict() for a in grouped]
    emit(args, data, "\n".join(_summary_lines(args.model, s) + _advice_lines(advice, grouped)))
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.memory import leak_check, memory_report
    from torch_tricks.inspect.step import Workloads

    model, inputs = load(args)
    inputs, target, loss_fn = measured_step(args, model, inputs)
    rep = memory_report(model, inputs, optimizer=args.optimizer, loss_fn=loss_fn, target=target)
    data = {"model": args.model, "batch": args.batch, "loss": args.loss or "sum of output means", **rep.to_dict()}
    text = _memory_lines(args, rep)
    if args.leak_steps:
        wl = Workloads(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer, target=target)
        leak = leak_check(wl.step, steps=args.leak_steps, device=args.device)
        data["leak_check"] = leak.to_dict()
        text += ["", f"leak check: {'LEAK: ' if leak.leaking else ''}{leak.message}"]
    emit(args, data, "\n".join(text))
    return 0


def cmd_time(args: argparse.Namespace) -> int:
    from torch_tricks._format import table
    from torch_tricks.inspect.step import Workloads
    from torch_tricks.inspect.timing import benchmark

    if args.repeats < 1 or args.warmup < 0:
        raise UserError("--repeats must be >= 1 and --warmup >= 0")
    model, inputs = load(args)
    inputs, target, loss_fn = measured_step(args, model, inputs)
    wl = Workloads(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer, target=target)
    times = dict(warmup=args.warmup, repeats=args.repeats, device=args.device)
    model.eval()
    results = {"forward (eval, no_grad)": benchmark(wl.forward, **times)}
    model.train()
    results["forward+backward"] = benchmark(wl.forward_backward, **times)
    results[f"training step ({args.optimizer})"] = benchmark(wl.step, **times)
    data = {"model": args.model, "batch": args.batch, "loss": args.loss or "sum of output means",
            "timings": {k: v.to_dict() for k, v in results.items()}}
    rows = [[k, f"{v.median_s * 1e3:.2f}", f"{v.iqr_s * 1e3:.2f}", f"{args.batch / v.median_s:.1f}"]
            for k, v in results.items()]
    text = f"{args.model}, batch {args.batch}, {args.device} (median of {args.repeats} after {args.warmup} warm-up):\n"
    emit(args, data, text + table(["workload", "median ms", "IQR ms", "samples/s"], rows))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from torch_tricks._format import table
    from torch_tricks.inspect.profile import profile_step
    from torch_tricks.inspect.step import Workloads

    model, inputs = load(args)
    inputs, target, loss_fn = measured_step(args, model, inputs)
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
    emit(args, data, "\n".join(text))
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.graph import save_graph

    model, inputs = load(args)
    path = save_graph(model, inputs, args.out)
    emit(args, {"model": args.model, "written": str(path)}, f"graph written to {path}")
    return 0


# -- text ------------------------------------------------------------------------------------------

def _summary_lines(model_name: str, s: Any) -> list[str]:
    """The per-layer table and the totals of a summary."""
    from torch_tricks._format import human_bytes, shape_str, si, table

    rows = [
        ["  " * (r.depth - 1) + r.name + (f" x{r.calls}" if r.calls > 1 else ""), r.type, shape_str(r.output_shapes),
         f"{r.params:,}", si(r.macs), human_bytes(r.mac_bytes), human_bytes(r.activation_bytes)]
        for r in s.rows
    ]
    t = s.totals
    return [
        f"{model_name}: input {s.inputs}",
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


def _advice_lines(advice: list[Any], grouped: list[Any], shown_at_most: int = 12) -> list[str]:
    """One line per advice pattern (its modules counted), the first ``shown_at_most`` of them."""
    if not advice:
        return []
    shown = grouped[:shown_at_most]
    lines = ["", f"advice ({len(advice)} in {len(grouped)} pattern(s); ShuffleNetV2 G1-G4, tensor-core dims T23):"]
    for a in shown:
        where = (f" (x{a.count}: {', '.join(a.modules)}{', ...' if a.count > len(a.modules) else ''})"
                 if a.count > 1 else "")
        lines.append(f"  [{a.rule} {a.severity}] {a.module}{where}: {a.message}")
    if len(grouped) > len(shown):
        lines.append(f"  ... {len(grouped) - len(shown)} more (use --json for all)")
    return lines


def _memory_lines(args: argparse.Namespace, rep: Any) -> list[str]:
    from torch_tricks._format import human_bytes, table

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
    return text
