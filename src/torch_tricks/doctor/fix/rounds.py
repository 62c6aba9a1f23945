"""Fixing one source text in rounds: lint, plan a fix for each finding (its family's module), apply
those whose edits do not overlap, check the new tree is the old one with the fixes' changes, and
again until nothing is left to fix. The lines of each :class:`Edit` are mapped back to the
original source."""

from __future__ import annotations

import ast
import copy
from typing import Callable

from torch_tricks.doctor import Finding
from torch_tricks.doctor.fix.base import Edit, FixError, FixResult, Unfixed, _Fix, _NotFixable
from torch_tricks.doctor.fix.doc import _Doc, _parse
from torch_tricks.doctor.fix.dropout import _fix_dropout
from torch_tricks.doctor.fix.edits import _apply
from torch_tricks.doctor.fix.moves import _fix_discarded_move
from torch_tricks.doctor.fix.reduction import _fix_legacy_reduction
from torch_tricks.doctor.fix.renames import _fix_renamed
from torch_tricks.doctor.fix.torch_load import _LOAD_RULES, _group_loads, _plan_loads
from torch_tricks.doctor.fix.with_logits import _fix_sigmoid_bce
from torch_tricks.doctor.static import lint_source


_MAX_ROUNDS = 8


def _fixable_findings(source: str, path: str, select, ignore, rules: list[str]) -> list[Finding]:
    """The findings the lint reports with ``select``/``ignore`` (a hygiene rule's default ones only, unless asked
    for), of the fixable ``rules``: --fix fixes what the lint shows."""
    return [f for f in lint_source(source, path, select=select, ignore=ignore) if f.rule in rules]


def _fix_in_rounds(result: FixResult, path: str, chosen_rules: tuple) -> None:
    """Fill ``result``: lint, fix what does not overlap, and again, until nothing is left to fix."""
    select, ignore, rules = chosen_rules
    current, to_original = result.source, (lambda n: n)
    for _round in range(_MAX_ROUNDS + 1):
        findings = _fixable_findings(current, path, select, ignore, rules)
        if not findings:
            break
        doc = _Doc(current, _parse(current, path))
        chosen, reasons = _round_fixes(doc, findings, _round == _MAX_ROUNDS)
        if not chosen:
            result.unfixed = _unfixed(findings, reasons)
            break
        new = _apply(current, [e for fix in chosen for e in fix.edits])
        _verify(doc, chosen, new, path)
        result.edits += [_edit_made(doc, fix, to_original) for fix in chosen]
        to_original = _compose(to_original, _line_mapper(doc, chosen))
        current = new
    result.source = current
    result.edits.sort(key=lambda e: e.line)


def _round_fixes(doc: _Doc, findings: list[Finding], last: bool) -> tuple[list[_Fix], dict[int, str]]:
    """The fixes to apply in this round (none in the ``last``), and why findings cannot be fixed."""
    planned, reasons = _plan(doc, findings)
    return ([] if last else _non_overlapping(planned)), reasons


def _unfixed(findings: list[Finding], reasons: dict[int, str]) -> list[Unfixed]:
    return [Unfixed(f, reasons.get(id(f), "not fixed: other fixes touch the same text")) for f in findings]


def _edit_made(doc: _Doc, fix: _Fix, to_original: Callable[[int], int]) -> Edit:
    """What ``fix`` did, with the lines of the original source (``to_original`` maps them back)."""
    first = doc.line_of(_first_offset(fix))
    last = doc.line_of(max(max(s, e - 1) for s, e, _ in fix.edits))
    return Edit(fix.rules, to_original(fix.line), fix.description, (to_original(first), to_original(last)))


def _plan(doc: _Doc, findings: list[Finding]) -> tuple[list[_Fix], dict[int, str]]:
    """The fixes for ``findings``, and why the others cannot be fixed (by ``id`` of the finding)."""
    loads, reasons = _group_loads(doc, findings)
    fixes = []
    for f in findings:
        if f.rule in _LOAD_RULES:
            continue
        try:
            fixes.append(_PLANNERS[f.rule](doc, f))
        except _NotFixable as exc:
            reasons[id(f)] = f"not fixable here: {exc}"
    load_fixes, load_reasons = _plan_loads(doc, loads)
    reasons.update(load_reasons)
    return fixes + load_fixes, reasons


_PLANNERS: dict[str, Callable[[_Doc, Finding], _Fix]] = {
    "TT102": _fix_dropout, "TT108": _fix_sigmoid_bce, "TT109": _fix_legacy_reduction, "TT113": _fix_discarded_move,
    "TT118": _fix_renamed,
}


def _non_overlapping(fixes: list[_Fix]) -> list[_Fix]:
    """The fixes whose edits touch no text another (earlier) fix edits; the rest wait a round."""
    taken: list[tuple[int, int]] = []
    chosen = []
    for fix in sorted(fixes, key=_first_offset):
        spans = [(s, e) for s, e, _ in fix.edits]
        if not any(_clash(a, b) for a in spans for b in taken):
            chosen.append(fix)
            taken += spans
    return chosen


def _first_offset(fix: _Fix) -> int:
    """Where the first edit of ``fix`` starts."""
    return min(s for s, _, _ in fix.edits)


def _clash(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] == b[0] or (a[0] < b[1] and b[0] < a[1])


def _verify(doc: _Doc, fixes: list[_Fix], new: str, path: str) -> None:
    """The new source parses, and its tree is the old one with the fixes' changes."""
    try:
        new_tree = _parse(new, path)
    except SyntaxError as exc:
        raise FixError(f"{path}: the fixes would produce code that does not parse ({exc.msg}, line {exc.lineno}): "
                       f"a torch-tricks bug; nothing was written") from None
    expected = copy.deepcopy(doc.tree)
    mapping = {id(a): b for a, b in zip(ast.walk(doc.tree), ast.walk(expected))}
    for fix in fixes:
        fix.mutate(mapping)
    if ast.dump(expected) != ast.dump(new_tree):
        raise FixError(f"{path}: the fixes would not produce the intended code: a torch-tricks bug; "
                       f"nothing was written")


def _line_mapper(doc: _Doc, fixes: list[_Fix]) -> Callable[[int], int]:
    """New line number -> line number before these edits (an edit that joins lines maps to its first)."""
    spans = sorted((doc.line_of(s), doc.line_of(e), e == doc.starts[doc.line_of(e) - 1] and e > s)
                   for fix in fixes for s, e, _ in fix.edits)

    def to_old(n: int) -> int:
        shift = 0
        for first, last, whole_lines in spans:
            if n < first + shift:
                break
            if n == first + shift:
                return last if whole_lines else first  # whole lines deleted: what follows moved up
            shift -= last - first
        return n - shift
    return to_old


def _compose(outer: Callable[[int], int], inner: Callable[[int], int]) -> Callable[[int], int]:
    return lambda n: outer(inner(n))
