"""TT118 ``torch.set_deterministic`` / ``torch.is_deterministic``: renamed to
``use_deterministic_algorithms`` / ``are_deterministic_algorithms_enabled`` on the alias the
file uses (``th.set_deterministic(True)`` -> ``th.use_deterministic_algorithms(True)``); ``from
torch import set_deterministic`` becomes ``from torch import use_deterministic_algorithms as
set_deterministic``. Not where a call passes keywords (the parameter was renamed).
"""

from __future__ import annotations

import ast

from torch_tricks.doctor import Finding
from torch_tricks.doctor.fix.base import _Fix, _NotFixable
from torch_tricks.doctor.fix.doc import _Doc


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
