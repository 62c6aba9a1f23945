"""``docs/tricks.md``, generated from the trick registry, and the links ``doctor --explain`` prints.

:func:`tricks_markdown` renders every registered trick (catalogue ids, name, what it trades,
what it needs, how to switch it on, which benchmark measures it) as the text of
``docs/tricks.md``; ``python -m torch_tricks._docs`` writes the file and ``--check`` exits 1
when the checked-in file is not current (``tests/test_docs.py`` runs the same comparison).

This module imports torch only inside :func:`tricks_markdown`, so ``doctor --explain`` can
use :func:`doc_link` without it; :data:`DOCUMENTED_IDS` is the set of catalogue ids that have
an anchor in the document, kept equal to the registry's by the tests.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["DOCS_PATH", "DOCUMENTED_IDS", "tricks_markdown", "doc_link", "write", "main"]

DOCS_PATH = "docs/tricks.md"  # relative to the repository root

# The catalogue ids with an anchor in docs/tricks.md (test_docs.py checks this is the registry's set).
DOCUMENTED_IDS = frozenset({
    "D1", "D2", "D3", "D4", "D5", "D6", "D8", "D9", "D10", "D11",
    "I1", "I2", "I3", "I4", "I5", "I6", "I7",
    "T1", "T2", "T5", "T7", "T9", "T10", "T11", "T12", "T14", "T15", "T17", "T18", "T19", "T20",
    "T21", "T22", "T24", "T26", "T28", "T29", "T30", "T31", "T33", "T34", "T35", "T37", "T38", "T39", "T40", "T41",
})

_KINDS = (("train", "Training tricks"), ("data", "Data tricks"), ("deploy", "Deploy steps"))
_DASH = "—"


def _id_key(cid: str) -> tuple[str, int, str]:
    m = re.fullmatch(r"([A-Z]+)(\d+)", cid)
    return (m.group(1), int(m.group(2)), "") if m else (cid, 0, cid)


def _anchor(cid: str) -> str:
    return cid.lower()


def doc_link(cid: str) -> str | None:
    """``docs/tricks.md#t1`` for a catalogue id the document explains, else None (no torch import)."""
    cid = cid.upper()
    return f"{DOCS_PATH}#{_anchor(cid)}" if cid in DOCUMENTED_IDS else None


def _cell(text: str) -> str:
    return (text or _DASH).replace("|", "\\|").replace("\n", " ")


def _python_path(fn) -> str:
    """The shortest public import path of ``fn``: its package's name if the package exports it."""
    import importlib

    module = fn.__module__
    parts = module.split(".")
    for i in range(2, len(parts)):
        pkg = ".".join(parts[:i])
        try:
            if getattr(importlib.import_module(pkg), fn.__name__, None) is fn:
                return f"{pkg}.{fn.__name__}"
        except ImportError:
            break
    return f"{module}.{fn.__qualname__}"


def _switch_on(trick) -> str:
    ways = []
    if trick.config_key:
        ways.append(f"`{trick.config_key}` in `TrainConfig` / the config file, "
                    f"`--{trick.config_key.replace('_', '-')}` of `torch-tricks train`")
    if trick.switch_on:
        ways.append(f"`{trick.switch_on}`")
    ways.append(f"`{_python_path(trick.fn)}`")
    return "; ".join(ways)


def _measured(trick) -> str:
    return f"[{trick.measured_in}](../{trick.measured_in})" if trick.measured_in else _DASH


def _name_cell(trick) -> str:
    """The trick's name with its anchor, and its other names (anchored too: links to an earlier name land here)."""
    cell = f'<a id="{trick.name}"></a>`{trick.name}`'
    if trick.aliases:
        cell += " (also: " + ", ".join(f'<a id="{a}"></a>`{a}`' for a in trick.aliases) + ")"
    return cell


def tricks_markdown() -> str:
    """The text of ``docs/tricks.md``: every registered trick, by kind, and what each catalogue id names."""
    from torch_tricks.registry import list_tricks

    tricks = list_tricks()
    out = [
        "# Tricks",
        "",
        "<!-- Generated from the trick registry by `python -m torch_tricks._docs`; do not edit by hand. -->",
        "",
        "Every trick torch-tricks registers (`torch-tricks tricks` lists them too): its catalogue",
        "id(s), what it trades, what it needs, how to switch it on, and the benchmark that measures",
        f"it (\"{_DASH}\" where none does). `torch-tricks doctor --explain` links here by catalogue id.",
        "",
        "## Catalogue ids",
        "",
        "| id | tricks |",
        "| --- | --- |",
        *_id_rows(tricks),
    ]
    for kind, title in _KINDS:
        rows = [t for t in tricks if t.kind == kind]
        if not rows:
            continue
        out += ["", f"## {title}", "",
                "| id | name | trades | needs | switch it on | measured in |",
                "| --- | --- | --- | --- | --- | --- |"]
        out += [_trick_row(t) for t in rows]
    return "\n".join(out + _places_section()) + "\n"


def _places_section() -> list[str]:
    """Where each ``[train]`` key goes in each trainer (torch_tricks.integrations.mapping, the one table)."""
    from torch_tricks.integrations.mapping import TARGETS, place_table

    rows = place_table()
    targets = [t for t in TARGETS if t in rows[0]]
    out = ["", "## Where each key of `[train]` goes", "",
           "The table of `torch_tricks.integrations.mapping`: for every key of `tricks.toml`, where it goes",
           "in each trainer (a keyword of its own object, a line of your script, or torch-tricks' callback for",
           "it). A value with no place there is refused with one line, never dropped.", "",
           "| key | " + " | ".join(TARGETS[t] for t in targets) + " |",
           "| --- | " + " | ".join("---" for _ in targets) + " |"]
    out += [f"| `{r['key']}` | " + " | ".join(_cell(r[t]) for t in targets) + " |" for r in rows]
    return out


def _id_rows(tricks: list) -> list[str]:
    """One row per catalogue id, in catalogue order, linking to the tricks it names."""
    by_id: dict[str, list[str]] = {}
    for t in tricks:
        for cid in t.ids:
            by_id.setdefault(cid, []).append(t.name)
    rows = []
    for cid in sorted(by_id, key=_id_key):
        names = ", ".join(f"[`{n}`](#{n})" for n in by_id[cid])
        rows.append(f'| <a id="{_anchor(cid)}"></a>{cid} | {names} |')
    return rows


def _trick_row(t) -> str:
    ids = ", ".join(f"[{cid}](#{_anchor(cid)})" for cid in t.ids) or _DASH
    return (f"| {ids} | {_name_cell(t)} | {_cell(t.trades)} | {_cell(t.needs)} "
            f"| {_cell(_switch_on(t))} | {_measured(t)} |")


def write(path: str | Path = DOCS_PATH) -> Path:
    """Write :func:`tricks_markdown` to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tricks_markdown(), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m torch_tricks._docs [--check] [PATH]``: write (or check) ``docs/tricks.md``."""
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"]
    path = Path(paths[0] if paths else DOCS_PATH)
    if check:
        return _check(path)
    print(f"wrote {write(path)}")
    return 0


def _check(path: Path) -> int:
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    if current != tricks_markdown():
        print(f"{path} is not current: run `python -m torch_tricks._docs`", file=sys.stderr)
        return 1
    print(f"{path} is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
