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
    sp.add_argument("--no-advice", dest="advice", action="store_false",
                    help="leave out the largest share's trick and its measured saving (two more training steps); "
                         "for a causal LM, --loss auto counts its loss and logits apart")
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

    sp = sub.add_parser("peak", help="this machine's peak matmul rate per dtype (measured once, cached): MFU's yardstick")
    sp.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    sp.add_argument("--refresh", action="store_true", help="measure again, replacing the cached entry")
    add_common(sp)
    sp.set_defaults(func=cmd_peak)

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

    if args.depth < 0:  # before loading the model, in the flag's name (summary() checks it too)
        raise UserError("--depth must be >= 0")
    model, inputs = load(args)
    s = summary(model, inputs, depth=args.depth)
    advice = advise(s) if args.advice else []
    data = {**s.to_dict(), "model": args.model, "advice": [a.to_dict() for a in advice]}
    if advice:
        data["advice_groups"] = [a.to_dict() for a in group_advice(advice)]
    emit(args, data, s.to_text(args.model, advice))
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.memory import leak_check, memory_report
    from torch_tricks.inspect.step import Workloads

    model, load_inputs = load(args)
    inputs, target, loss_fn = measured_step(args, model, load_inputs)
    rep = memory_report(model, inputs, optimizer=args.optimizer, loss_fn=loss_fn, target=target)
    data = {"model": args.model, "batch": args.batch, "loss": args.loss or "sum of output means", **rep.to_dict()}
    text = rep.to_text(args.model, args.batch)
    if args.advice:
        from torch_tricks.batches import example_batch
        from torch_tricks.tuning.memory_advice import advise_memory

        batch, train_loss = example_batch(model, load_inputs, seed=0, loss=args.loss or "auto")
        advice = advise_memory(model, rep, batch, train_loss, device=args.device, optimizer=args.optimizer)
        data["advice"] = advice.to_dict()
        text += "\n\n" + advice.to_text()
    if args.leak_steps:
        wl = Workloads(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer, target=target)
        leak = leak_check(wl.step, steps=args.leak_steps, device=args.device)
        data["leak_check"] = leak.to_dict()
        text += "\n\n" + leak.to_text()
    emit(args, data, text)
    return 0


def cmd_time(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.step import Workloads
    from torch_tricks.inspect.timing import benchmark, timings_table

    if args.repeats < 1 or args.warmup < 0:  # before loading the model, in the flags' names (benchmark checks too)
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
    emit(args, data, timings_table(results, args.batch, title=f"{args.model}, batch {args.batch}, {args.device}"))
    return 0


def cmd_peak(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.peak import device_peak

    peak = device_peak(args.device, refresh=args.refresh)
    emit(args, peak.to_dict(), peak.to_text())
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.profile import profile_step
    from torch_tricks.inspect.step import Workloads

    model, inputs = load(args)
    inputs, target, loss_fn = measured_step(args, model, inputs)
    model.train()
    wl = Workloads(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer, target=target)
    rep = profile_step(wl.step, top_k=args.top_k, trace_path=args.trace)
    data = {"model": args.model, "batch": args.batch, "loss": args.loss or "sum of output means", **rep.to_dict()}
    emit(args, data, rep.to_text(args.model, args.batch))
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    from torch_tricks.inspect.graph import save_graph

    model, inputs = load(args)
    path = save_graph(model, inputs, args.out)
    emit(args, {"model": args.model, "written": str(path)}, f"graph written to {path}")
    return 0
