"""The names a scope (a function, lambda or comprehension) binds: a fix that reads or assigns a name
must know whether it is the scope's own."""

from __future__ import annotations

import ast

from torch_tricks.doctor.fix.doc import _local_name


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef,
           ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


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
