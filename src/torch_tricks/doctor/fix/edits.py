"""Text edits, ``(start, end, new text)`` at character offsets: adding keyword arguments at the end
of a call, removing an argument with its comma (and its line when nothing else is left on it), and
applying a round's edits. The positions come from the tree and from :mod:`tokenize` (commas,
parentheses, comments), so every character outside an edit stays as it was; no edit adds a line
break."""

from __future__ import annotations

import ast

from torch_tricks.doctor.fix.base import _NotFixable
from torch_tricks.doctor.fix.doc import _Doc, _Tok


def _apply(source: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        assert not _multiline(text)
        source = source[:start] + text + source[end:]
    return source


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


def _kw(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def _starred(call: ast.Call) -> bool:
    return any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)


def _multiline(text: str) -> bool:
    return "\n" in text or "\r" in text


def _value(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body
