"""The ``torch-tricks`` command line: parses arguments, calls the library, prints.

Bad input (an unknown model, a wrong shape, a missing file) prints one line on stderr
and exits with status 2; ``--debug`` shows the traceback instead.

One module per area (``cmd_inspect``, ``cmd_train``, ``cmd_emit``, ``cmd_data``, ``cmd_deploy``,
``cmd_doctor``), each adding its commands to the parser; the options every command shares
(``--json``, ``--debug``, ``--no-progress``, the model and input options) are defined once in
:mod:`torch_tricks.cli.common`. The library is imported inside the commands, so that
``torch-tricks --help`` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Sequence

from torch_tricks.cli import cmd_data, cmd_deploy, cmd_doctor, cmd_emit, cmd_inspect, cmd_train
from torch_tricks.errors import UserError

__all__ = ["main", "build_parser"]

_AREAS = (cmd_inspect, cmd_train, cmd_emit, cmd_doctor, cmd_data, cmd_deploy)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (2: bad input, 130: interrupted)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("-v", "--verbose") for a in argv)  # accepted before or after the command
    args = parser.parse_args([a for a in argv if a not in ("-v", "--verbose")])
    args.debug = "--debug" in argv  # accepted before or after the command
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return _run(args, verbose or args.debug)


def _run(args: argparse.Namespace, verbose: bool) -> int:
    """The command's exit status; bad input and an interrupt become one line on stderr."""
    try:
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
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: the global options, then each area's commands in the order ``--help`` lists them."""
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
    for area in _AREAS:
        area.add_commands(sub)
    return p
