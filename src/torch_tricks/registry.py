"""The trick registry: every trick is registered once, so the tuner and the docs can list it.

A trick is a small function that takes a model / optimizer / loader and returns the same
kind of thing; :func:`register_trick` records what it is for (catalogue id, what it
trades, what it needs, which ``fit`` config key switches it on, which benchmark measures it, and whether it can
run on a given device) without changing the function itself. ``docs/tricks.md`` is
generated from this registry (:mod:`torch_tricks._docs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from torch_tricks.errors import UserError

__all__ = ["Trick", "register_trick", "unregister_trick", "list_tricks", "get_trick", "trick_name", "always"]


def always(device: torch.device) -> tuple[bool, str]:
    """Availability check for tricks that run anywhere."""
    return True, ""


@dataclass(frozen=True)
class Trick:
    """What the registry knows about one trick."""

    name: str  # unique, snake_case: "checkpointing"
    ids: tuple[str, ...]  # catalogue ids: ("T12",)
    kind: str  # "train" | "data" | "deploy"
    trades: str  # what it costs for what it gains, one line
    needs: str  # what it requires of the model / hardware, one line
    fn: Callable[..., Any]
    config_key: str | None = None  # the fit() config field that switches it on
    measured_in: str = ""  # the benchmark script that measures it: "benchmarks/train_tricks.py"
    switch_on: str = ""  # how to switch it on where config_key does not say: "torch-tricks optimize --steps fuse"
    available: Callable[[torch.device], tuple[bool, str]] = always
    aliases: tuple[str, ...] = ()  # earlier names that still find it: get_trick("fuse_conv_bn") is "fuse"

    def check(self, device: torch.device | str) -> tuple[bool, str]:
        """(can run on ``device``, reason if not)."""
        return self.available(torch.device(device))


_TRICKS: dict[str, Trick] = {}
_ALIASES: dict[str, str] = {}  # earlier name -> name


def register_trick(
    name: str,
    *,
    ids: tuple[str, ...],
    kind: str,
    trades: str,
    needs: str = "",
    config_key: str | None = None,
    measured_in: str = "",
    switch_on: str = "",
    available: Callable[[torch.device], tuple[bool, str]] = always,
    aliases: tuple[str, ...] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register ``fn`` as the trick ``name``; the function is returned unchanged.

    ``aliases`` are earlier names that :func:`get_trick` still resolves to this trick (a
    renamed trick keeps the user code and tune reports that name it working)."""
    if kind not in ("train", "data", "deploy"):
        raise ValueError(f"trick kind must be train, data or deploy, not {kind!r}")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for n in (name, *aliases):
            if n in _TRICKS or n in _ALIASES:
                raise ValueError(f"trick {n!r} is registered twice")
        _TRICKS[name] = Trick(name, tuple(ids), kind, trades, needs, fn, config_key, measured_in, switch_on, available,
                              tuple(aliases))
        _ALIASES.update(dict.fromkeys(aliases, name))
        return fn

    return deco


def unregister_trick(name: str) -> None:
    """Remove the trick ``name`` and its aliases (a trick registered for a test, say)."""
    trick = _TRICKS.pop(name)
    for alias in trick.aliases:
        _ALIASES.pop(alias, None)


def list_tricks(kind: str | None = None) -> list[Trick]:
    """Registered tricks (of ``kind``), sorted by name. Importing the subpackages registers them."""
    _load_all()
    return sorted((t for t in _TRICKS.values() if kind is None or t.kind == kind), key=lambda t: t.name)


def get_trick(name: str) -> Trick:
    """The trick ``name``; a :class:`UserError` listing the choices if unknown."""
    _load_all()
    try:
        return _TRICKS[_ALIASES.get(name, name)]
    except KeyError:
        raise UserError(f"unknown trick {name!r}: choose one of {', '.join(sorted(_TRICKS))}") from None


def trick_name(name: str) -> str:
    """The registered name for ``name``: itself, or the trick it is an earlier name of."""
    _load_all()
    return _ALIASES.get(name, name)


def _load_all() -> None:
    """Import the packages whose modules register tricks (idempotent, cheap after the first call)."""
    import importlib

    for pkg in ("torch_tricks.train", "torch_tricks.data", "torch_tricks.deploy"):
        try:
            module = importlib.import_module(pkg)
        except ModuleNotFoundError as exc:
            if exc.name != pkg:  # a real missing dependency inside the package
                raise
            continue
        if hasattr(module, "register_all"):  # a package that imports its modules on first use
            module.register_all()
