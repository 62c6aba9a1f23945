"""Merge, don't replace: the tuned keywords set into the user's own trainer arguments (issue 34, item 2).

A user who already trains has arguments of their own (``TrainingArguments(learning_rate=3e-4, ...)``,
``lightning.Trainer(max_epochs=3, ...)``). The configuration's keywords are set into them one by one:

* a keyword the user did not set (absent, or at the trainer's own default) takes the tuned value, and is
  named in :attr:`Tuned.tricks_changes` with the value it had;
* a keyword the user set to the same value is left alone;
* a keyword the user set to another value is a conflict: one line naming both values and the key that
  gave the tuned one, unless ``prefer`` says which wins (``"tuned"`` or ``"yours"``);
* list keywords (Lightning's ``callbacks``) are joined, the user's first.

Written here rather than taken from a library: each trainer has its own argument object and none merges a
second set of values into it with conflicts named.
"""

from __future__ import annotations

import enum
from typing import Any

from torch_tricks.errors import UserError

__all__ = ["PREFER", "Tuned", "merge"]

PREFER = ("tuned", "yours")


class Tuned(dict):
    """The merged keywords; :attr:`tricks_changes` maps each keyword the configuration changed to ``(old, new)``."""

    tricks_changes: dict[str, tuple[Any, Any]]


def merge(tuned: dict[str, tuple[Any, str]], yours: dict[str, Any], *, explicit: set[str],
          defaults: dict[str, Any], prefer: str | None, where: str) -> Tuned:
    """``yours`` with the ``tuned`` keywords (each ``(value, config key)``) set, as the module doc says.

    ``explicit``: the keywords of ``yours`` the user set (a conflict is possible only there); ``defaults``: the
    trainer's own value of a keyword the user did not give (the ``old`` of a change); ``where``: the user's
    object in words, for the conflict line.
    """
    check_prefer(prefer)
    out = Tuned(yours)
    out.tricks_changes = {}
    conflicts = []
    for name, (value, key) in tuned.items():
        old = yours.get(name, defaults.get(name))
        if isinstance(value, list):
            out[name] = list(yours.get(name) or []) + value
            continue
        if same(old, value):
            continue
        if name in explicit and prefer != "tuned":
            if prefer is None:
                conflicts.append(f"{name}={show(old)} in {where}, {name}={show(value)} from the configuration's "
                                 f"{key}")
            continue
        out[name] = value
        out.tricks_changes[name] = (old, value)
    if conflicts:
        raise UserError(f"conflict: {'; '.join(conflicts)}: remove one, or pass prefer='tuned' (the configuration "
                        "wins) or prefer='yours'")
    return out


def check_prefer(prefer: str | None) -> None:
    if prefer is not None and prefer not in PREFER:
        raise UserError(f"prefer={prefer!r}: use 'tuned' (the configuration wins a conflict), 'yours', or None "
                        "(a conflict is an error)")


def same(a: Any, b: Any) -> bool:
    """Equal once each trainer's own forms are undone (enums to their values, one-item lists, reprs of objects)."""
    return plain(a) == plain(b)


def plain(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (list, tuple)):
        items = [plain(x) for x in v]
        return items[0] if len(items) == 1 else items
    if isinstance(v, (str, int, float, bool, type(None), dict)):
        return v
    return repr(v)


def show(v: Any) -> str:
    return repr(plain(v))
