"""One source text and its tree (``_Doc``): character offsets of nodes and tokens (:mod:`ast` columns
count UTF-8 bytes, :mod:`tokenize` ones characters), the tokens around a position, parents, and the
dotted names the file's imports make of a name."""

from __future__ import annotations

import ast
import bisect
import io
import tokenize
import warnings
from dataclasses import dataclass

from torch_tricks.doctor import Finding
from torch_tricks.doctor.analysis import FileAnalysis, dotted
from torch_tricks.doctor.fix.base import _NotFixable


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


def _call_at(doc: _Doc, f: Finding) -> ast.Call:
    """The call reported at ``f``; not fixable when there is none."""
    call = doc.call_at(f)
    if call is None:
        raise _NotFixable("no call to rewrite at this position")
    return call


def _parse(source: str, path: str) -> ast.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(source, filename=path)


@dataclass(frozen=True)
class _Tok:
    string: str
    start: int
    end: int


_TRIVIA = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
           tokenize.ENCODING, tokenize.ENDMARKER}


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
