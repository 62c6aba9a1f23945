"""Several scripts of this folder, one after another, in one torchrun launch.

Usage: torchrun --standalone --nproc_per_node=2 run_jobs.py SCRIPT ARG... [--- SCRIPT ARG...]...

Each launch costs seconds before any work (the launcher and every rank import torch), so the
scripts that need no launch of their own (none of them kills a rank) share one. The process
group is joined once and kept between jobs: each script's closing ``cleanup()`` only meets the
other ranks here (a group destroyed and joined again within one torchrun job can read the old
group's addresses from the job's store); the real ``cleanup`` runs after the last job. A script that
exits (``sys.exit``) ends only itself; the launch exits with the first nonzero status.
"""

from __future__ import annotations

import gc
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

import torch_tricks.train.distributed as D

leave = D.cleanup


def _between_jobs() -> None:
    gc.collect()  # what holds the group (DDP, FSDP's hooks) goes before the next job builds its own
    if D.is_dist():
        dist.barrier()


D.cleanup = _between_jobs  # the scripts import it by name when they run, so they get this one
jobs: list[list[str]] = [[]]
for arg in sys.argv[1:]:
    if arg == "---":
        jobs.append([])
    else:
        jobs[-1].append(arg)
status = 0
for script, *args in jobs:
    sys.argv = [script, *args]
    try:
        runpy.run_path(str(Path(__file__).parent / script), run_name="__main__")
    except SystemExit as exc:  # a script's own exit ends that script, not the launch; the first failure is its status
        status = status or (exc.code if isinstance(exc.code, int) else 1)
leave()
sys.exit(status)
