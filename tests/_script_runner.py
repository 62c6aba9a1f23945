"""Runs Python scripts as ``python SCRIPT`` would, each in a process of its own forked from this one, which
imported torch, transformers and accelerate once (tests/conftest.py's ``run_script`` starts it).

The trainer-integration tests run the lines the package prints, pasted into a script, in a fresh process: on 2
cores such a process spent 6-8 s importing those libraries before the script's first line, once per script. A
forked child starts with them imported; everything else is its own: ``torch_tricks`` (never imported here), the
script's ``__main__``, ``sys.argv``, ``sys.path[0]`` (the script's folder), the working directory, its exit status,
and its stdout and stderr (to files, at the file-descriptor level).

Protocol: one JSON request a line on stdin (``script``, ``cwd``, ``stdout``, ``stderr``: paths), one JSON reply a
line on stdout (``returncode``: the child's exit status, negative for a signal, as :mod:`subprocess` has it).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys
import traceback

# the third-party modules the printed scripts import (nothing of torch_tricks: each script imports it afresh)
PRELOAD = ("torch", "torch.utils.data", "transformers", "transformers.models.gpt2.modeling_gpt2",
           "transformers.trainer", "accelerate")


def main() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script imports it itself, and fails there as it would alone
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # does not return
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict) -> None:
    code = 1
    try:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.stdin = open(os.devnull)
        os.chdir(request["cwd"])
        script = os.path.abspath(request["script"])
        sys.argv = [script]
        sys.path[0] = os.path.dirname(script)
        code = _run(script)
        atexit._run_exitfuncs()  # as the interpreter does at its exit
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(script: str) -> int:
    """The script as ``__main__``; its exit status as the interpreter would give it."""
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    main()
