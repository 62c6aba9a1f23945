"""The tune's configuration where users already train: transformers' Trainer, Lightning, Accelerate (issue 22).

:mod:`~torch_tricks.integrations.mapping` holds the one table of where each ``[train]`` key goes in each
of them; :mod:`.hf`, :mod:`.lightning` and :mod:`.accelerate` turn a configuration into that trainer's own
arguments, and apply the switches it has no argument for.
"""

from torch_tricks.integrations.mapping import TARGETS, Route, place_table, routes

__all__ = ["TARGETS", "Route", "routes", "place_table"]
