"""Garbage collections that scan only what a block of work made (``gc.freeze``).

A full ``gc.collect()`` in a process holding millions of objects (transformers imported,
a notebook, a test session) takes a good part of a second, and the measurements that
need the garbage gone before they read memory (the tune before and after every memory
measurement, the leak check after every step) collect dozens of times. Inside
:func:`new_objects_only`, the objects that existed before are in gc's permanent
generation: each collection scans only what the block made, and nothing the block made
escapes a collection. Written here because ``gc`` offers the pieces, not the scope.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["new_objects_only"]


@contextlib.contextmanager
def new_objects_only() -> Iterator[bool]:
    """Within the block, collections scan only the objects made in it; yields whether it froze.

    One full collection first (garbage frozen would hold its memory until the end), then
    ``gc.freeze()``; ``gc.unfreeze()`` at the end. A caller that froze objects itself
    keeps its freeze: nothing is frozen or unfrozen, and collections stay full (yields
    False). ``gc.get_objects()`` inside the block lists only the new objects too.
    """
    if gc.get_freeze_count():
        yield False
        return
    gc.collect()
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()
