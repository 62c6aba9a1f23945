"""``train``, ``tune`` and ``ckpt export``: train with every trick a switch, and find the switches."""

from __future__ import annotations

import argparse
import json
from typing import Any

from torch_tricks.cli.common import add_common, add_model_options, emit, load


def add_commands(sub: Any) -> None:
    from torch_tricks._losses import LOSSES

    sp = sub.add_parser("train", help="train a model; every trick is a switch (see --help)")
    sp.add_argument("--model", default="small_cnn", help="built-in name or package.module:factory (default small_cnn)")
    sp.add_argument("--data", default="digits", help="built-in data set (default digits)")
    sp.add_argument("--config", metavar="FILE", help="TOML or YAML file with the same keys as the flags below")
    sp.add_argument("--out", metavar="FILE", help="write the history as JSON here")
    sp.add_argument("--loss", choices=LOSSES, metavar="KIND",
                    help=f"{', '.join(LOSSES)} (default auto: the model's own .loss, else cross-entropy against "
                         "class targets, mse against float ones)")
    add_common(sp, json_help="print the history as JSON")
    _add_config_flags(sp)
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("tune", help="measure every trick on your model and hardware; recommend a config (tricks.toml)")
    add_model_options(sp, batch=32)
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
    sp.add_argument("--fit", metavar="TARGET",
                    help="what the recommendation must fit under the memory limit: batch=N (tune at batch N), "
                         "seq=N (at sequence length N, token models) or seq (also run the longest sequence that "
                         "fits, for plain and the recommendation; needs --memory-limit on a CPU)")
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
    sp.add_argument("--emit", metavar="TRAINER", choices=("hf", "lightning", "accelerate"),
                    help="also print the lines that apply the recommendation in that trainer: hf (the transformers "
                         "Trainer), lightning, or accelerate (a loop of your own on an Accelerator)")
    sp.add_argument("--out", metavar="DIR", help="write report.md, report.json, report.png and tricks.toml here")
    sp.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    sp.set_defaults(func=cmd_tune)

    sp = sub.add_parser("ckpt", help="training checkpoints: export a sharded (DCP) or full one as a plain state_dict")
    ck = sp.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ex = ck.add_parser("export", help="the model's weights as one state_dict file, for inference")
    ex.add_argument("src", help="a checkpoint_dir (last.dcp.json or last.pt), a step-N.dcp folder, or a last.pt file")
    ex.add_argument("out", help="the state_dict file to write (atomically)")
    add_common(ex)
    ex.set_defaults(func=cmd_ckpt_export)


def cmd_train(args: argparse.Namespace) -> int:
    from torch_tricks._io import atomic_path
    from torch_tricks.data import load_dataset
    from torch_tricks.models import load_model
    from torch_tricks.outputs import get_loss
    from torch_tricks.seed import seed_everything
    from torch_tricks.train import fit
    from torch_tricks.train.distributed import cleanup, is_main_process

    config = _train_config(args)
    train_set, val_set = load_dataset(args.data)
    seed_everything(config.seed)  # the initial weights too come from the seed
    model, _ = load_model(args.model, hf_config=getattr(args, "hf_config", None))
    history = fit(model, train_set, val_set, config=config, loss_fn=get_loss(args.loss) if args.loss else None)
    main_rank = is_main_process()
    cleanup()  # leave the process group (a no-op outside torchrun)
    if not main_rank:  # under torchrun, rank 0 reports
        return 0
    data = history.to_dict()
    if args.out:
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(data, indent=2, default=str))
    emit(args, data, history.to_text(args.model, args.data))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from torch_tricks.batches import example_batch
    from torch_tricks.train.distributed import get_rank
    from torch_tricks.tuning import parse_size, tune

    limit = parse_size(args.memory_limit) if args.memory_limit else None
    if args.emit:  # a bad target, or a trainer not installed, is said before the tune, not after it
        from torch_tricks.integrations import TARGETS, emit_lines

        emit_lines({}, args.emit)
    model, inputs = load(args)
    batch, loss_fn = example_batch(model, inputs, seed=args.seed, loss=args.loss)
    rank = get_rank()  # under torchrun: rank 0 prints and writes
    report = tune(model, batch, loss_fn, optimizer=args.optimizer, lr=args.lr, device=args.device,
                  budget_s=args.budget_seconds, memory_limit=limit, data=args.data, deploy=args.deploy,
                  seed=args.seed, progress=args.progress and rank == 0, name=args.model, skip=args.skip or (),
                  processes=args.processes, steps=args.steps, fit=args.fit)
    if rank != 0:
        return 0
    if args.emit:
        report.emit = {"target": args.emit, "title": TARGETS[args.emit],
                       "lines": emit_lines(report.recommended_config(), args.emit)}
    text, data = report.to_text(), report.to_dict()
    if report.emit:
        text += f"\n\nthe recommendation in your {report.emit['title']} script:\n" + "\n".join(report.emit["lines"])
        data["emit"] = report.emit
    if args.out:
        paths = report.write(args.out)
        text += "\nwritten: " + ", ".join(str(p) for p in paths.values())
    emit(args, data, text)
    return 0


def cmd_ckpt_export(args: argparse.Namespace) -> int:
    from torch_tricks.train.sharded_checkpoint import export_checkpoint

    info = export_checkpoint(args.src, args.out)
    emit(args, info.to_dict(), info.to_text())
    return 0


# -- internals -------------------------------------------------------------------------------------

def _train_config(args: argparse.Namespace) -> Any:
    """The TrainConfig of ``--config`` (if given) with the switches given as flags on top, validated."""
    import dataclasses

    from torch_tricks.train import TrainConfig, load_config

    values = load_config(args.config) if args.config else {}
    values.update({f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                   if getattr(args, f.name) is not None})
    return TrainConfig.from_dict(values).validate()


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

