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
finding of these rules is left alone and reported as not fixable there (:class:`Unfixed`):

- TT110 / TT111 ``torch.load`` without ``map_location`` / ``weights_only``: add
  ``map_location="cpu"`` / ``weights_only=True`` (both in one edit when both are missing). Not
  ``map_location`` when ``*args`` may already pass it. ``weights_only=True`` only where the file
  shows that what the load reads is tensors or state_dicts (a ``torch.save`` of a state_dict, a
  tensor, or a dict of them and numbers to the same path or buffer; or the result handed to
  ``load_state_dict``: :func:`~torch_tricks.doctor.rules.serialization.loaded_checkpoint`): a
  whole pickled module or another object fails to load with it, and a file of unknown contents
  may (the default since torch 2.6 refuses them too; the finding says what to pass instead). Not
  when a ``pickle_module`` is given (torch refuses the pair). Loaded tensors then land on the CPU.
- TT109 ``size_average=`` / ``reduce=`` given as ``True``/``False``/``None``: replaced with the
  ``reduction=`` torch's own legacy rule gives (``reduce=False`` -> ``"none"``,
  ``size_average=False`` -> ``"sum"``, otherwise ``"mean"``), for the losses whose signature is
  known, without ``reduction=`` also given and without positional arguments reaching those
  parameters.
- TT102 ``F.dropout`` (and its variants) without ``training=``: add
  ``training=<first parameter>.training`` when the call is in a method (not a static or class
  method) of the class, or in a function nested in one, and that name is not rebound on the way.
- TT118 ``torch.set_deterministic`` / ``torch.is_deterministic``: renamed to
  ``use_deterministic_algorithms`` / ``are_deterministic_algorithms_enabled`` on the alias the
  file uses (``th.set_deterministic(True)`` -> ``th.use_deterministic_algorithms(True)``); ``from
  torch import set_deterministic`` becomes ``from torch import use_deterministic_algorithms as
  set_deterministic``. Not where a call passes keywords (the parameter was renamed).
- TT113 ``x.cuda()`` / ``x.to(...)`` ... as a bare one-line statement: ``x = x.cuda()``, when the
  receiver is a name or a plain attribute chain (``self.x``). A name must already be local to the
  function (else the assignment would make it local, an UnboundLocalError); not in a class body;
  not an attribute the file makes an ``nn.Parameter`` (a module refuses a plain tensor there), nor
  a tensor's own ``.data`` / ``.grad`` (whose assignment torch checks).
- TT108 ``F.binary_cross_entropy(torch.sigmoid(z), y)`` (or ``z.sigmoid()``) in one expression:
  ``F.binary_cross_entropy_with_logits(z, y)``. Not when the sigmoid output is a variable, or the
  loss is a ``BCELoss`` object.

Public API: :func:`fix_source` (a :class:`FixResult`), :func:`fix_paths` (a :class:`FileFix` per
file), :data:`FIXABLE`, :class:`FixError`.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import copy
import difflib
import io
import os
import re
import stat
import tempfile
import tokenize
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from torch_tricks.doctor import Finding
from torch_tricks.doctor.analysis import FileAnalysis, called_method, dotted
from torch_tricks.doctor.rules.serialization import MODULE, OBJECT, WEIGHTS, Checkpoint, loaded_checkpoint
from torch_tricks.doctor.registry import HYGIENE
from torch_tricks.doctor.static import DoctorConfig, lint_paths, lint_source

__all__ = ["FIXABLE", "Edit", "Unfixed", "FixResult", "FileFix", "FixError", "fix_source", "fix_paths"]

FIXABLE = frozenset({"TT102", "TT108", "TT109", "TT110", "TT111", "TT113", "TT118"})

_MAX_ROUNDS = 8


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


# --------------------------------------------------------------------------- public API


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


def _round_fixes(doc: "_Doc", findings: list[Finding], last: bool) -> tuple[list["_Fix"], dict[int, str]]:
    """The fixes to apply in this round (none in the ``last``), and why findings cannot be fixed."""
    planned, reasons = _plan(doc, findings)
    return ([] if last else _non_overlapping(planned)), reasons


def _unfixed(findings: list[Finding], reasons: dict[int, str]) -> list[Unfixed]:
    return [Unfixed(f, reasons.get(id(f), "not fixed: other fixes touch the same text")) for f in findings]


def _edit_made(doc: "_Doc", fix: "_Fix", to_original: Callable[[int], int]) -> Edit:
    """What ``fix`` did, with the lines of the original source (``to_original`` maps them back)."""
    first = doc.line_of(_first_offset(fix))
    last = doc.line_of(max(max(s, e - 1) for s, e, _ in fix.edits))
    return Edit(fix.rules, to_original(fix.line), fix.description, (to_original(first), to_original(last)))


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


# --------------------------------------------------------------------------- files


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


def _write_fixed(ff: FileFix, data: bytes, original: bytes) -> None:
    """Write ``data`` over the file ``ff`` is about (which must still hold ``original``), and say so in ``ff``."""
    try:
        _write_atomic(Path(ff.path), data, original)
    except (OSError, FixError) as exc:
        ff.error = f"not written: {_strerror(exc)}"
    else:
        ff.written = True


def _strerror(exc: Exception) -> object:
    """The OS's message for ``exc`` without the errno and file name, else ``exc`` itself."""
    return getattr(exc, "strerror", None) or exc


def _keepends(text: str) -> list[str]:
    return re.findall(r"[^\n]*\n|[^\n]+\Z", text)


def _decode(data: bytes) -> tuple[str, str]:
    """The text (line endings as they are) and the encoding to write it back in (PEP 263)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        encoding = "utf-8"
    return data.decode(encoding), encoding


def _write_atomic(path: Path, data: bytes, original: bytes) -> None:
    target = Path(os.path.realpath(path))  # a symlink stays a link to the fixed file
    mode = stat.S_IMODE(target.stat().st_mode)
    if target.read_bytes() != original:
        raise FixError("the file changed while it was being fixed")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tt-fix")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def unified_diff(old: str, new: str, path: str) -> str:
    """``diff -u`` of two versions of ``path`` (line endings kept; a last line without one is marked)."""
    out = []
    for line in difflib.unified_diff(_keepends(old), _keepends(new), path, path):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


# --------------------------------------------------------------------------- driving


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


def _parse(source: str, path: str) -> ast.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source, filename=path)


@dataclass
class _Fix:
    rules: tuple[str, ...]
    line: int
    description: str
    edits: list[tuple[int, int, str]]  # (start, end, new text), character offsets into the source
    mutate: Callable[[dict], None]  # the same change on a copy of the tree (old node id -> copied node)


def _plan(doc: "_Doc", findings: list[Finding]) -> tuple[list[_Fix], dict[int, str]]:
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


_LOAD_RULES = ("TT110", "TT111")


def _group_loads(doc: "_Doc", findings: list[Finding]) -> tuple[dict[int, tuple[ast.Call, list[Finding]]],
                                                                   dict[int, str]]:
    """The ``torch.load`` findings grouped by the call they are about (one edit fixes both), and
    the reasons of those with no call at their position."""
    loads: dict[int, tuple[ast.Call, list[Finding]]] = {}
    reasons = {}
    for f in findings:
        if f.rule not in _LOAD_RULES:
            continue
        call = doc.call_at(f)
        if call is None:
            reasons[id(f)] = "not fixable here: no call to rewrite at this position"
        else:
            loads.setdefault(id(call), (call, []))[1].append(f)
    return loads, reasons


def _plan_loads(doc: "_Doc", loads: dict[int, tuple[ast.Call, list[Finding]]]) -> tuple[list[_Fix], dict[int, str]]:
    """The fix of each ``torch.load`` call, and why its findings that are not fixed are not."""
    fixes, reasons = [], {}
    for call, group in loads.values():
        fix, why = _fix_load(doc, call, group)
        if fix is not None:
            fixes.append(fix)
        reasons.update({id(f): f"not fixable here: {why[f.rule]}" for f in group if f.rule in why})
    return fixes, reasons


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


def _apply(source: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        assert not _multiline(text)
        source = source[:start] + text + source[end:]
    return source


def _verify(doc: "_Doc", fixes: list[_Fix], new: str, path: str) -> None:
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


def _line_mapper(doc: "_Doc", fixes: list[_Fix]) -> Callable[[int], int]:
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


class _NotFixable(Exception):
    pass


# --------------------------------------------------------------------------- one source text


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
           ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_TRIVIA = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
           tokenize.ENCODING, tokenize.ENDMARKER}


@dataclass(frozen=True)
class _Tok:
    string: str
    start: int
    end: int


class _Doc:
    """A source text and its tree, with character offsets for nodes and tokens."""

    def __init__(self, source: str, tree: ast.Module):
        self.source, self.tree = source, tree
        self.lines = source.split("\n")
        self.starts = _line_starts(self.lines)
        self.parent: dict[int, ast.AST] = {}
        self.at: dict[int, list[ast.AST]] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
            if getattr(node, "lineno", None) is not None and getattr(node, "col_offset", None) is not None:
                self.at.setdefault(self.start(node), []).append(node)
        self._tokens: list[_Tok] | None = None
        self._comments: list[int] = []
        self._imports: dict[str, str | None] | None = None
        self._analysis: FileAnalysis | None = None

    def analysis(self) -> FileAnalysis:
        """The doctor's reading of this tree (what a ``torch.load`` reads), made when first asked."""
        if self._analysis is None:
            self._analysis = FileAnalysis(self.tree, self.source)
        return self._analysis

    # ---- positions

    def offset(self, lineno: int, byte_col: int) -> int:
        line = self.lines[lineno - 1]
        col = byte_col if line.isascii() else len(line.encode("utf-8")[:byte_col].decode("utf-8"))
        return self.starts[lineno - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)

    def text(self, node: ast.AST) -> str:
        return self.source[self.start(node):self.end(node)]

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset)

    def finding_offset(self, f: Finding) -> int:
        return self.starts[f.line - 1] + f.col - 1

    def nodes_at(self, f: Finding, kind) -> list[ast.AST]:
        return [n for n in self.at.get(self.finding_offset(f), []) if isinstance(n, kind)]

    def call_at(self, f: Finding) -> ast.Call | None:
        """The call reported at ``f``: the one whose callee is a plain dotted name (the outer call of
        a chain such as ``torch.load(f).keys()`` calls an attribute of a call)."""
        calls = [c for c in self.nodes_at(f, ast.Call) if dotted(c.func)]
        return calls[0] if len(calls) == 1 else None

    def parent_of(self, node: ast.AST) -> ast.AST | None:
        return self.parent.get(id(node))

    def ancestors(self, node: ast.AST):
        node = self.parent_of(node)
        while node is not None:
            yield node
            node = self.parent_of(node)

    # ---- tokens

    def _tokenize(self) -> list[_Tok]:
        if self._tokens is None:
            toks, comments = [], []
            for t in tokenize.generate_tokens(io.StringIO(self.source).readline):
                if t.type == tokenize.COMMENT:
                    comments.append(self._point_offset(t.start))
                elif t.type not in _TRIVIA:
                    toks.append(_Tok(t.string, self._point_offset(t.start), self._point_offset(t.end)))
            self._tokens, self._comments = toks, comments
            self._tok_starts = [t.start for t in toks]
        return self._tokens

    def _point_offset(self, point: tuple[int, int]) -> int:
        """The offset of a tokenize (row, column) point; tokenize counts characters."""
        return self.starts[point[0] - 1] + point[1]

    def prev_token(self, offset: int) -> _Tok:
        """The last significant token that starts before ``offset``."""
        toks = self._tokenize()
        return toks[bisect.bisect_left(self._tok_starts, offset) - 1]

    def next_token(self, offset: int) -> _Tok:
        """The first significant token that starts at or after ``offset``."""
        toks = self._tokenize()
        return toks[bisect.bisect_left(self._tok_starts, offset)]

    def comment_between(self, a: int, b: int) -> bool:
        self._tokenize()
        i = bisect.bisect_left(self._comments, a)
        return i < len(self._comments) and self._comments[i] < b

    # ---- names

    def imports(self) -> dict[str, str | None]:
        """Name -> the module/object it was imported as (None when bound to different ones)."""
        if self._imports is None:
            out: dict[str, str | None] = {}
            for node in ast.walk(self.tree):
                for name, target in _imported(node):
                    out[name] = target if out.get(name, target) == target else None
            self._imports = out
        return self._imports

    def resolve(self, node: ast.AST) -> str | None:
        """The imported dotted name ``node`` spells (``F`` -> ``torch.nn.functional``)."""
        spelled = dotted(node)
        if spelled is None:
            return None
        head, _, rest = spelled.partition(".")
        base = self.imports().get(head)
        if base is None or _rebinds_anywhere(self.tree, head):
            return None
        return f"{base}.{rest}" if rest else base


def _line_starts(lines: list[str]) -> list[int]:
    """The offset where each of ``lines`` (split on ``\\n``) starts."""
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    return starts


def _imported(node: ast.AST) -> list[tuple[str, str]]:
    """(local name, what it is imported as) for each name the import ``node`` binds; [] for other nodes
    and relative imports."""
    if isinstance(node, ast.Import):
        return [_import_binding(a) for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names]
    return []


def _import_binding(a: ast.alias) -> tuple[str, str]:
    """``import a.b as c`` binds c to a.b; ``import a.b`` binds a to a."""
    local = _local_name(a)
    return local, (a.name if a.asname else local)


def _local_name(a: ast.alias) -> str:
    """The name an import of ``a`` binds: its ``as`` name, else the first part of its name."""
    return a.asname or a.name.split(".")[0]


def _rebinds_anywhere(tree: ast.AST, name: str) -> bool:
    """``name`` is assigned (not imported) somewhere in the file: its import may not be what it is."""
    return any(_bound_name(node) == name for node in ast.walk(tree))


def _bound_name(node: ast.AST) -> str | None:
    """The name ``node`` binds other than by an import: an assigned or deleted name, a def, a class,
    a parameter; None for other nodes."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return node.id
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.arg):
        return node.arg
    return None


def _binds(scope: ast.AST, name: str) -> bool:
    """``name`` is a local of ``scope`` (a function, lambda or comprehension): a parameter, an
    assignment target, a global/nonlocal declaration, an import, a def, an ``except ... as``."""
    if _has_parameter(scope, name):
        return True
    stack = _scope_roots(scope)
    while stack:
        node = stack.pop()
        if _binds_here(node, name):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(node.decorator_list)  # the body is another scope
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue  # another scope (a walrus inside one is not followed: then not fixable)
        stack.extend(ast.iter_child_nodes(node))
    return False


def _has_parameter(scope: ast.AST, name: str) -> bool:
    args = getattr(scope, "args", None)
    return isinstance(args, ast.arguments) and any(
        a.arg == name for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
        if a is not None)


def _scope_roots(scope: ast.AST) -> list[ast.AST]:
    """Where the code of ``scope`` starts: a comprehension's targets, a lambda's body, a block's statements."""
    if isinstance(scope, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return [g.target for g in scope.generators]
    if isinstance(scope, ast.Lambda):
        return [scope.body]
    return list(scope.body)


def _binds_here(node: ast.AST, name: str) -> bool:
    """``node`` itself binds ``name`` in the scope it is in (its children aside)."""
    if isinstance(node, ast.Name):
        return node.id == name and isinstance(node.ctx, (ast.Store, ast.Del))
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return name in node.names
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any(_local_name(a) == name for a in node.names)
    if isinstance(node, (ast.ExceptHandler, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    return _pattern_binds(node, name)


def _pattern_binds(node: ast.AST, name: str) -> bool:
    """The ``case`` pattern ``node`` binds ``name``: ``case name``, ``case [*name]``, ``case {**name}``."""
    if isinstance(node, (ast.MatchAs, ast.MatchStar)):
        return node.name == name
    return isinstance(node, ast.MatchMapping) and node.rest == name


def _kw(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def _starred(call: ast.Call) -> bool:
    return any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)


def _multiline(text: str) -> bool:
    return "\n" in text or "\r" in text


def _value(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def _insertion(doc: _Doc, call: ast.Call, text: str) -> tuple[int, int, str]:
    """Where to add ``text`` (keyword arguments) at the end of ``call``'s arguments: after the last
    argument, before a trailing comma (so the comma and a comment after it stay)."""
    close = doc.end(call) - 1
    if doc.source[close] != ")":
        raise _NotFixable("the call's closing parenthesis is not where the tree says")
    prev = doc.prev_token(close)
    if prev.start < doc.start(call):  # the call is inside one token: an f-string (before Python 3.12)
        raise _NotFixable("the call is inside an f-string")
    if prev.string == "(":
        return (prev.end, prev.end, text)
    if prev.string == ",":
        prev = doc.prev_token(prev.start)
    return (prev.end, prev.end, ", " + text)


# --------------------------------------------------------------------------- the fixes


def _fix_load(doc: _Doc, call: ast.Call, group: list[Finding]) -> tuple[_Fix | None, dict[str, str]]:
    """One edit adding what ``call`` lacks (``map_location``, ``weights_only`` or both), and the
    rules it cannot fix there, with why."""
    rules = {f.rule for f in group}
    add, why = _load_additions(doc, call, rules)
    if not add:
        return None, why
    text = ", ".join(f"{k}={v}" for _, k, v in add)
    try:
        edit = _insertion(doc, call, text)
    except _NotFixable as exc:
        return None, {r: str(exc) for r in rules}

    def mutate(m: dict) -> None:
        m[id(call)].keywords.extend(ast.keyword(arg=k, value=_value(v)) for _, k, v in add)
    return _Fix(tuple(r for r, _, _ in add), call.lineno, f"{dotted(call.func)}(...): added {text}", [edit],
                mutate), why


def _load_additions(doc: _Doc, call: ast.Call, rules: set[str]) -> tuple[list[tuple[str, str, str]],
                                                                          dict[str, str]]:
    """(rule, keyword, value) to add to the ``torch.load`` ``call`` for each of ``rules`` it can fix, and
    why it cannot fix the others."""
    add, why = [], {}
    for rule, keyword, value, blocker in _LOAD_FIXES:
        if rule not in rules:
            continue
        reason = blocker(doc, call)
        if reason is not None:
            why[rule] = reason
        else:
            add.append((rule, keyword, value))
    return add, why


def _map_location_blocker(doc: _Doc, call: ast.Call) -> str | None:
    """Why ``map_location`` cannot be added to this ``torch.load`` call; None if it can."""
    if any(isinstance(a, ast.Starred) for a in call.args) or _kw(call, "map_location") or len(call.args) > 1:
        return "*args may already pass map_location"
    return None


def _weights_only_blocker(doc: _Doc, call: ast.Call) -> str | None:
    """Why ``weights_only=True`` cannot be added to this ``torch.load`` call; None if it can: the file
    shows that the call reads tensors or state_dicts."""
    if _custom_pickle(call):
        return "a pickle_module is given, which weights_only=True refuses"
    if _kw(call, "weights_only") or any(k.arg is None for k in call.keywords):
        return "**kwargs may already pass weights_only"
    return _checkpoint_blocker(loaded_checkpoint(doc.analysis(), call))


def _checkpoint_blocker(c: Checkpoint) -> str | None:
    """Why ``weights_only=True`` may break a load of ``c``; None for tensors and state_dicts."""
    if c.holds == WEIGHTS:
        return None
    if c.holds == MODULE:
        return (f"it loads a whole pickled module ({c.saved} saved on line {c.line}), which weights_only=True "
                f"refuses: pass weights_only=False for a trusted file, or save {c.saved}.state_dict()")
    if c.holds == OBJECT:
        return (f"what torch.save stores on line {c.line} ({c.saved}) is not shown to be only tensors/state_dicts, "
                f"which weights_only=True needs")
    return ("the file does not show what the checkpoint holds (no torch.save to it here, no load_state_dict of "
            "the result), and weights_only=True refuses pickled objects: check it and pass weights_only by hand")


def _custom_pickle(call: ast.Call) -> bool:
    """The ``torch.load`` ``call`` passes a ``pickle_module`` (other than None)."""
    pickle = _pickle_module(call)
    return pickle is not None and not (isinstance(pickle, ast.Constant) and pickle.value is None)


def _pickle_module(call: ast.Call) -> ast.AST | None:
    """The ``pickle_module`` argument of a ``torch.load`` call (the third positional one)."""
    pickle = _kw(call, "pickle_module")
    if pickle is not None:
        return pickle.value
    return call.args[2] if len(call.args) > 2 else None


#: (rule, the keyword its fix adds to torch.load, the value, why it may not be added there)
_LOAD_FIXES = (("TT110", "map_location", '"cpu"', _map_location_blocker),
               ("TT111", "weights_only", "True", _weights_only_blocker))


def _fix_dropout(doc: _Doc, f: Finding) -> _Fix:
    call = _call_at(doc, f)
    if _kw(call, "training") or _starred(call) or len(call.args) > 2:
        raise _NotFixable("training may already be passed")
    method, inner = _enclosing_method(doc, call)
    if method is None:
        raise _NotFixable("not inside a method, so there is no self.training to pass")
    me = _instance_parameter(method)
    if _rebound(method, inner, me):
        raise _NotFixable(f"`{me}` is rebound before the call")
    text = f"training={me}.training"

    def mutate(m: dict) -> None:
        m[id(call)].keywords.append(ast.keyword(arg="training", value=_value(f"{me}.training")))
    return _Fix(("TT102",), f.line, f"{dotted(call.func)}(...): added {text}", [_insertion(doc, call, text)], mutate)


def _call_at(doc: _Doc, f: Finding) -> ast.Call:
    """The call reported at ``f``; not fixable when there is none."""
    call = doc.call_at(f)
    if call is None:
        raise _NotFixable("no call to rewrite at this position")
    return call


def _enclosing_method(doc: _Doc, node: ast.AST) -> tuple[ast.AST | None, list[ast.AST]]:
    """The method whose code holds ``node`` (None if not in one), and the scopes between them
    (functions nested in the method, lambdas, comprehensions)."""
    inner = []
    for anc in doc.ancestors(node):
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(doc.parent_of(anc), ast.ClassDef):
            return anc, inner
        if isinstance(anc, (ast.ClassDef, ast.Module)):
            break
        if isinstance(anc, _SCOPES):
            inner.append(anc)
    return None, inner


def _instance_parameter(method: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The name of the method's instance parameter (``self``); not fixable when it has none."""
    if {"staticmethod", "classmethod"} & set(_decorator_names(method)):
        raise _NotFixable("in a static or class method, which has no instance")
    params = method.args.posonlyargs + method.args.args
    if not params:
        raise _NotFixable("the method has no instance parameter")
    return params[0].arg


def _decorator_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The last part of each decorator's name: ``functools.wraps(f)`` -> ``wraps``."""
    return [(dotted(d.func if isinstance(d, ast.Call) else d) or "").rsplit(".", 1)[-1] for d in func.decorator_list]


def _rebound(method: ast.AST, inner: list[ast.AST], me: str) -> bool:
    """The instance parameter ``me`` is bound again in ``method``'s body or in one of the ``inner`` scopes."""
    return _binds_in_body(method, me) or any(_binds(s, me) for s in inner)


def _binds_in_body(func: ast.AST, name: str) -> bool:
    """``name`` is bound in ``func``'s body (its parameters aside)."""
    shell = copy.copy(func)
    shell.args = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None,
                               defaults=[])
    return _binds(shell, name)


# the number of parameters before size_average (reduce follows it) in each loss taking them
_LEGACY_SLOT = {
    **dict.fromkeys("l1_loss mse_loss smooth_l1_loss kl_div multilabel_margin_loss soft_margin_loss".split(), 2),
    **dict.fromkeys("binary_cross_entropy binary_cross_entropy_with_logits cross_entropy nll_loss "
                    "hinge_embedding_loss multilabel_soft_margin_loss".split(), 3),
    **dict.fromkeys("poisson_nll_loss cosine_embedding_loss margin_ranking_loss".split(), 4),
    "multi_margin_loss": 5, "triplet_margin_loss": 7,
    **dict.fromkeys("L1Loss MSELoss SmoothL1Loss KLDivLoss MultiLabelMarginLoss SoftMarginLoss".split(), 0),
    **dict.fromkeys("NLLLoss NLLLoss2d CrossEntropyLoss BCELoss BCEWithLogitsLoss MultiLabelSoftMarginLoss "
                    "HingeEmbeddingLoss CosineEmbeddingLoss MarginRankingLoss".split(), 1),
    "PoissonNLLLoss": 2, "MultiMarginLoss": 3, "TripletMarginLoss": 4,
}


def _legacy_reduction(size_average: bool | None, reduce: bool | None) -> str:
    """torch.nn._reduction.legacy_get_string."""
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    return "mean" if size_average and reduce else "sum" if reduce else "none"


def _fix_legacy_reduction(doc: _Doc, f: Finding) -> _Fix:
    call = _call_at(doc, f)
    name = dotted(call.func).rsplit(".", 1)[-1]
    if name not in _LEGACY_SLOT:
        raise _NotFixable(f"the signature of {name} is not known here")
    legacy = _legacy_keywords(call, _LEGACY_SLOT[name])
    values = _legacy_values(legacy)
    reduction = _legacy_reduction(values.get("size_average"), values.get("reduce"))
    first, rest = legacy[0], legacy[1:]
    edits = [(doc.start(first), doc.end(first), f'reduction="{reduction}"')]
    edits += [_deletion(doc, call, k) for k in rest]

    def mutate(m: dict) -> None:
        c = m[id(call)]
        drop = {id(m[id(k)]) for k in rest}
        c.keywords = [ast.keyword(arg="reduction", value=ast.Constant(reduction)) if k is m[id(first)] else k
                      for k in c.keywords if id(k) not in drop]
    old = ", ".join(doc.text(k) for k in legacy)
    return _Fix(("TT109",), f.line, f'{name}(...): {old} -> reduction="{reduction}"', edits, mutate)


def _legacy_keywords(call: ast.Call, slot: int) -> list[ast.keyword]:
    """The ``size_average=`` / ``reduce=`` of ``call`` (``slot`` parameters come before them); not
    fixable when ``reduction=`` or arguments that may reach them are passed too."""
    legacy = [k for k in call.keywords if k.arg in ("size_average", "reduce")]
    if not legacy or _starred(call) or _kw(call, "reduction") or len(call.args) > slot:
        raise _NotFixable("reduction= or more arguments are passed too")
    return legacy


def _legacy_values(legacy: list[ast.keyword]) -> dict[str, bool | None]:
    """``size_average`` / ``reduce`` -> the constant given; not fixable when one is not a constant."""
    values = {}
    for k in legacy:
        if not (isinstance(k.value, ast.Constant) and (k.value.value is None or isinstance(k.value.value, bool))):
            raise _NotFixable(f"{k.arg}= is not a True/False/None constant")
        values[k.arg] = k.value.value
    return values


def _deletion(doc: _Doc, call: ast.Call, arg: ast.AST) -> tuple[int, int, str]:
    """Remove one argument and its comma; its line too when nothing else is left on it."""
    s, e = doc.start(arg), doc.end(arg)
    if doc.prev_token(s).start < doc.start(call):
        raise _NotFixable("the call is inside an f-string")
    nxt = doc.next_token(e)
    if nxt.string == ",":
        return _deletion_with_comma(doc, s, e, nxt)
    if nxt.start == doc.end(call) - 1 and nxt.string == ")":
        return _deletion_of_last(doc, s, e)
    raise _NotFixable("an argument is not followed by a comma or the closing parenthesis")


def _deletion_with_comma(doc: _Doc, s: int, e: int, comma: _Tok) -> tuple[int, int, str]:
    """Remove the argument at ``s:e``, the ``comma`` after it and the blanks after that; its line
    too when nothing else is left on it."""
    if doc.comment_between(e, comma.start):
        raise _NotFixable("a comment sits between an argument and its comma")
    j = _skip_blanks(doc.source, comma.end)
    line_start = doc.starts[doc.line_of(s) - 1]
    if doc.source[line_start:s].strip(" \t") == "" and doc.source[j:j + 1] in ("\n", "\r"):
        return (line_start, j + (2 if doc.source[j:j + 2] == "\r\n" else 1), "")
    return (s, j, "")


def _skip_blanks(text: str, j: int) -> int:
    """The first offset from ``j`` on that is not a space or a tab."""
    while j < len(text) and text[j] in " \t":
        j += 1
    return j


def _deletion_of_last(doc: _Doc, s: int, e: int) -> tuple[int, int, str]:
    """Remove the last argument, at ``s:e``, and the comma before it."""
    prev = doc.prev_token(s)
    if prev.string != "," or doc.comment_between(prev.end, s):
        raise _NotFixable("a comment sits between two arguments")
    return (prev.start, e, "")


_RENAMES = {"set_deterministic": "use_deterministic_algorithms",
            "is_deterministic": "are_deterministic_algorithms_enabled"}


def _fix_renamed(doc: _Doc, f: Finding) -> _Fix:
    imports = doc.nodes_at(f, ast.ImportFrom)
    if imports:
        return _fix_renamed_import(doc, f, imports[0])
    node = _removed_attribute(doc, f)
    parent = doc.parent_of(node)
    if isinstance(parent, ast.Call) and parent.func is node and parent.keywords:
        raise _NotFixable("the call passes keywords, and the new function names its parameters differently")
    end = doc.end(node)
    start = end - len(node.attr)
    if doc.source[start:end] != node.attr:
        raise _NotFixable("the attribute is not spelled where the tree says")
    new = _RENAMES[node.attr]
    prefix = doc.text(node.value)

    def mutate(m: dict) -> None:
        m[id(node)].attr = new
    return _Fix(("TT118",), f.line, f"{prefix}.{node.attr} -> {prefix}.{new}", [(start, end, new)], mutate)


def _removed_attribute(doc: _Doc, f: Finding) -> ast.Attribute:
    """The ``torch.set_deterministic`` / ``torch.is_deterministic`` reported at ``f``."""
    attrs = [a for a in doc.nodes_at(f, ast.Attribute) if a.attr in _RENAMES
             and not isinstance(doc.parent_of(a), ast.Attribute) and doc.resolve(a.value) == "torch"]
    if len(attrs) != 1:
        raise _NotFixable("no torch.set_deterministic / is_deterministic spelled through the torch import here")
    return attrs[0]


def _fix_renamed_import(doc: _Doc, f: Finding, node: ast.ImportFrom) -> _Fix:
    aliases = _removed_aliases(node)
    edits, parts = [], []
    for a in aliases:
        edit, part = _import_rename(doc, a)
        edits.append(edit)
        parts.append(part)

    def mutate(m: dict) -> None:
        for a in aliases:
            c = m[id(a)]
            c.name, c.asname = _RENAMES[a.name], a.asname or a.name
    return _Fix(("TT118",), f.line, f"from torch import {', '.join(parts)}", edits, mutate)


def _removed_aliases(node: ast.ImportFrom) -> list[ast.alias]:
    """The removed names ``from torch import ...`` imports (with their positions: Python 3.10+)."""
    if node.module != "torch" or node.level:
        raise _NotFixable("not an import from torch")
    aliases = [a for a in node.names if a.name in _RENAMES]
    if not aliases or any(getattr(a, "lineno", None) is None for a in aliases):
        raise _NotFixable("no removed name in the import")
    return aliases


def _import_rename(doc: _Doc, a: ast.alias) -> tuple[tuple[int, int, str], str]:
    """The edit renaming the imported name ``a`` (still bound to its old name), and what it does."""
    bound = a.asname or a.name
    if _called_with_keywords(doc.tree, bound):
        raise _NotFixable(f"a call of {bound} passes keywords, and the new function names its parameters "
                          f"differently")
    s = doc.start(a)
    if doc.source[s:s + len(a.name)] != a.name:
        raise _NotFixable("the imported name is not spelled where the tree says")
    new = _RENAMES[a.name] + ("" if a.asname else f" as {a.name}")
    return (s, s + len(a.name), new), f"{a.name} -> {new}"


def _called_with_keywords(tree: ast.AST, name: str) -> bool:
    """Some call of the plain name ``name`` passes keyword arguments."""
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == name and c.keywords
               for c in ast.walk(tree))


_MOVES = frozenset("cuda cpu to half float double bfloat16 long int short byte char bool pin_memory type".split())


def _fix_discarded_move(doc: _Doc, f: Finding) -> _Fix:
    call = _bare_move(doc, f)
    stmt = doc.parent_of(call)
    recv = call.func.value
    if stmt.lineno != stmt.end_lineno:
        raise _NotFixable("the statement spans several lines")
    if dotted(recv) is None:
        raise _NotFixable("the receiver is not a name or a plain attribute chain")
    scope = next((a for a in doc.ancestors(stmt) if isinstance(a, _SCOPES + (ast.Module,))), None)
    if isinstance(scope, ast.ClassDef):
        raise _NotFixable("in a class body")
    _check_assignable(doc, scope, recv)
    target = doc.text(recv)

    def mutate(m: dict) -> None:
        new_stmt, body = m[id(stmt)], []
        parent = m[id(doc.parent_of(stmt))]
        tgt = copy.deepcopy(m[id(recv)])
        tgt.ctx = ast.Store()
        assign = ast.Assign(targets=[tgt], value=m[id(call)], type_comment=None)
        for name, value in ast.iter_fields(parent):
            if isinstance(value, list) and any(v is new_stmt for v in value):
                body = value
        body[[i for i, v in enumerate(body) if v is new_stmt][0]] = assign
    s = doc.start(stmt)
    return _Fix(("TT113",), f.line, f"`{target}.{call.func.attr}(...)` -> `{target} = {target}.{call.func.attr}(...)`",
                [(s, s, f"{target} = ")], mutate)


def _bare_move(doc: _Doc, f: Finding) -> ast.Call:
    """The ``x.cuda()`` / ``x.to(...)`` ... call reported at ``f``, a statement of its own."""
    calls = [c for c in doc.nodes_at(f, ast.Call) if isinstance(doc.parent_of(c), ast.Expr)
             and isinstance(c.func, ast.Attribute) and c.func.attr in _MOVES]
    if len(calls) != 1:
        raise _NotFixable("not a bare `x.cuda()` statement")
    return calls[0]


def _check_assignable(doc: _Doc, scope: ast.AST | None, recv: ast.Name | ast.Attribute) -> None:
    """Not fixable when ``recv = ...`` in ``scope`` would change what the code means or fail."""
    if isinstance(recv, ast.Name):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _binds(scope, recv.id):
            raise _NotFixable(f"`{recv.id}` is not local to the function: assigning it would make it local")
    elif recv.attr in _TENSOR_ATTRS:
        raise _NotFixable(f"assigning `.{recv.attr}` of a tensor is checked by torch (device, shape): "
                          f"rewrite it by hand")
    elif _is_parameter_attr(doc, recv.attr):
        raise _NotFixable(f"`.{recv.attr}` holds an nn.Parameter, which a module does not let a tensor replace")


_TENSOR_ATTRS = frozenset("data grad real imag T mT H mH".split())


def _is_parameter_attr(doc: _Doc, attr: str) -> bool:
    """The file makes ``.attr`` an ``nn.Parameter``: assigns it one, or registers one under that name."""
    return any(_assigns_parameter(node, attr) or _registers_parameter(node, attr) for node in ast.walk(doc.tree))


def _assigns_parameter(node: ast.AST, attr: str) -> bool:
    """``node`` is ``x.attr = ...Parameter(...)`` (or an annotated assignment)."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
        return False
    return any(isinstance(t, ast.Attribute) and t.attr == attr for t in _targets(node)) \
        and _makes_parameter(node.value)


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _makes_parameter(value: ast.AST) -> bool:
    """``value`` calls something named ``...Parameter``."""
    return any(isinstance(c, ast.Call) and _callee(c).endswith("Parameter") for c in ast.walk(value))


def _registers_parameter(node: ast.AST, attr: str) -> bool:
    """``node`` is ``x.register_parameter("attr", ...)``."""
    return isinstance(node, ast.Call) and _callee(node).endswith("register_parameter") and bool(node.args) \
        and isinstance(node.args[0], ast.Constant) and node.args[0].value == attr


def _callee(call: ast.Call) -> str:
    """The dotted name ``call`` calls, "" when it is not one."""
    return dotted(call.func) or ""


_SIGMOIDS = frozenset({"torch.sigmoid", "torch.nn.functional.sigmoid", "torch.special.expit"})


def _fix_sigmoid_bce(doc: _Doc, f: Finding) -> _Fix:
    call = doc.call_at(f)
    if call is None or not _is_functional_bce(doc, call):
        raise _NotFixable("not a call of F.binary_cross_entropy (a BCELoss object needs its constructor changed)")
    if _starred(call):
        raise _NotFixable("*args / **kwargs")
    slot = _input_argument(call)
    inner = _sigmoid_input(doc, slot)
    if inner is None or isinstance(inner, ast.GeneratorExp):
        raise _NotFixable("the sigmoid is not applied in the loss call itself (its output is a variable)")
    end = doc.end(call.func)
    new = "binary_cross_entropy_with_logits"
    edits = [(end - len(call.func.attr), end, new), (doc.start(slot), doc.end(slot), doc.text(inner))]
    if _multiline(doc.text(inner)):
        raise _NotFixable("the logits expression spans several lines")

    def mutate(m: dict) -> None:
        c = m[id(call)]
        c.func.attr = new
        if call.args and call.args[0] is slot:
            c.args[0] = m[id(inner)]
        else:
            next(k for k in c.keywords if k.arg == "input").value = m[id(inner)]
    prefix = doc.text(call.func.value)
    return _Fix(("TT108",), f.line, f"{prefix}.binary_cross_entropy(sigmoid(x), ...) -> {prefix}.{new}(x, ...)",
                edits, mutate)


def _input_argument(call: ast.Call) -> ast.AST | None:
    """The ``input`` argument of a loss call: the first positional one, or ``input=``."""
    return call.args[0] if call.args else getattr(_kw(call, "input"), "value", None)


def _is_functional_bce(doc: _Doc, call: ast.Call) -> bool:
    """``call`` is ``F.binary_cross_entropy(...)``, ``F`` an import of ``torch.nn.functional``."""
    return called_method(call) == "binary_cross_entropy" and doc.resolve(call.func.value) == "torch.nn.functional"


def _sigmoid_input(doc: _Doc, slot: ast.AST | None) -> ast.AST | None:
    """``x`` when ``slot`` is ``torch.sigmoid(x)`` (or an alias of it) or ``x.sigmoid()``, else None."""
    if not isinstance(slot, ast.Call) or slot.keywords or _starred(slot):
        return None
    if len(slot.args) == 1 and doc.resolve(slot.func) in _SIGMOIDS:
        return slot.args[0]
    if _is_sigmoid_method(doc, slot):
        return slot.func.value
    return None


def _is_sigmoid_method(doc: _Doc, call: ast.Call) -> bool:
    """``call`` is ``x.sigmoid()``, ``x`` not an import (``torch.sigmoid()`` needs an argument)."""
    return not call.args and called_method(call) == "sigmoid" and doc.resolve(call.func.value) is None


_PLANNERS: dict[str, Callable[[_Doc, Finding], _Fix]] = {
    "TT102": _fix_dropout, "TT108": _fix_sigmoid_bce, "TT109": _fix_legacy_reduction, "TT113": _fix_discarded_move,
    "TT118": _fix_renamed,
}
