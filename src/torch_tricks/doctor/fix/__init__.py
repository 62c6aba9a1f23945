"""``torch-tricks doctor --fix`` / ``--diff``: rewrite the findings whose fix is mechanical.

Fixes are minimal text edits at positions taken from :mod:`ast` (``lineno``/``col_offset``/
``end_lineno``/``end_col_offset``; the columns count UTF-8 bytes, converted to characters for
lines with non-ASCII text) and from :mod:`tokenize` (commas, parentheses, comments around an
argument). No concrete-syntax-tree library is needed (libcst is not a dependency): every byte
outside an edit stays as it was, comments and formatting included, and no edit ever adds a
line break, so the file keeps its ``\\n`` or ``\\r\\n`` line endings.

Each fix is also written as the change it makes to the tree. After the edits the new source is
parsed again and its tree must equal the old tree with those changes applied (positions aside);
if it does not parse, or differs, that is a bug here: :class:`FixError` is raised and nothing is
written. A file that does not parse is never touched. ``# noqa`` lines are not fixed (the lint
does not report them). Fixing repeats until no fix applies (edits that touch the same text wait
for the next round), so a second ``--fix`` changes nothing.

What is fixed (:data:`FIXABLE`), and only where the file shows the edit is safe; any other
finding of these rules is left alone and reported as not fixable there (:class:`Unfixed`). The
module of each family says what its fix does, where, and why not elsewhere:

- TT110 / TT111 ``torch.load`` without ``map_location`` / ``weights_only``: added
  (:mod:`~torch_tricks.doctor.fix.torch_load`).
- TT109 ``size_average=`` / ``reduce=``: the ``reduction=`` they mean
  (:mod:`~torch_tricks.doctor.fix.reduction`).
- TT102 ``F.dropout`` without ``training=``: ``training=self.training`` (:mod:`~torch_tricks.doctor.fix.dropout`).
- TT118 ``torch.set_deterministic`` / ``torch.is_deterministic``: the new names
  (:mod:`~torch_tricks.doctor.fix.renames`).
- TT113 ``x.cuda()`` / ``x.to(...)`` as a bare statement: ``x = x.cuda()`` (:mod:`~torch_tricks.doctor.fix.moves`).
- TT108 ``F.binary_cross_entropy(torch.sigmoid(z), y)``: ``F.binary_cross_entropy_with_logits(z, y)``
  (:mod:`~torch_tricks.doctor.fix.with_logits`).

The machinery: :mod:`.base` (the types the modules share), :mod:`.doc` (one source text and its
tree: offsets, tokens, imports), :mod:`.scopes` (the names a scope binds), :mod:`.edits` (adding
and removing arguments, applying edits), :mod:`.rounds` (lint, plan, apply, verify, again) and
:mod:`.files` (reading, writing atomically, diffs).

Public API: :func:`fix_source` (a :class:`FixResult`), :func:`fix_paths` (a :class:`FileFix` per
file), :data:`FIXABLE`, :class:`FixError`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from torch_tricks.doctor.fix.base import Edit, FileFix, FixError, FixResult, Unfixed
from torch_tricks.doctor.fix.doc import _parse
from torch_tricks.doctor.fix.files import _decode, _strerror, _write_fixed, unified_diff
from torch_tricks.doctor.fix.rounds import _fix_in_rounds, _fixable_findings
from torch_tricks.doctor.registry import HYGIENE
from torch_tricks.doctor.static import DoctorConfig, lint_paths, lint_source

__all__ = ["FIXABLE", "Edit", "Unfixed", "FixResult", "FileFix", "FixError", "fix_source", "fix_paths"]

FIXABLE = frozenset({"TT102", "TT108", "TT109", "TT110", "TT111", "TT113", "TT118"})


def fix_source(source: str, path: str = "<string>", select: Iterable[str] | None = None,
               ignore: Iterable[str] | None = None) -> FixResult:
    """``source`` with the fixable findings fixed (``select``/``ignore`` as for linting).

    Source that does not parse raises :class:`SyntaxError` (and is not changed); a fix that would
    produce broken or unintended code raises :class:`FixError`.
    """
    rules = _fixable(select, ignore)
    _parse(source, path)  # SyntaxError: never fix what does not parse
    result = FixResult(source=source, original=source)
    if not rules:
        return result
    if re.search(r"\r(?!\n)", source):  # old-Mac line ends: ast and tokenize would count lines differently
        result.unfixed = [Unfixed(f, "the file has lone \\r line endings")
                          for f in _fixable_findings(source, path, select, ignore, rules)]
        return result
    _fix_in_rounds(result, path, (select, ignore, rules))
    return result


def fix_paths(paths: Iterable[str | Path], select: Iterable[str] | None = None,
              ignore: Iterable[str] | None = None, config: DoctorConfig | None = None,
              write: bool = True) -> list[FileFix]:
    """Fix the ``.py`` files in ``paths`` (walked as :func:`lint_paths` walks them).

    ``select``/``ignore`` given here replace the config's. A file is listed when it has a
    finding of a fixable rule or could not be read or parsed (``error``; it is left untouched).
    With ``write`` the changed files are rewritten atomically (a temporary file in the same
    folder, then :func:`os.replace`; the file mode is kept); without it nothing is written and
    ``diff`` says what would change.
    """
    config = config or DoctorConfig()
    select = config.select if select is None else select
    ignore = config.ignore if ignore is None else ignore
    rules = _fixable(select, ignore)
    linted = lint_paths(paths, select=select, ignore=ignore, config=config)
    # a notebook's findings are reported, not rewritten: its cells live in JSON, which the fixes do not edit
    linted.findings = [f for f in linted.findings if f.rule in rules and not f.path.endswith(".ipynb")]
    return _fix_linted(linted, select, ignore, write)


def _fix_linted(linted, select, ignore, write: bool) -> list[FileFix]:
    """A :class:`FileFix` for each file of the lint ``linted`` that has findings or could not be read, by path."""
    out: dict[str, FileFix] = {}
    for name, reason in linted.errors:
        out[name] = FileFix(path=name, error=reason, unreadable=True)
    for name in dict.fromkeys(f.path for f in linted.findings):
        out[name] = _fix_file(name, select, ignore, write)
    return [out[k] for k in sorted(out)]


def _fix_file(name: str, select, ignore, write: bool) -> FileFix:
    ff = FileFix(path=name)
    try:
        data = Path(name).read_bytes()
        source, encoding = _decode(data)
        result = fix_source(source, name, select=select, ignore=ignore)
    except (OSError, UnicodeError) as exc:
        ff.error, ff.unreadable = f"cannot read: {_strerror(exc)}", True
        return ff
    except SyntaxError as exc:
        ff.error, ff.unreadable = f"does not parse: {exc.msg} (line {exc.lineno})", True
        return ff
    except FixError as exc:
        ff.error = str(exc)
        return ff
    ff.edits, ff.unfixed = result.edits, result.unfixed
    if not result.changed:
        return ff
    ff.diff = unified_diff(source, result.source, name)
    if write:
        _write_fixed(ff, result.source.encode(encoding), data)
    return ff


def _fixable(select, ignore) -> list[str]:
    """The fixable rule ids ``select`` keeps (ids or prefixes); the codes are checked by the lint."""
    lint_source("", select=select, ignore=ignore)  # an unknown code is a UserError, as for linting
    sel = _codes(select)
    return sorted(r for r in FIXABLE if sel is None or any(r.startswith(c) for c in sel))


def _codes(select) -> list[str] | None:
    """The codes of ``select`` (a list, or one code as a string), upper-cased; None for every rule."""
    if isinstance(select, str):
        select = [select]
    codes = None if select is None else [s.strip().upper() for s in select if s.strip().upper() != HYGIENE]
    return codes or None  # only "hygiene": every rule (the tier is the lint's to apply)
