"""One file as the rules see it: :class:`FileAnalysis`.

It parses nothing itself; it indexes an :mod:`ast` tree once: parents, scopes, the bindings of
each name in each function (assignments, loop targets, parameters, imports), ``self.x = ...``
attributes per class, and the import aliases. On that index it answers where a name was bound
(:meth:`FileAnalysis.lookup`), what a dotted name stands for (:meth:`FileAnalysis.qualname`), the
structure around a node and the calls of a frame. The rest of its reasoning comes from three
mixins it is composed of: :class:`~torch_tricks.doctor.analysis.kinds.KindInference` (the kind of
an expression), :class:`~torch_tricks.doctor.analysis.classes.ModuleClasses` (the file's module
classes) and :class:`~torch_tricks.doctor.analysis.grad_mode.GradMode` (autograd off or on).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from typing import Iterator

from torch_tricks.doctor.analysis.classes import ModuleClasses
from torch_tricks.doctor.analysis.grad_mode import GradMode
from torch_tricks.doctor.analysis.kind import Kind
from torch_tricks.doctor.analysis.kinds import KindInference
from torch_tricks.doctor.analysis.syntax import COMPS, FUNCS, LOOPS, SCOPES, dotted, end, is_backward, is_name, pos
from torch_tricks.doctor.analysis.vocab import canon


RECORDED = frozenset({ast.Name, ast.Call, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor,
                      ast.comprehension, ast.With, ast.AsyncWith, ast.NamedExpr, ast.FunctionDef,
                      ast.AsyncFunctionDef, ast.ClassDef, ast.arguments, ast.Import, ast.ImportFrom, ast.Global,
                      ast.Nonlocal, ast.ExceptHandler, ast.Delete})


class FileAnalysis(KindInference, ModuleClasses, GradMode):
    """A parsed file with what the rules ask of it: parents, scopes, name bindings,
    import aliases, and the kind of an expression (memoised). The tables set up here are
    read by the mixins it is composed of, and they call its methods (and each other's)."""

    def __init__(self, tree: ast.Module, source: str):
        self.tree = tree
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.parent: dict[ast.AST, ast.AST] = {}
        self.scope_of: dict[ast.AST, ast.AST | None] = {}
        self.bindings: dict[ast.AST, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self.uses: dict[ast.AST, dict[str, list[ast.Name]]] = defaultdict(lambda: defaultdict(list))
        self.global_names: dict[ast.AST, set[str]] = defaultdict(set)
        self.nodes: dict[type, list[ast.AST]] = defaultdict(list)
        self.aliases: dict[str, str] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.plain_functions: dict[str, list[ast.AST]] = defaultdict(list)
        self.calls_by_name: dict[str, list[ast.Call]] = defaultdict(list)
        self.self_attrs: dict[ast.ClassDef, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self._kinds: dict[ast.AST, Kind | None] = {}
        self._qualnames: dict[ast.AST, str | None] = {}
        self._busy: set = set()
        self.memo: dict = {}
        self._index()

    # ---- indexing

    def _index(self) -> None:
        stack: list[tuple[ast.AST, ast.AST | None]] = [(self.tree, None)]
        scope_of, parent, nodes = self.scope_of, self.parent, self.nodes
        while stack:
            node, scope = stack.pop()
            scope_of[node] = scope
            nodes[type(node)].append(node)
            if type(node) in RECORDED:
                self._record(node, scope)
            inner = node if isinstance(node, SCOPES) else scope
            for child in reversed(list(ast.iter_child_nodes(node))):
                parent[child] = node
                stack.append((child, inner))
        self._sort_bindings()

    def _sort_bindings(self) -> None:
        """Each name's bindings in source order (:meth:`lookup` takes the latest before a read)."""
        for table in self.bindings.values():
            for binds in table.values():
                binds.sort(key=lambda b: b[0])

    def _record(self, node: ast.AST, scope: ast.AST | None) -> None:
        if isinstance(node, ast.Name):
            self.uses[self.frame_of(scope)][node.id].append(node)
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                self.calls_by_name[node.func.id].append(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            self._record_import(node, scope)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.arguments)):
            self._record_definition(node, scope)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            self.global_names[scope].update(node.names)
        else:
            self._record_binding(node, scope)

    def _record_binding(self, node: ast.AST, scope: ast.AST | None) -> None:
        """The names a statement binds: assignments, loop and ``with`` targets, ``except ... as``, ``del``."""
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.AugAssign)):
            self._record_assignment(node, scope)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._bind_loop(scope, node.target, node, end(node.iter))
        elif isinstance(node, ast.comprehension):
            self._bind_loop(scope, node.target, node, (0, 0))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self._bind(scope, item.optional_vars, None, end(item.context_expr), node)
        else:
            self._record_unbinding(node, scope)

    def _record_assignment(self, node: ast.AST, scope: ast.AST | None) -> None:
        """``x = v`` (each target), ``x: T = v``, ``(x := v)``, and ``x += v``."""
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(scope, target, node.value, end(node), node)
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name):
                self._add(scope, node.target.id, (end(node), "aug", node, None))
        elif node.value is not None:
            self._bind(scope, node.target, node.value, end(node), node)

    def _record_unbinding(self, node: ast.AST, scope: ast.AST | None) -> None:
        """``except ... as name`` and ``del name``: the name's value is unknown from there on."""
        if isinstance(node, ast.ExceptHandler):
            if node.name:
                self._add(scope, node.name, (pos(node), "unknown", node, None))
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self._add(scope, t.id, (end(node), "unknown", node, None))

    def _record_definition(self, node: ast.AST, scope: ast.AST | None) -> None:
        """A function or class (its name, and the table it belongs in), or a function's parameters."""
        if isinstance(node, ast.arguments):
            self._record_parameters(node)
            return
        self._add(scope, node.name, (pos(node), "def", node, None))
        if isinstance(node, ast.ClassDef):
            self.classes[node.name] = node
        elif not isinstance(self.parent.get(node), ast.ClassDef):
            self.plain_functions[node.name].append(node)

    def _record_parameters(self, node: ast.arguments) -> None:
        func = self.parent.get(node)
        for arg in node.posonlyargs + node.args + node.kwonlyargs + [node.vararg, node.kwarg]:
            if arg is not None:
                self._add(func, arg.arg, ((0, 0), "param", func, arg.arg))

    def _record_import(self, node: ast.Import | ast.ImportFrom, scope: ast.AST | None) -> None:
        """The local names an import binds, and the qualified names they stand for."""
        for alias in node.names:
            bound = _imported_name(node, alias)
            if bound is not None:
                local, qualified = bound
                self.aliases[local] = qualified
                self._add(scope, local, (end(node), "import", node, None))

    def _add(self, scope, name: str, binding: tuple) -> None:
        self.bindings[scope][name].append(binding)

    def _bind(self, scope, target, value, pos, stmt, path: tuple = ()) -> None:
        if isinstance(target, ast.Name):
            self._add(scope, target.id, (pos, "value", value, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            self._bind_unpacking(scope, target, value, pos, stmt, path)
        elif isinstance(target, ast.Starred):
            self._bind(scope, target.value, None, pos, stmt)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and value is not None:
            self._bind_self_attr(scope, target, value, path, stmt)

    def _bind_unpacking(self, scope, target, value, pos, stmt, path: tuple) -> None:
        """``a, b = ...``: element by element from a display of the same length (``a, b = x, y``), else
        each name to its ``path`` into the value."""
        if not path and _same_length_displays(target, value):
            for t, v in zip(target.elts, value.elts):
                self._bind(scope, t, v, pos, stmt)
        else:
            for i, t in enumerate(target.elts):
                self._bind(scope, t, value if not isinstance(t, ast.Starred) else None, pos, stmt, path + (i,))

    def _bind_self_attr(self, scope, target: ast.Attribute, value: ast.AST, path: tuple, stmt: ast.AST) -> None:
        """``self.x = value`` in a method (``self`` its first parameter): recorded for the class."""
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        cls = self.parent.get(scope)
        args = scope.args.posonlyargs + scope.args.args
        if isinstance(cls, ast.ClassDef) and args and args[0].arg == target.value.id:
            self.self_attrs[cls][target.attr].append((value, path, stmt))

    def _bind_loop(self, scope, target, loop, pos, path: tuple = ()) -> None:
        if isinstance(target, ast.Name):
            self._add(scope, target.id, (pos, "for", loop, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for i, t in enumerate(target.elts):
                self._bind_loop(scope, t, loop, pos, path + (i,))
        elif isinstance(target, ast.Starred):
            self._bind_loop(scope, target.value, loop, pos, path + (None,))

    # ---- positions and structure

    def line(self, lineno: int) -> str:
        return self.lines[lineno - 1] if 0 < lineno <= len(self.lines) else ""

    def column(self, node: ast.AST) -> int:
        """1-based column in characters (ast counts UTF-8 bytes)."""
        line = self.line(node.lineno)
        if line.isascii():
            return node.col_offset + 1
        return len(line.encode("utf-8")[:node.col_offset].decode("utf-8", "replace")) + 1

    def frame_of(self, scope):
        """The function (or module) whose frame runs code of ``scope``: comprehensions and class
        bodies run in the enclosing one."""
        while isinstance(scope, COMPS + (ast.ClassDef,)) and scope is not None:
            scope = self.scope_of.get(scope)
        return scope

    def function_scope(self, node: ast.AST):
        """The function (or module) whose frame runs ``node``: comprehensions run inline."""
        return self.frame_of(self.scope_of.get(node))

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        node = self.parent.get(node)
        while node is not None:
            yield node
            node = self.parent.get(node)

    def local_ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        """Ancestors up to (not including) the enclosing function or class."""
        for anc in self.ancestors(node):
            if isinstance(anc, FUNCS + (ast.ClassDef, ast.Module)):
                return
            yield anc

    def loops_around(self, node: ast.AST) -> list[ast.AST]:
        return [a for a in self.local_ancestors(node) if isinstance(a, LOOPS)]

    def method_class(self, node: ast.AST) -> ast.ClassDef | None:
        """The nn.Module subclass whose method (or a function nested in one) holds ``node``."""
        for anc in self.ancestors(node):
            if isinstance(anc, ast.ClassDef):
                return anc if self.is_module_class(anc) else None
        return None

    def qualname(self, node: ast.AST) -> str | None:
        """The dotted name ``node`` refers to through the file's imports, canonical."""
        try:
            return self._qualnames[node]
        except KeyError:
            pass
        spelled = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        q = self._resolve(spelled) if spelled is not None else None
        self._qualnames[node] = q
        return q

    def _resolve(self, spelled: str) -> str | None:
        """The canonical name a dotted spelling stands for through the file's imports; None when
        its head is not imported."""
        head, _, rest = spelled.partition(".")
        if head not in self.aliases:
            return None
        return canon(self.aliases[head] + ("." + rest if rest else ""))

    @property
    def mentions_cuda(self) -> bool:
        """The file uses CUDA somewhere (``.cuda``, ``torch.cuda``, a ``"cuda..."`` device)."""
        if "cuda" not in self.memo:
            self.memo["cuda"] = self._uses_cuda()
        return self.memo["cuda"]

    def _uses_cuda(self) -> bool:
        return any(n.attr == "cuda" for n in self.nodes[ast.Attribute]) or any(
            isinstance(n.value, str) and n.value.startswith("cuda") for n in self.nodes[ast.Constant])

    # ---- names

    def lookup(self, node: ast.Name):
        """The binding of ``node`` where it is read: the latest one before it in its own
        function, else the last one in an enclosing function or the module."""
        name, where = node.id, pos(node)
        for scope, own in self._scopes_searched(node, name):
            binds = self.bindings.get(scope, {}).get(name)
            if binds:
                found = _last_before(binds, where) if own else binds[-1]
                if found is not None or not isinstance(scope, COMPS):
                    return found  # None: bound later in this function, a loop-carried value
        return None

    def _scopes_searched(self, node: ast.Name, name: str) -> Iterator[tuple[ast.AST, bool]]:
        """The scopes where the read ``node`` of ``name`` may find its binding, innermost first, each
        with whether the read runs in its frame (its function, or a comprehension inline in it): a
        class body is not seen from its methods, and a ``global`` name is the module's."""
        scope, own = self.scope_of.get(node), True
        while scope is not None:
            if isinstance(scope, ast.ClassDef) and not own:
                scope = self.scope_of.get(scope)
                continue
            if name in self.global_names.get(scope, ()):
                scope, own = self.tree, False
            yield scope, own
            own = own and isinstance(scope, COMPS)
            scope = self.scope_of.get(scope)

    def binding_value(self, node: ast.AST) -> ast.AST | None:
        """The expression a Name was last assigned (plain ``x = expr`` only)."""
        if isinstance(node, ast.Name):
            b = self.lookup(node)
            if b is not None and b[1] == "value" and not b[3]:
                return b[2]
        return None

    # ---- calls grouped by frame

    def calls_in(self, scope: ast.AST) -> list[ast.Call]:
        """The calls that run in ``scope``'s frame, in source order."""
        if "by_frame" not in self.memo:
            groups = defaultdict(list)
            for call in self.nodes[ast.Call]:
                groups[self.function_scope(call)].append(call)
            for calls in groups.values():
                calls.sort(key=pos)
            self.memo["by_frame"] = groups
        return self.memo["by_frame"].get(scope, [])

    def backward_mentions(self, scope: ast.AST, name: str) -> bool:
        """A ``.backward()`` (or autograd.backward/grad) in ``scope`` is called on an
        expression that uses ``name``, directly or through a variable assigned from it."""
        return any(self._mentions(expr, name) for call in self.calls_in(scope)
                   for expr in self._backward_operands(call))

    def _mentions(self, expr: ast.AST, name: str) -> bool:
        """``expr`` uses ``name``, directly or through a variable assigned from it."""
        return any(self._reads(n, name) for n in [expr, *ast.walk(expr)] if isinstance(n, ast.Name))

    def _backward_operands(self, call: ast.Call) -> list[ast.AST]:
        """What a backward call differentiates: ``x`` of ``x.backward()``, the first argument of
        ``torch.autograd.backward``/``grad``; nothing for another call."""
        q = self.qualname(call.func)
        if is_backward(call):
            return [call.func.value]
        if q in ("torch.autograd.backward", "torch.autograd.grad"):
            return list(call.args[:1])
        return []

    def _reads(self, n: ast.Name, name: str) -> bool:
        """``n`` is ``name``, or a variable assigned from an expression that uses ``name``."""
        if n.id == name:
            return True
        value = self.binding_value(n)
        return value is not None and any(is_name(v, name) for v in ast.walk(value))


def _imported_name(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> tuple[str, str] | None:
    """The local name ``alias`` of an import binds and the qualified name it stands for; None for
    a relative or star import (nothing this analysis resolves)."""
    if isinstance(node, ast.Import):
        local = alias.asname or alias.name.split(".")[0]
        return local, alias.name if alias.asname else local
    return _imported_from(node, alias)


def _imported_from(node: ast.ImportFrom, alias: ast.alias) -> tuple[str, str] | None:
    if node.level == 0 and node.module and alias.name != "*":
        return alias.asname or alias.name, f"{node.module}.{alias.name}"
    return None


def _same_length_displays(target: ast.Tuple | ast.List, value: ast.AST | None) -> bool:
    """``a, b = x, y``: a tuple or list display of as many elements as the target, none starred."""
    return (isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
            and not any(isinstance(e, ast.Starred) for e in value.elts + target.elts))


def _last_before(binds: list, where: tuple[int, int]) -> tuple | None:
    """The last of ``binds`` (in source order) made at or before ``where``."""
    return next((b for b in reversed(binds) if b[0] <= where), None)
