"""Launching ``torchrun --standalone`` from the tests: 2 CPU ranks on gloo, bounded in time.

``--standalone`` lets the rendezvous bind a free port itself, so parallel runs cannot collide
on a port. The launcher gets a session of its own: past its timeout the whole process group
(the launcher and every rank) is killed and the test fails with the log's tail, so a hang
fails a test instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "dist_scripts"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def need_gloo() -> None:
    """Skip the calling test or fixture where this torch build cannot run gloo ranks."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")


def start(script: Path, *args: str, nproc: int = 2) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=nproc script args...``, one intra-op thread per rank."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait(proc: subprocess.Popen, timeout: float = 240, ok: bool | None = True) -> str:
    """The launch's log, once it ended as ``ok`` says (None: either way; its whole process group killed past
    ``timeout``)."""
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s; log tail:\n{log[-3000:]}")
    assert ok is None or (proc.returncode == 0) == ok, log[-4000:]
    return log


def run(script: Path, *args: str, timeout: float = 240, ok: bool = True) -> str:
    return wait(start(script, *args), timeout, ok)
