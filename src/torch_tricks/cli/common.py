"""What the commands share: the options defined once, loading a model and its inputs, printing a result.

Every command takes ``--json`` (the result as JSON instead of text) and ``--debug`` (a
traceback instead of the one-line error); long commands take ``--no-progress``; the
commands that build a model take the same model and input options.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from torch_tricks.errors import UserError

DEFAULT_MODEL = "resnet18"
INPUT_HELP = ("input shape without the batch, e.g. 3x224x224; integer tokens as long:128:VOCAB; ones:128 or "
              "zeros:128 for int64 masks; NAME=SPEC passes a keyword input to the forward, e.g. "
              "input_ids=long:128:50257 and attention_mask=ones:128 (name every input or none); repeat or "
              "comma-separate for several inputs (default: the model's own)")
HF_CONFIG_HELP = ("config overrides of a transformers model (--model hf:gpt2, hf:bert:classification, "
                  "path/to/config.json), e.g. n_layer=2,n_embd=64,n_head=2")


def add_common(sp: argparse.ArgumentParser, *, json_help: str = "print JSON instead of a table",
               progress: bool = False) -> None:
    """``--json`` and ``--debug`` (every command), ``--no-progress`` (commands with a progress bar)."""
    sp.add_argument("--json", action="store_true", help=json_help)
    sp.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    if progress:
        sp.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def add_model_options(sp: argparse.ArgumentParser, batch: int = 1) -> None:
    """``--model --input --hf-config --batch --device`` and the common options."""
    sp.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"built-in model name (see `torch-tricks models`) or package.module:factory "
                         f"(default {DEFAULT_MODEL})")
    sp.add_argument("--input", action="append", metavar="[NAME=]SPEC", help=INPUT_HELP)
    sp.add_argument("--hf-config", metavar="KEY=VALUE,...", help=HF_CONFIG_HELP)
    sp.add_argument("--batch", type=int, default=batch, help=f"batch size (default {batch})")
    sp.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")
    add_common(sp)


def add_loss_option(sp: argparse.ArgumentParser) -> None:
    """``--loss KIND`` of the step that memory / time / profile measure (default: no target)."""
    from torch_tricks._losses import LOSSES

    sp.add_argument("--loss", choices=LOSSES, metavar="KIND",
                    help=f"loss of the measured training step: {', '.join(LOSSES)}, built against a target "
                         "made for it (auto: the model's own .loss, else cross-entropy for class or token "
                         "logits, mse otherwise); default: the sum of the output means, with no target")


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """Model and example inputs from --model/--input/--hf-config/--batch/--device."""
    model, inputs, _ = load_with_specs(args)
    return model, inputs


def load_with_specs(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """:func:`load`, and the input specs the inputs were made from (``--input`` as given, else the
    model's default): what a tune records of the model it ran on."""
    from torch_tricks.device import resolve as resolve_device
    from torch_tricks.inspect.inputs import check_input_names, make_inputs, parse_input_specs
    from torch_tricks.models import load_model

    device = resolve_device(args.device, what="--device")
    model, default_input = load_model(args.model, hf_config=getattr(args, "hf_config", None))
    spec = list(args.input) if args.input else [default_input] if default_input else []
    if not spec:
        raise UserError(f"--input is required for {args.model}: give its input shape, e.g. --input 3x224x224")
    inputs = make_inputs(parse_input_specs(spec), args.batch, model=model, device=device)
    if isinstance(inputs, dict):  # keyword inputs: a name the forward does not take would be dropped or raise
        check_input_names(model, inputs)
    return model.to(device), inputs, spec


def measured_step(args: argparse.Namespace, model: Any, inputs: Any) -> tuple[Any, Any, Any]:
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


def emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    """The result: ``data`` as JSON under ``--json``, else ``text``."""
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)
