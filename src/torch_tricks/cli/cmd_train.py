"""``train``, ``tune`` and ``ckpt export``: train with every trick a switch, and find the switches."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch_tricks.cli.common import HF_CONFIG_HELP, add_common, add_model_options, emit, load_with_specs
from torch_tricks.errors import UserError


def add_commands(sub: Any) -> None:
    from torch_tricks._losses import LOSSES

    sp = sub.add_parser("train", help="train a model; every trick is a switch (see --help)")
    sp.add_argument("--model", help="built-in name, package.module:factory or transformers model (hf:gpt2 ...); "
                                     "default: the model a tune recorded in --config's [model] table, else small_cnn")
    sp.add_argument("--hf-config", metavar="KEY=VALUE,...", help=HF_CONFIG_HELP + " (default: the [model] table's)")
    sp.add_argument("--data", metavar="NAME|TOKENS",
                    help="a built-in data set (digits, the default for small_cnn), or token data for a causal LM: a "
                         "1-D token file, FILE.bin of uint16 ids as nanoGPT writes them (FILE.bin:uint32 for uint32), "
                         "or FILE.npy; or a token set of rows of different lengths: a data set saved with datasets' "
                         "save_to_disk (a folder; FOLDER:SPLIT picks a split, default train), FILE.jsonl or "
                         "FILE.parquet, with an input_ids column or a text column and --tokenizer")
    sp.add_argument("--tokenizer", metavar="PATH",
                    help="a local tokenizer folder (save_pretrained's) that turns a token set's text column into ids")
    sp.add_argument("--truncate", action="store_true",
                    help="cut a token set's rows longer than the model's positions to them (counted; without it "
                         "such rows are refused)")
    sp.add_argument("--seq", type=int, metavar="N",
                    help="sequence length of token data (default: the tuned input's, in the [model] table, else the "
                         "model's positions)")
    sp.add_argument("--config", metavar="FILE",
                    help="TOML or YAML file with the same keys as the flags below (a tune's tricks.toml: its [model] "
                         "table names the model too)")
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
                                                   "tree or an HDF5 file): is the step data-bound? Or a token set "
                                                   "(a saved data set folder, FILE.jsonl, FILE.parquet) for a causal "
                                                   "LM: tuned on its longest rows, and its ways to batch (padded, "
                                                   "grouped, packed) measured in real tokens/s")
    sp.add_argument("--tokenizer", metavar="PATH", help="a local tokenizer folder for a token set's text column")
    sp.add_argument("--truncate", action="store_true",
                    help="cut a token set's rows longer than the model's positions to them (counted)")
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
    sp.add_argument("--emit", metavar="TRAINER", choices=("hf", "lightning", "accelerate", "loop"),
                    help="also print the lines that apply the recommendation in that trainer: hf (the transformers "
                         "Trainer), lightning, accelerate (a loop of your own on an Accelerator) or loop (a loop of "
                         "your own through Tricks); `torch-tricks emit` prints them later for a tricks.toml")
    sp.add_argument("--threads", type=int, metavar="N",
                    help="intra-op CPU threads for the whole tune, 1 to the cores this process may use (default: "
                         "torch's own)")
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
    """Train ``--model`` (else the model --config's [model] table records, else small_cnn) on ``--data``."""
    from torch_tricks._io import atomic_path
    from torch_tricks.outputs import get_loss
    from torch_tricks.seed import seed_everything
    from torch_tricks.train import fit
    from torch_tricks.train.distributed import cleanup, is_main_process

    run = _what_to_train(args)
    config = _train_config(args, run.batch)
    seed_everything(config.seed)  # the initial weights too come from the seed
    model = _build(run, args.config)
    train_set, val_set = _train_data(run, model, args)
    loss = args.loss or run.loss
    history = fit(model, train_set, val_set, config=config, loss_fn=get_loss(loss) if loss else None)
    main_rank = is_main_process()
    cleanup()  # leave the process group (a no-op outside torchrun)
    if not main_rank:  # under torchrun, rank 0 reports
        return 0
    data = history.to_dict()
    if args.out:
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(data, indent=2, default=str))
    emit(args, data, history.to_text(run.model, run.data))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from torch_tricks.batches import example_batch
    from torch_tricks.data.token_batches import longest_batch
    from torch_tricks.outputs import get_loss
    from torch_tricks.train.distributed import get_rank
    from torch_tricks.tuning import parse_size, tune

    limit = parse_size(args.memory_limit) if args.memory_limit else None
    if args.threads is not None:  # checked before anything is built; the tune then measures at N threads
        from torch_tricks.machine import set_threads

        set_threads(args.threads, what="--threads")
    if args.emit:  # a bad target, or a trainer not installed, is said before the tune, not after it
        from torch_tricks.integrations import EMIT_TITLES, emit_lines

        emit_lines({}, args.emit)
    model, inputs, specs = load_with_specs(args)
    rows = _tune_token_rows(args, model)
    if rows is not None:  # the worst case first: the batch of the data's longest rows
        batch, loss_fn = longest_batch(rows, args.batch), get_loss(args.loss)
    else:
        batch, loss_fn = example_batch(model, inputs, seed=args.seed, loss=args.loss)
    rank = get_rank()  # under torchrun: rank 0 prints and writes
    report = tune(model, batch, loss_fn, optimizer=args.optimizer, lr=args.lr, device=args.device,
                  budget_s=args.budget_seconds, memory_limit=limit, data=rows if rows is not None else args.data,
                  deploy=args.deploy,
                  seed=args.seed, progress=args.progress and rank == 0, name=args.model, skip=args.skip or (),
                  processes=args.processes, steps=args.steps, fit=args.fit)
    if rank != 0:
        return 0
    if rows is not None:
        report.notes.append(_longest_note(rows, batch))
    report.model_record = _model_record(args, specs, report)
    if args.emit:
        source = str(Path(args.out) / "tricks.toml") if args.out else None  # the lines name the file written
        report.emit = {"target": args.emit, "title": EMIT_TITLES[args.emit],
                       "lines": emit_lines(report.recommended_config(), args.emit, source=source)}
    text, data = report.to_text(), report.to_dict()
    if report.emit:
        text += f"\n\nthe recommendation in your {report.emit['title']} script:\n" + "\n".join(report.emit["lines"])
        data["emit"] = report.emit
    if args.out:
        paths = report.write(args.out)
        text += "\nwritten: " + ", ".join(str(p) for p in paths.values())
    emit(args, data, text)
    return 0


def _tune_token_rows(args: argparse.Namespace, model: Any) -> Any:
    """The token set of ``--data`` (rows of different lengths), or None for any other --data."""
    from torch_tricks.data.token_sets import is_token_set

    if not args.data or not is_token_set(args.data):
        if args.tokenizer is not None or args.truncate:
            raise UserError(f"{'--tokenizer' if args.tokenizer is not None else '--truncate'} is for a token set "
                            "(--data FOLDER, FILE.jsonl or FILE.parquet): give one, or leave the flag out")
        return None
    if args.input:
        raise UserError("give --input or a token set in --data, not both: the tune's batch is the data's longest rows")
    return _token_set(_Run(args.model, args.hf_config, None, None, args.data, False, True), model, args)


def _longest_note(rows: Any, batch: dict[str, Any]) -> str:
    n, width = batch["input_ids"].shape
    return (f"tuned on the data's {n} longest rows, padded to {width} tokens (of {len(rows):,} rows, lengths "
            f"{min(rows.lengths)}-{max(rows.lengths)}): the largest batch any sampler forms, so what fits here fits "
            "the whole epoch")


def cmd_ckpt_export(args: argparse.Namespace) -> int:
    from torch_tricks.train.sharded_checkpoint import export_checkpoint

    info = export_checkpoint(args.src, args.out)
    emit(args, info.to_dict(), info.to_text())
    return 0


# -- internals -------------------------------------------------------------------------------------

def _train_config(args: argparse.Namespace, tuned_batch: int | None = None) -> Any:
    """The TrainConfig of ``--config`` (if given) with the switches given as flags on top, validated;
    ``tuned_batch`` (the [model] table's) is the batch where the file states none: the batch the tune
    measured, which the user gave it."""
    import dataclasses

    from torch_tricks.train import TrainConfig, load_config

    values = load_config(args.config) if args.config else {}
    if tuned_batch is not None:
        values.setdefault("batch_size", tuned_batch)
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
        elif f.name == "compile":
            group.add_argument(flag, dest=f.name, nargs="?", const=True, default=None, metavar="MODE",
                               help="torch.compile: the default mode when given alone, or reduce-overhead (CUDA), "
                                    "max-autotune, max-autotune-no-cudagraphs")
            group.add_argument("--no-compile", dest=f.name, action="store_false", default=None, help="no torch.compile")
        elif f.name == "checkpointing":
            group.add_argument(flag, dest=f.name, nargs="?", const="blocks", default=None,
                               help="checkpoint activations: blocks (default when given), sqrt, or a module-name glob")
        else:
            group.add_argument(flag, dest=f.name, type=typ, default=None, help=f"(default {f.default!r})")


# -- train: which model, on which data -------------------------------------------------------------

_SETS = "or a token set of rows: a data set saved with save_to_disk (a folder), FILE.jsonl or FILE.parquet"

@dataclass
class _Run:
    """What ``train`` trains: the model reference and its overrides, its input specs where known, the data."""

    model: str
    hf_config: str | None
    inputs: list[str] | None
    loss: str | None
    data: str
    recorded: bool  # the model is the one --config's [model] table names
    data_given: bool = True  # --data was given (else the default, digits)
    batch: int | None = None  # the batch the tune measured (recorded models)


def _what_to_train(args: argparse.Namespace) -> _Run:
    """``--model`` wins; else the [model] table of ``--config``; else small_cnn on digits, as ever."""
    from torch_tricks.tuning.record import read_model_record

    record = read_model_record(args.config) if args.config else None
    if args.model:
        return _Run(args.model, args.hf_config, None, None, args.data or "digits", False, bool(args.data))
    if record == {}:
        raise UserError(f"{args.config} was tuned from Python and does not name a model this command can build: "
                        "give --model (a built-in name, package.module:factory or hf:TYPE)")
    if record is None:
        return _Run("small_cnn", args.hf_config, None, None, args.data or "digits", False, bool(args.data))
    inputs = record.get("input")
    data = args.data or _recorded_data(record["spec"], inputs, args.config)
    return _Run(record["spec"], args.hf_config or record.get("hf_config"), inputs, record.get("loss"), data, True,
                batch=record.get("batch"))


def _recorded_data(spec: str, inputs: list[str] | None, config: str) -> str:
    """The built-in data set a recorded model trains on without --data (digits, for 1x8x8 images); else a
    UserError saying what --data it needs."""
    from torch_tricks.data.tokens import FORM

    kind = _input_kind(inputs)
    if kind == "unknown":
        raise UserError(f"{config}'s [model] {spec} records no input, so no data set can be chosen for it: give "
                        f"--data (digits, or {FORM})")
    if kind == "tokens":
        raise UserError(f"{config}'s model {spec} trains on token data: give --data TOKENS, {FORM}; {_SETS}")
    _check_digits_fit(spec, inputs, kind)
    return "digits"


def _input_kind(inputs: list[str] | None) -> str:
    """``tokens`` (an integer input that is not a mask), ``digits`` (one 1x8x8 image), ``other``, or ``unknown``."""
    from torch_tricks.inspect.inputs import parse_input_specs

    specs = parse_input_specs(inputs) if inputs else []
    if not specs:
        return "unknown"
    if any(not s.dtype.is_floating_point and s.fill is None for s in specs):
        return "tokens"
    return "digits" if [(s.name, s.shape) for s in specs] == [(None, (1, 8, 8))] else "other"


def _check_digits_fit(spec: str, inputs: list[str] | None, kind: str) -> None:
    if kind == "other":
        raise UserError(f"the model {spec} takes {', '.join(inputs or [])} inputs, which no built-in data set holds "
                        "(digits: 1x8x8 images): train it from Python, fit(model, data, config=FILE)")


def _build(run: _Run, config: str | None) -> Any:
    """The model of ``run``; a recorded one that cannot be built here says where it came from."""
    from torch_tricks.models import load_model

    try:
        return load_model(run.model, hf_config=run.hf_config)[0]
    except UserError as exc:
        if not run.recorded:
            raise
        raise UserError(f"{config}'s [model] {run.model} cannot be built here: {exc} (or give --model)") from None


def _train_data(run: _Run, model: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """``(train, val)`` of ``run.data``: a token set or a token file (no validation split), or a built-in data set."""
    from torch_tricks.data.digits import DATASETS
    from torch_tricks.data.token_sets import is_token_set
    from torch_tricks.data.tokens import is_token_file

    if run.data not in DATASETS and is_token_set(run.data):  # a folder named like a built-in set is still the set
        return _token_set(run, model, args), None
    if args.tokenizer is not None or args.truncate:
        flag = "--tokenizer" if args.tokenizer is not None else "--truncate"
        raise UserError(f"{flag} is for a token set (--data FOLDER, FILE.jsonl or FILE.parquet); --data {run.data} "
                        f"is not one: leave {flag} out")
    if is_token_file(run.data):
        return _token_data(run, model, args.seq), None
    if args.seq is not None:
        raise UserError(f"--seq sets the sequence length of token data (--data FILE.bin or FILE.npy); {run.data} "
                        "is a built-in data set: leave --seq out")
    return _builtin_data(run, model)


def _token_set(run: _Run, model: Any, args: argparse.Namespace) -> Any:
    """Rows of different lengths, each at most the model's positions; what was read is said on stderr."""
    import sys

    from torch_tricks.data.token_sets import load_token_rows
    from torch_tricks.train.distributed import is_main_process
    from torch_tricks.tuning.fit import max_positions

    _need_causal_lm(run, model)
    if getattr(args, "seq", None) is not None:
        raise UserError(f"--seq sets the window length of a 1-D token file; the rows of {run.data} keep their own "
                        "lengths (up to the model's positions, --truncate cuts longer ones): leave --seq out")
    rows = load_token_rows(run.data, tokenizer=args.tokenizer, max_positions=max_positions(model),
                           truncate=args.truncate, vocab_size=_vocab_size(model))
    if is_main_process():
        print(f"data: {rows.summary()}", file=sys.stderr, flush=True)
    return rows


def _need_causal_lm(run: _Run, model: Any) -> None:
    from torch_tricks.inspect.inputs import is_causal_lm

    if not is_causal_lm(model):
        raise UserError(f"--data {run.data} is token data, for a transformers causal LM (e.g. --model hf:gpt2); "
                        f"{run.model} ({type(model).__name__}) is not one")


def _token_data(run: _Run, model: Any, seq: int | None) -> Any:
    from torch_tricks.data.tokens import TokenDataset
    from torch_tricks.tuning.fit import max_positions

    _need_causal_lm(run, model)
    positions = max_positions(model)
    if seq is None:
        seq = _recorded_seq(run.inputs) or positions
    if seq is None:
        raise UserError(f"give --seq N: neither the [model] table nor {run.model}'s config gives a sequence length")
    if positions and seq > positions:
        raise UserError(f"--seq {seq} is longer than {run.model}'s {positions} positions: give --seq {positions} or "
                        "less, or more positions in --hf-config")
    return TokenDataset(run.data, seq, vocab_size=_vocab_size(model))


def _recorded_seq(inputs: list[str] | None) -> int | None:
    """The token input's length in the recorded specs: ``input_ids``'s, else the first integer input's."""
    from torch_tricks.inspect.inputs import parse_input_specs

    specs = [s for s in parse_input_specs(inputs) if not s.dtype.is_floating_point] if inputs else []
    spec = next((s for s in specs if s.name == "input_ids"), specs[0] if specs else None)
    return spec.shape[-1] if spec is not None else None


def _vocab_size(model: Any) -> int | None:
    """The ids ``model`` has embeddings for."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    return n if isinstance(n, int) else getattr(getattr(model, "config", None), "vocab_size", None)


def _builtin_data(run: _Run, model: Any) -> tuple[Any, Any]:
    """A built-in data set (images): refused for a model that takes token ids, or a recorded one of another shape."""
    from torch_tricks.data import DATASETS, load_dataset
    from torch_tricks.data.tokens import FORM
    from torch_tricks.inspect.inputs import is_causal_lm
    from torch_tricks.models import list_models, model_spec

    if run.data not in DATASETS:
        raise UserError(f"unknown --data {run.data!r}: a built-in data set ({', '.join(DATASETS)}), or {FORM}; "
                        f"{_SETS}")
    default = model_spec(run.model).default_input if run.model in list_models() else None
    specs = run.inputs or ([default] if default else None)
    kind = _input_kind(specs)
    if is_causal_lm(model) or kind == "tokens":
        given = f"--data {run.data} holds images, and " if run.data_given else ""
        raise UserError(f"{given}{run.model} trains on token ids: give --data TOKENS, {FORM}; {_SETS}")
    if run.recorded:  # a model of the user's choice (--model) meets the data as before: its forward says it
        _check_digits_fit(run.model, specs, kind)
    return load_dataset(run.data)


# -- tune: what it ran on ----------------------------------------------------------------------------

def _model_record(args: argparse.Namespace, specs: list[str], report: Any) -> dict[str, Any]:
    """tricks.toml's [model]: the model, its overrides and inputs as the tune ran them (``--fit`` may have
    changed the batch or the sequence length from the flags')."""
    from torch_tricks.tuning.record import model_record

    return model_record(args.model, hf_config=args.hf_config, inputs=_as_run(specs, report.inputs),
                        batch=report.batch, loss=args.loss, device=args.device)


def _as_run(specs: list[str], shapes: list[list[int]]) -> list[str]:
    """``specs`` as given, or, where the tune ran other shapes (``--fit seq=N``), re-written with those."""
    import dataclasses

    from torch_tricks.inspect.inputs import parse_input_specs

    parsed = parse_input_specs(specs)
    if len(parsed) != len(shapes) or all(list(s.shape) == shape for s, shape in zip(parsed, shapes)):
        return list(specs)
    return [str(dataclasses.replace(s, shape=tuple(shape))) for s, shape in zip(parsed, shapes)]
