"""The tune's configuration where users already train: transformers' Trainer, Lightning, Accelerate (issue 22).

:mod:`~torch_tricks.integrations.mapping` holds the one table of where each ``[train]`` key goes in each
of them; :mod:`.hf`, :mod:`.lightning` and :mod:`.accelerate` turn a configuration into that trainer's own arguments and
apply the switches it has no argument for; :func:`emit_lines` gives the lines of a script for one of them.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch_tricks.errors import UserError
from torch_tricks.integrations.mapping import TARGETS, Route, place_table, places, routes

__all__ = ["TARGETS", "EMIT_TARGETS", "EMIT_TITLES", "Route", "emit_lines", "routes", "places", "place_table"]

EMIT_TARGETS = ("hf", "lightning", "accelerate", "loop")
EMIT_TITLES = {"hf": "transformers Trainer", "lightning": "lightning.Trainer", "accelerate": "Accelerate",
               "loop": "own training loop"}


def emit_lines(cfg: Any, target: str, source: str | None = None) -> list[str]:
    """The lines of a ``target`` training script that carry ``cfg`` (a path to ``tricks.toml``, a ``TrainConfig``
    or a dict of its keys): what ``tune --emit`` and ``torch-tricks emit`` print. ``source``: how the script
    names the configuration (the path of tricks.toml); default: the keys it was given, written out."""
    if target not in EMIT_TARGETS:
        raise UserError(f"--emit {target}: give one of {', '.join(EMIT_TARGETS)}")
    return importlib.import_module(f"torch_tricks.integrations.{target}").trainer_lines(cfg, source)
