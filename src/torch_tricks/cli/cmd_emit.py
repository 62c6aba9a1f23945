"""``emit``: the lines that carry a tricks.toml already written into a trainer, without a new tune."""

from __future__ import annotations

import argparse
from typing import Any

from torch_tricks.cli.common import add_common, emit


def add_commands(sub: Any) -> None:
    sp = sub.add_parser("emit", help="print the lines that apply a tricks.toml in your trainer (no new tune)")
    sp.add_argument("--config", metavar="FILE", required=True, help="the tricks.toml (or a .yaml of [train] keys)")
    sp.add_argument("--for", dest="target", metavar="TRAINER", required=True,
                    help="hf (the transformers Trainer), lightning, accelerate (a loop of your own on an "
                         "Accelerator) or loop (a loop of your own through Tricks)")
    add_common(sp, json_help="print the lines as JSON")
    sp.set_defaults(func=cmd_emit)


def cmd_emit(args: argparse.Namespace) -> int:
    from torch_tricks.integrations import EMIT_TARGETS, EMIT_TITLES, emit_lines
    from torch_tricks.errors import UserError

    if args.target not in EMIT_TARGETS:  # before reading the file: the one line names what to give
        raise UserError(f"--for {args.target}: give one of {', '.join(EMIT_TARGETS)}")
    lines = emit_lines(args.config, args.target, source=args.config)
    emit(args, {"target": args.target, "title": EMIT_TITLES[args.target], "config": args.config, "lines": lines},
         "\n".join(lines))
    return 0
