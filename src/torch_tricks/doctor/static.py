"""The static half of ``torch-tricks doctor``: classic PyTorch pitfalls found by reading code.

Files are parsed with :mod:`ast`; nothing is imported or run, so linting is safe on any
code and needs no GPU. Names are resolved through the file's own imports
(``import torch.nn.functional as F``, ``from torch import nn``, ``from torch.nn import
CrossEntropyLoss``), and each function's simple bindings are followed
(``criterion = nn.CrossEntropyLoss()`` ... ``criterion(out, y)``; ``for x, y in loader``;
``self.fc = nn.Linear(...)`` in ``__init__`` ... ``self.fc`` in ``forward``; a function's
parameter when every call in the file passes the same kind of thing).

Precision comes before recall: a rule fires only on evidence in the file that the code is
the pitfall (the receiver of ``.cuda()`` was made by ``torch.randn``, the input of
``cross_entropy`` came from ``log_softmax``). Where the evidence is elsewhere — a model
passed in from another module, a loader built in another file — the rule stays quiet.

This module drives a run (files, ``# noqa``, config, ordering); what a file says is read
once by :mod:`torch_tricks.doctor.analysis`, and each rule is a small class in
:mod:`torch_tricks.doctor.rules` (one module per family) that asks that analysis.

Public API: :func:`lint_source`, :func:`lint_paths` (a :class:`LintResult`),
:func:`format_text`, :func:`exit_code`, :func:`check_rule_codes`, :func:`filter_findings`,
and, re-exported from the sibling modules, :func:`load_config` / :class:`DoctorConfig` and
:func:`to_sarif`.
"""

from __future__ import annotations

import ast
import io
import os
import re
import time
import tokenize
import warnings
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Iterable

from torch_tricks.doctor import rules as _rules  # noqa: F401  (importing it registers every rule)
from torch_tricks.doctor.analysis import FileAnalysis
from torch_tricks.doctor.config import DoctorConfig, load_config
from torch_tricks.doctor.notebook import NotebookSource, notebook_source
from torch_tricks.doctor.registry import (HYGIENE, Finding, Rule, check_rule_codes, get_rule, list_rules,
                                          severity_rank, static_checks)
from torch_tricks.doctor.sarif import to_sarif
from torch_tricks.errors import UserError, one_line

__all__ = ["LintResult", "lint_source", "lint_paths", "format_text", "exit_code", "check_rule_codes",
           "filter_findings", "static_rules", "load_config", "DoctorConfig", "to_sarif"]


# --------------------------------------------------------------------------- public API


@dataclass
class LintResult:
    """What a run over files found, how many files it read, and which it could not."""

    findings: list[Finding] = field(default_factory=list)
    files: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, one-line reason)
    seconds: float = 0.0
    hygiene_left_out: int = 0  # findings of hygiene rules not shown to matter (all shown with --select hygiene)


def lint_source(source: str, path: str = "<string>", select: Iterable[str] | None = None,
                ignore: Iterable[str] | None = None) -> list[Finding]:
    """The static findings in ``source``, sorted by position.

    ``select``/``ignore`` hold rule ids or id prefixes (``"TT1"``); ``# noqa`` on a
    finding's line silences it, ``# noqa: TT101,TT105`` only those rules. Source that
    does not parse raises :class:`SyntaxError` (:func:`lint_paths` reports it per file).
    """
    return _lint_tree(_parse(source, path), source, path, _selection(select, ignore))[0]


def lint_paths(paths: Iterable[str | Path], select: Iterable[str] | None = None,
               ignore: Iterable[str] | None = None, config: DoctorConfig | None = None,
               progress: Callable[[int, int], None] | None = None) -> LintResult:
    """Lint files and folders (walked for ``*.py``, skipping VCS, virtualenv, hidden and
    ``__pycache__`` folders and the config's ``exclude`` patterns).

    ``select``/``ignore`` given here replace the config's; ``exclude`` applies to what the
    walk finds (a file named explicitly is always linted). A path that does not exist is
    a :class:`UserError`; a file that cannot be read or parsed is listed in ``errors`` and
    the run goes on. ``progress(done, total)`` is called after each file.
    """
    started = time.perf_counter()
    config = config or DoctorConfig()
    enabled = _selection_by(config, select, ignore)
    files = _collect(paths, config)
    result = LintResult(files=len(files))
    for done, file in enumerate(files, 1):
        _lint_file(file, enabled, result)
        if progress is not None:
            progress(done, len(files))
    result.findings.sort(key=_order)
    result.seconds = time.perf_counter() - started
    return result


def format_text(findings: Iterable[Finding]) -> list[str]:
    """One ``path:line:col: TT101 message`` line per finding (flake8 style, 1-based column)."""
    return [f"{f.path or '-'}:{_cell_prefix(f)}{f.line}:{f.col}: {f.rule} {f.message}" for f in findings]


def _cell_prefix(f: Finding) -> str:
    """``cell 3:`` for a finding in a notebook cell (ruff's notation), else nothing."""
    return f"cell {f.extra['cell']}:" if f.extra.get("cell") else ""


def exit_code(findings: Iterable[Finding], fail_on: str = "warning") -> int:
    """1 if any finding is at or above the ``fail_on`` severity, else 0."""
    threshold = severity_rank(fail_on)
    return int(any(severity_rank(f.severity) >= threshold for f in findings))


def filter_findings(findings: Iterable[Finding], select: Iterable[str] | None = None,
                    ignore: Iterable[str] | None = None) -> list[Finding]:
    """The findings whose rule ``select`` keeps (ids or prefixes; None keeps all) and
    ``ignore`` does not drop: the same filter as linting's, for any rule (runtime too)."""
    keep = _rule_filter(select, ignore)
    return [f for f in findings if keep(f.rule)]


def static_rules() -> list[Rule]:
    """The static rules, by id."""
    return list_rules("static")


# --------------------------------------------------------------------------- driving


def _lint_file(file: Path, enabled: "_Selection", result: LintResult) -> None:
    """Add the findings of ``file`` to ``result``, or why it could not be read or analysed."""
    name = str(file)
    notebook = None
    try:
        source = _read(file)
        if file.suffix == ".ipynb":  # the code cells as one module; each finding put back in its cell
            notebook = notebook_source(source)
            source = notebook.source
        tree = _parse(source, name)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        result.errors.append((name, _reason(exc)))
        return
    try:
        findings, left_out = _lint_tree(tree, source, name, enabled)
        if notebook is not None:
            findings = [_in_cell(f, notebook) for f in findings]
        result.findings.extend(findings)
        result.hygiene_left_out += left_out
    except RecursionError:
        result.errors.append((name, "nested too deeply to analyse"))
    except Exception as exc:  # a bug in a checker: keep the traceback, say which file
        if hasattr(exc, "add_note"):
            exc.add_note(f"torch-tricks doctor crashed while linting {name}")
        raise


def _in_cell(f: Finding, notebook: NotebookSource) -> Finding:
    """``f`` with its line that of its notebook cell, the cell number in ``extra["cell"]``."""
    cell, line = notebook.place(f.line)
    f.line = line
    f.extra = {**f.extra, "cell": cell}
    return f


@dataclass(frozen=True)
class _Selection:
    """The static rules to run, and the hygiene rules among them reported in full (the others of that tier
    report only the findings their ``matters`` shows to matter)."""

    enabled: tuple[str, ...]
    full: frozenset[str]


def _selection_by(config: DoctorConfig, select, ignore) -> _Selection:
    """The rules to run: ``select``/``ignore`` given to a call replace the config's."""
    return _selection(config.select if select is None else select, config.ignore if ignore is None else ignore)


def _selection(select, ignore) -> _Selection:
    """``select`` (ids, prefixes, and ``hygiene``: that tier in full) and ``ignore`` as the rules to run: a rule
    named by its id is reported in full; a prefix, or no select, takes a hygiene rule's default findings only."""
    sel = None if select is None else check_rule_codes(select, "select")
    keep = _rule_filter(sel, ignore)
    enabled = tuple(rid for rid in sorted(static_checks()) if keep(rid))
    hygiene = sel is not None and HYGIENE in sel
    full = frozenset(rid for rid in enabled if get_rule(rid).tier == "hygiene" and (hygiene or rid in (sel or ())))
    return _Selection(enabled, full)


def _rule_filter(select, ignore) -> Callable[[str], bool]:
    """Whether a rule id is kept by ``select`` (ids or prefixes; None, or only ``hygiene``, keeps all) and not
    dropped by ``ignore``; both are checked first (an unknown code is a :class:`UserError`)."""
    sel = None if select is None else tuple(c for c in check_rule_codes(select, "select") if c != HYGIENE) or None
    ign = tuple(c for c in check_rule_codes(ignore or (), "ignore") if c != HYGIENE)

    def keep(rid: str) -> bool:
        return (sel is None or rid.startswith(sel)) and not rid.startswith(ign)
    return keep


def _parse(source: str, path: str) -> ast.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes: not ours to report
        return ast.parse(source, filename=path)


def _lint_tree(tree: ast.Module, source: str, path: str, enabled: _Selection) -> tuple[list[Finding], int]:
    """The findings, and how many findings of hygiene rules were left out (not shown to matter)."""
    file = FileAnalysis(tree, source)
    file.path = path  # a rule's tier may depend on what the file is (test code)
    found, left_out = _check(file, enabled)
    # Comments are tokenized only when a reported line mentions noqa: most files never pay.
    noqa = _noqa_lines(source) if any("noqa" in file.line(line).lower() for _, line, _, _ in found) else {}
    findings = [Finding(rule=rid, message=message, path=path, line=line, col=col, severity=get_rule(rid).severity)
                for rid, line, col, message in found if not _silenced(rid, line, noqa)]
    findings.sort(key=_order)
    return findings, left_out


def _check(file: FileAnalysis, enabled: _Selection) -> tuple[list[tuple[str, int, int, str]], int]:
    """``(rule, line, column, message)`` of each finding of the ``enabled`` rules, the first one
    only where a rule reports one place twice; a hygiene rule not asked for in full, only where it matters."""
    checks = static_checks()
    found, seen, left_out = [], set(), 0
    for rid in enabled.enabled:
        rule = checks[rid]
        in_part = rule.tier == "hygiene" and rid not in enabled.full
        for node, message in rule.check(file):
            if in_part and not rule.matters(file, node):
                left_out += 1
                continue
            line, col = node.lineno, file.column(node)
            if (rid, line, col) not in seen:
                seen.add((rid, line, col))
                found.append((rid, line, col, message))
    return found, left_out


def _silenced(rid: str, line: int, noqa: dict[int, frozenset[str] | None]) -> bool:
    """A ``# noqa`` on ``line`` names the rule, or is bare."""
    return line in noqa and (noqa[line] is None or rid in noqa[line])


def _order(f: Finding):
    return (f.path, f.extra.get("cell", 0), f.line, f.col, f.rule)


_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Za-z]+[0-9]+(?:[\s,]+[A-Za-z]+[0-9]+)*))?", re.IGNORECASE)


def _noqa_lines(source: str) -> dict[int, frozenset[str] | None]:
    """line -> None (bare ``# noqa``: everything) or the codes it names. Comments only:
    a ``noqa`` inside a string does not count."""
    if "noqa" not in source.lower():
        return {}
    out: dict[int, frozenset[str] | None] = {}
    for line, text in _comments(source):
        m = _NOQA.search(text)
        if m:
            out[line] = _noqa_codes(m.group("codes"))
    return out


def _comments(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each comment; from each ``#`` on when the source does not tokenize."""
    try:
        return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return [(i, line[line.index("#"):]) for i, line in enumerate(source.splitlines(), 1) if "#" in line]


def _noqa_codes(codes: str | None) -> frozenset[str] | None:
    """The rule ids a ``# noqa: ...`` names, upper-cased; None for a bare ``# noqa``."""
    if codes is None:
        return None
    return frozenset(c.upper() for c in re.split(r"[\s,]+", codes) if c)


_SKIP_DIRS = {"__pycache__", "node_modules", "venv", "site-packages"}


def _collect(paths: Iterable[str | Path], config: DoctorConfig) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise UserError(f"{p}: no such file or folder: give existing .py or .ipynb files or folders to lint")
        if path.is_file():
            files.append(path)
        else:
            files.extend(_walk(path, config))
    return list(dict.fromkeys(files))


def _walk(folder: Path, config: DoctorConfig) -> list[Path]:
    """The ``*.py`` files under ``folder``, sorted, minus the skipped folders and excluded paths."""
    found = []
    for sub, dirs, names in os.walk(folder):
        base = Path(sub)
        dirs[:] = sorted(d for d in dirs if not _skipped_dir(base / d, config))
        found.extend(base / n for n in names if _lintable(base / n, config))
    return sorted(found)


def _lintable(path: Path, config: DoctorConfig) -> bool:
    return path.name.endswith((".py", ".ipynb")) and not _excluded(path, config)


def _skipped_dir(path: Path, config: DoctorConfig) -> bool:
    """A hidden, cache, dependency or virtualenv folder, or one the config excludes."""
    return (path.name.startswith(".") or path.name in _SKIP_DIRS or (path / "pyvenv.cfg").exists()
            or _excluded(path, config))


def _excluded(path: Path, config: DoctorConfig) -> bool:
    """A pattern with a slash matches the path relative to the config's folder (or a
    leading part of it); one without matches any single path component."""
    if not config.exclude:
        return False
    try:
        rel = path.resolve().relative_to(config.root.resolve()).as_posix()
    except ValueError:
        rel = path.as_posix()
    parts = rel.split("/")
    return any(_matches(parts, pat.rstrip("/")) for pat in config.exclude)


def _matches(parts: list[str], pat: str) -> bool:
    if "/" in pat:
        return any(fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1))
    return any(fnmatch(part, pat) for part in parts)


def _read(path: Path) -> str:
    """The file's text in its declared encoding (PEP 263), UTF-8 by default."""
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:  # undecodable first lines, or an unknown coding cookie
        encoding = "utf-8"
    return data.decode(encoding)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"does not parse: {exc.msg} (line {exc.lineno})"
    if isinstance(exc, UnicodeDecodeError):
        return f"not {exc.encoding} text (bad byte at offset {exc.start})"
    if isinstance(exc, OSError):
        return f"cannot read: {exc.strerror or exc}"
    if isinstance(exc, (RecursionError, MemoryError)):
        return "nested too deeply to analyse"
    return one_line(exc)
