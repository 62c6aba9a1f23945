"""The file's own classes: :class:`ModuleClasses`, a mixin of :class:`FileAnalysis`.

Which classes are nn.Modules (through torch.nn, Lightning, or a base class of the file), their
methods found through their local bases, and the activation a module's ``forward`` returns
(``softmax``/``log_softmax``/``sigmoid``, for the whole output or one element of a returned
tuple; through ``nn.Sequential`` down to its last layer). The rules on losses ask this to see an
activation applied twice.

A mixin: it reads FileAnalysis's ``classes`` and ``memo`` and calls its :meth:`qualname` and
:meth:`function_scope`, and :meth:`~torch_tricks.doctor.analysis.kinds.KindInference.kind`, with
which FileAnalysis composes it; KindInference calls back into it for a module's output.
"""

from __future__ import annotations

import ast

from torch_tricks.doctor.analysis.kind import (Kind, _activation, _category, _is_local_instance, _is_module_base,
                                               _sole_activation)
from torch_tricks.doctor.analysis.syntax import _put_last, is_name, pos, walk_local
from torch_tricks.doctor.analysis.vocab import ACT_MODULES


class ModuleClasses:
    """The nn.Module classes of the file, their methods and bases, and what their forward returns."""

    def output_activation(self, k: Kind) -> str | None:
        """``softmax``/``log_softmax``/``sigmoid`` if calling this module returns that."""
        if _is_local_instance(k):
            return self.forward_activation(k.ref)
        if k.cat != "module":
            return None
        if k.detail in ACT_MODULES:
            return ACT_MODULES[k.detail]
        if k.detail == "torch.nn.Sequential" and isinstance(k.ref, ast.Call) and k.ref.args:
            return self._last_layer_activation(k)
        return None

    def _last_layer_activation(self, k: Kind) -> str | None:
        """The output activation of the last layer of the ``nn.Sequential(...)`` of kind ``k``; for
        ``nn.Sequential(*layers)``, the layer last put in ``layers`` before it (appended, maybe under an ``if``)."""
        arg = k.ref.args[-1]
        if isinstance(arg, ast.Starred):
            arg = self._last_listed(arg.value, k.ref)
        last = self.kind(arg) if arg is not None else None
        if _category(last) == "module" and last is not k:
            return self.output_activation(last)
        return None

    def _last_listed(self, name: ast.AST, before: ast.AST) -> ast.AST | None:
        """The element last put into the list variable ``name`` before ``before``, in the same frame:
        ``name.append(x)``, ``name += [x]``, ``name = [..., x]``; None where the file does not show it."""
        if not isinstance(name, ast.Name):
            return None
        scope = self.function_scope(before)
        last: tuple[tuple[int, int], ast.AST] | None = None
        for node in walk_local(scope):
            item = _put_last(node, name.id)
            if item is not None and pos(node) < pos(before) and (last is None or pos(node) > last[0]):
                last = (pos(node), item)
        return last[1] if last is not None else None

    def forward_activation(self, cls) -> str | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        key = ("fwd", cls)
        if key not in self.memo:
            self.memo[key] = None  # while it is decided: a forward that calls itself shows none
            self.memo[key] = _sole_activation(self._returned_activations(cls))
        return self.memo[key]

    def element_activation(self, k: Kind | None, i: int) -> str | None:
        """The activation of element ``i`` of the tuple that calling the module of kind ``k`` returns
        (``out, feats = model(x)`` with ``return F.softmax(z, 1), feats``): the same in every ``return``."""
        cls = k.ref if _is_local_instance(k) else None
        if not isinstance(cls, ast.ClassDef):
            return None
        key = ("fwd", cls, i)
        if key not in self.memo:
            self.memo[key] = None  # while it is decided
            self.memo[key] = _sole_activation(self._returned_activations(cls, element=i))
        return self.memo[key]

    def _returned_activations(self, cls: ast.ClassDef, name: str = "forward", depth: int = 0,
                              element: int | None = None) -> set[str | None]:
        """The activation (None for none or not a tensor) of each value the class's ``forward`` returns
        (of its element ``element`` when a tuple); a ``return self.helper(x)`` of a method of the class
        counts the helper's returns (three calls deep)."""
        method = self.method(cls, name)
        if method is None:
            return set()
        out: set[str | None] = set()
        for node in walk_local(method):
            if isinstance(node, ast.Return):
                helper = _self_method_call(node.value)
                if helper is not None and depth < 3 and self.method(cls, helper) is not None:
                    out |= self._returned_activations(cls, helper, depth + 1, element)
                else:
                    out.add(_activation(self.kind(_returned_element(node.value, element))))
        return out

    def method(self, cls: ast.ClassDef, name: str, seen=None):
        own = _own_method(cls, name)
        if own is not None:
            return own
        bases, seen = self._bases_to_search(cls, seen)
        for base in bases:
            found = self.method(base, name, seen)
            if found is not None:
                return found
        return None

    def _bases_to_search(self, cls: ast.ClassDef, seen: set | None) -> tuple[list[ast.ClassDef], set]:
        """The local bases of ``cls`` not searched yet, and the classes searched once ``cls`` is
        (a guard against cyclic bases)."""
        seen = (seen or set()) | {cls}
        return [base for base in self.local_bases(cls) if base not in seen], seen

    def local_bases(self, cls: ast.ClassDef) -> list[ast.ClassDef]:
        return [self.classes[b.id] for b in cls.bases
                if isinstance(b, ast.Name) and b.id in self.classes and self.classes[b.id] is not cls]

    def is_module_kind(self, k: Kind | None) -> bool:
        """``k`` is an nn.Module: a module, or ``self`` in a module class."""
        cat = _category(k)
        return cat == "module" or (cat == "self" and self.is_module_class(k.ref))

    def is_module_class(self, cls) -> bool:
        """``cls`` derives from torch.nn.Module (directly, through an nn class, a Lightning
        module, or another class of this file)."""
        if not isinstance(cls, ast.ClassDef):
            return False
        key = ("module", cls)
        if key not in self.memo:
            self.memo[key] = False  # while it is decided: a cycle of bases makes no module
            self.memo[key] = self._derives_from_module(cls)
        return self.memo[key]

    def _derives_from_module(self, cls: ast.ClassDef) -> bool:
        return (any(_is_module_base(self.qualname(base)) for base in cls.bases)
                or any(self.is_module_class(b) for b in self.local_bases(cls)))


def _self_method_call(node: ast.AST | None) -> str | None:
    """``name`` of ``self.name(...)``; None for anything else."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_name(node.func.value, "self")):
        return node.func.attr
    return None


def _returned_element(value: ast.AST | None, element: int | None) -> ast.AST | None:
    """The value a ``return`` gives, or its element ``element`` when it returns a tuple display of
    more elements (None where it does not: the element is unknown)."""
    if element is None:
        return None if isinstance(value, ast.Tuple) else value
    if isinstance(value, ast.Tuple) and element < len(value.elts) and not any(
            isinstance(e, ast.Starred) for e in value.elts):
        return value.elts[element]
    return None


def _own_method(cls: ast.ClassDef, name: str) -> ast.AST | None:
    """The method ``name`` defined in the body of ``cls`` itself."""
    return next((stmt for stmt in cls.body
                 if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name), None)
