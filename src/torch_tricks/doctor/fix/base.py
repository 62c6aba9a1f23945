"""The types the fix modules share: what a fix did (:class:`Edit`), what it left (:class:`Unfixed`),
the results (:class:`FixResult`, :class:`FileFix`), :class:`FixError`, and, inside the package, a
planned fix (``_Fix``) and why a finding cannot be fixed (``_NotFixable``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch_tricks.doctor import Finding


class FixError(RuntimeError):
    """A fix produced source that does not parse, or not the intended tree: a bug; nothing is written."""


@dataclass(frozen=True)
class Edit:
    """One applied fix: the findings it removes (``rules``), where (line of the original source)."""

    rules: tuple[str, ...]
    line: int  # where the (first) finding was reported
    description: str
    span: tuple[int, int] = (0, 0)  # the first and last original lines the edit changes

    @property
    def rule(self) -> str:
        return ",".join(self.rules)


@dataclass(frozen=True)
class Unfixed:
    """A finding of a fixable rule left as it is, and why."""

    finding: Finding
    reason: str


@dataclass
class FixResult:
    """The fixed source, the edits made (in source order) and the findings not fixable there."""

    source: str
    edits: list[Edit] = field(default_factory=list)
    unfixed: list[Unfixed] = field(default_factory=list)
    original: str = ""

    @property
    def changed(self) -> bool:
        return self.source != self.original

    @property
    def fixed(self) -> int:
        """How many findings the edits removed."""
        return sum(len(e.rules) for e in self.edits)


@dataclass
class FileFix:
    """What fixing one file did (or, with ``write=False``, would do)."""

    path: str
    edits: list[Edit] = field(default_factory=list)
    unfixed: list[Unfixed] = field(default_factory=list)
    diff: str = ""  # unified diff, original -> fixed; "" when nothing changes
    written: bool = False
    error: str | None = None  # not fixed: does not parse, cannot be read or written, FixError
    unreadable: bool = False  # the error is that it cannot be read or parsed (the lint reports it too)

    @property
    def fixed(self) -> int:
        return sum(len(e.rules) for e in self.edits)

    def to_dict(self) -> dict:
        return {"path": self.path, "fixed": self.fixed, "written": self.written, "error": self.error,
                "unreadable": self.unreadable,
                "edits": [{"rules": list(e.rules), "line": e.line, "lines": list(e.span), "description": e.description}
                          for e in self.edits],
                "unfixed": [{**u.finding.to_dict(), "reason": u.reason} for u in self.unfixed],
                "diff": self.diff}

    as_dict = to_dict  # the earlier name; every result type of the package says to_dict


@dataclass
class _Fix:
    rules: tuple[str, ...]
    line: int
    description: str
    edits: list[tuple[int, int, str]]  # (start, end, new text), character offsets into the source
    mutate: Callable[[dict], None]  # the same change on a copy of the tree (old node id -> copied node)


class _NotFixable(Exception):
    pass
