"""The kind of an expression in its file: :class:`KindInference`, a mixin of :class:`FileAnalysis`.

:meth:`KindInference.kind` follows a name to its binding (an assignment, a loop over a loader, a
parameter and what the calls of its function pass), an attribute to the ``self.x = ...`` of its
class, a call to what it builds or returns; memoised, and bounded against cycles. The pure parts
(what ``torch.nn.Linear(...)`` builds, what ``t.view()`` gives) are in
:mod:`~torch_tricks.doctor.analysis.kind`.

A mixin, not a class of its own: it reads the index that
:class:`~torch_tricks.doctor.analysis.file.FileAnalysis` builds (``parent``, ``bindings``,
``uses``, ``self_attrs``, ``calls_by_name``, ``plain_functions``, ``memo``, ``_kinds``, ``_busy``)
and calls its methods (:meth:`lookup`, :meth:`qualname`, :meth:`function_scope`) and those of
:class:`~torch_tricks.doctor.analysis.classes.ModuleClasses` (:meth:`output_activation`,
:meth:`element_activation`, :meth:`is_module_kind`, :meth:`is_module_class`,
:meth:`_bases_to_search`), with which FileAnalysis composes it.
"""

from __future__ import annotations

import ast

from torch_tricks.doctor.analysis.kind import (_PARAMETER_METHODS, _TENSOR_RESULTS, LOSS, TENSOR, Kind, _agreed_kind,
                                               _category, _element_of, _is_local_instance, _is_nn_module_class,
                                               _item_kind, _library_object_kind, _nn_object_kind, _same_kind,
                                               _takes_tensors, _tensor_attribute_kind, _tensor_function_kind,
                                               _tensor_method_kind)
from torch_tricks.doctor.analysis.syntax import (_called_function, _constant_index, _is_called, called_method,
                                                 dotted, is_name, kwarg, walk_local)
from torch_tricks.doctor.analysis.vocab import (_SAME_ELEMENTS, LOADERISH, MODULE_ONLY_METHODS, MODULE_SELF_METHODS,
                                                RNN_MODULES, SHAPE_METHODS, WRAPPERS)


class KindInference:
    """What an expression of the file evaluates to (:meth:`kind`), memoised."""

    def kind(self, node: ast.AST | None) -> Kind | None:
        """What ``node`` evaluates to, or None when the file does not show it."""
        if node is None:
            return None
        if node in self._kinds:
            return self._kinds[node]
        if node in self._busy or len(self._busy) > 60:
            return None
        self._busy.add(node)
        try:
            k = self._kind(node)
        finally:
            self._busy.discard(node)
        self._kinds[node] = k
        return k

    def _kind(self, node: ast.AST) -> Kind | None:
        if isinstance(node, ast.Name):
            return self._name_kind(node)
        if isinstance(node, ast.Call):
            return self._call_kind(node)
        if isinstance(node, ast.Attribute):
            return self._attribute_kind(node)
        if isinstance(node, ast.Subscript):
            act = self._call_element_activation(node.value, (_constant_index(node.slice),))
            return Kind("tensor", act) if act is not None else _item_kind(self.kind(node.value))
        return self._operation_kind(node)

    def _operation_kind(self, node: ast.AST) -> Kind | None:
        """A tensor for arithmetic with a tensor; for ``a if c else b``, the kind both branches share."""
        if isinstance(node, ast.BinOp):
            return TENSOR if self._is_tensor(node.left) or self._is_tensor(node.right) else None
        if isinstance(node, ast.IfExp):
            return _same_kind(self.kind(node.body), self.kind(node.orelse))
        return None

    def _name_kind(self, node: ast.Name) -> Kind | None:
        b = self.lookup(node)
        return self._binding_kind(b) if b is not None else None

    def _is_tensor(self, node: ast.AST) -> bool:
        return _category(self.kind(node)) == "tensor"

    def _binding_kind(self, b) -> Kind | None:
        _, how, a, extra = b
        if how == "value":
            return self._assigned_kind(a, extra)
        if how == "for":
            return self._element_kind(a.iter, extra)
        if how == "aug":
            return self._augmented_kind(a, b)
        if how == "param":
            return self._param_kind(a, extra)
        if how == "def":
            return Kind("class" if isinstance(a, ast.ClassDef) else "func", ref=a)
        return None

    def _augmented_kind(self, stmt: ast.AugAssign, binding: tuple) -> Kind | None:
        """``x += v`` keeps the kind of the value of ``x`` before it."""
        return self.kind(stmt.target) if self.lookup(stmt.target) is not binding else None

    def _assigned_kind(self, value: ast.AST, path: tuple) -> Kind | None:
        """The kind of a name assigned ``value`` (at ``path`` into it when unpacked: the elements of a
        tensor, as from torch.max or chunk, are tensors)."""
        if path:
            act = self._call_element_activation(value, path)
            return Kind("tensor", act) if act is not None else (TENSOR if self._is_tensor(value) else None)
        return self.kind(value)

    def _call_element_activation(self, value: ast.AST, path: tuple) -> str | None:
        """The activation of element ``path[0]`` of what a call of a module of this file returns."""
        if len(path) != 1 or not isinstance(path[0], int) or not isinstance(value, ast.Call):
            return None
        return self.element_activation(self.kind(value.func), path[0])

    def _element_kind(self, it: ast.AST, path: tuple) -> Kind | None:
        """The kind of the loop variable at ``path`` in ``for <target> in it``."""
        unwrapped = self._unwrap_iterable(it, path)
        if unwrapped is None:
            return None
        it, path = unwrapped
        k = self.kind(it)
        if k is None and self.looks_like_loader(it):
            k = Kind("loader")
        return _element_of(k, path) if k is not None else None

    def _unwrap_iterable(self, it: ast.AST, path: tuple) -> tuple[ast.AST, tuple] | None:
        """The iterable under ``enumerate(...)`` / ``tqdm(...)`` / ``iter(...)`` and the path into its
        elements; None when the path picks ``enumerate``'s counter."""
        while isinstance(it, ast.Call) and it.args:
            fn = self.qualname(it.func) or _called_function(it)
            if fn == "enumerate":
                if path[:1] != (1,):  # the counter, or the whole (counter, element) pair
                    return None
                path, it = path[1:], it.args[0]
            elif fn in _SAME_ELEMENTS:
                it = it.args[0]
            else:
                break
        return it, path

    def looks_like_loader(self, node: ast.AST) -> bool:
        spelled = dotted(node)
        return spelled is not None and bool(LOADERISH.search(spelled.rsplit(".", 1)[-1]))

    def _param_kind(self, func: ast.AST, name: str) -> Kind | None:
        """A parameter's kind: ``self`` in a method; for a plain function, the kind every
        call in this file passes (when they all agree); failing that, what the function
        itself shows (:meth:`module_by_use`): a model passed in from another file is a module
        when it is annotated as one or the function calls ``.eval()``/``.parameters()`` on it."""
        if isinstance(func, ast.Lambda):
            return None
        positional = func.args.posonlyargs + func.args.args
        cls = self.parent.get(func)
        if isinstance(cls, ast.ClassDef):
            if _is_self_parameter(func, positional, name):
                return Kind("self", ref=cls)
            return self.module_by_use(func, name)
        if len(self.plain_functions.get(func.name, ())) != 1:
            return self.module_by_use(func, name)
        return self._kind_passed_in(func, name, positional)

    def _kind_passed_in(self, func: ast.AST, name: str, positional: list[ast.arg]) -> Kind | None:
        """The kind every call of the plain function ``func`` in this file passes as its parameter
        ``name``; :meth:`module_by_use` when none of them shows a kind (or there is no call)."""
        kinds = self._passed_kinds(func, name, positional)
        if kinds is None:
            return None
        if all(k is None for k in kinds):
            return self.module_by_use(func, name)
        if any(k is None for k in kinds):
            return None
        return _agreed_kind(kinds)

    def _passed_kinds(self, func: ast.AST, name: str, positional: list[ast.arg]) -> list[Kind | None] | None:
        """The kind each call of ``func`` in this file passes as its parameter ``name``; None when a
        call does not pass it (a default applies)."""
        index = next((i for i, a in enumerate(positional) if a.arg == name), None)
        kinds = []
        for call in self.calls_by_name.get(func.name, ()):
            arg = kwarg(call, name, index)
            if arg is None:
                return None
            kinds.append(self.kind(arg))
        return kinds

    def tensor_by_use(self, node: ast.Name) -> bool:
        """The value ``node`` reads (a name whose kind is unknown: a parameter, an element
        unpacked from a batch passed in) is used as a tensor in its function: ``.shape`` /
        ``.ndim`` read, a shape method called (``.view``, ``.unsqueeze``, ``.size()`` ...), or
        handed to a ``torch.*`` tensor function, through the same binding. Batch objects with an
        in-place ``.to()`` (PyG's ``Batch``, ``BatchEncoding``) have none of these."""
        binding = self.lookup(node)
        if binding is None or binding[1] not in ("value", "for", "param"):
            return False
        key = ("tensor_by_use", id(binding[2]), node.id, binding[0])
        if key in self.memo:
            return self.memo[key]
        uses = self.uses.get(self.function_scope(node), {}).get(node.id, ())
        found = any(self._used_as_tensor(use) for use in uses if self.lookup(use) is binding)
        self.memo[key] = found
        return found

    def _used_as_tensor(self, use: ast.Name) -> bool:
        """This read of a name shows a tensor: its ``.shape``/``.ndim``, a shape method called on
        it, or it handed to a torch tensor function."""
        parent = self.parent.get(use)
        if isinstance(parent, ast.Attribute) and parent.value is use:
            return self._is_shape_use(parent)
        if isinstance(parent, ast.Call) and use in parent.args:
            return _takes_tensors(self.qualname(parent.func))
        return False

    def _is_shape_use(self, attr: ast.Attribute) -> bool:
        """``x.shape``, ``x.ndim``, or a shape method called: ``x.view(...)``, ``x.size()`` ..."""
        return attr.attr in ("shape", "ndim") or (attr.attr in SHAPE_METHODS
                                                  and _is_called(attr, self.parent.get(attr)))

    def module_by_use(self, func: ast.AST, name: str) -> Kind | None:
        """``Kind("module")`` if parameter ``name`` of ``func`` is shown to be an nn.Module by
        the function itself: annotated ``nn.Module`` (or an nn class), or the receiver of a
        method only modules have (``.eval()``, ``.parameters()``, ``.named_modules()`` ...)
        while the name is never rebound. None otherwise."""
        key = ("module_by_use", func, name)
        if key in self.memo:
            return self.memo[key]
        args = func.args.posonlyargs + func.args.args + func.args.kwonlyargs
        arg = next((a for a in args if a.arg == name), None)
        found = self._module_shown_by(func, arg) if arg is not None else None
        self.memo[key] = found
        return found

    def _module_shown_by(self, func: ast.AST, arg: ast.arg) -> Kind | None:
        """The module kind the parameter ``arg`` of ``func`` is shown to have: by its annotation, or
        (never rebound) by a module-only method called on it."""
        q = self.qualname(arg.annotation) if arg.annotation is not None else None
        if _is_nn_module_class(q):
            return Kind("module", q)
        if any(b[1] != "param" for b in self.bindings.get(func, {}).get(arg.arg, ())):
            return None
        return Kind("module") if _calls_module_method_on(func, arg.arg) else None

    def _attribute_kind(self, node: ast.Attribute) -> Kind | None:
        if self.qualname(node) is not None:
            return None  # a module-level name such as torch.float16
        rk = self.kind(node.value)
        k = _tensor_attribute_kind(rk, node.attr)
        if k is not None:
            return k
        return self._self_attr_kind(rk.ref, node.attr) if _is_local_instance(rk) else None

    def _self_attr_kind(self, cls, attr: str, seen=None) -> Kind | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        entries = self.self_attrs.get(cls, {}).get(attr)
        if entries:
            return self._assigned_attr_kind(entries)
        bases, seen = self._bases_to_search(cls, seen)
        for base in bases:
            k = self._self_attr_kind(base, attr, seen)
            if k is not None:
                return k
        return None

    def _assigned_attr_kind(self, entries: list) -> Kind | None:
        """The kind every assignment ``self.attr = value`` of a class gives, when they agree."""
        kinds = [self._assigned_kind(value, path) for value, path, _ in entries]
        if kinds[0] is not None and all(k is not None and k.key() == kinds[0].key() for k in kinds):
            return kinds[0]
        return None

    def _call_kind(self, node: ast.Call) -> Kind | None:
        func = node.func
        q = self.qualname(func)
        if q is not None:
            return self.constructor_kind(q, node)
        if isinstance(func, ast.Attribute):
            return self._method_result_kind(func)
        return self._callable_result_kind(func)

    def _method_result_kind(self, func: ast.Attribute) -> Kind | None:
        """What calling the method ``func`` (``x.m``) gives, by the method and the kind of ``x``."""
        m = func.attr
        if m in _TENSOR_RESULTS:
            return _TENSOR_RESULTS[m]
        rk = self.kind(func.value)
        cat = _category(rk)
        if cat in (None, "module", "self") and m in _PARAMETER_METHODS:
            return Kind(_PARAMETER_METHODS[m])
        if cat == "tensor":
            return _tensor_method_kind(rk, m)
        if cat in ("module", "lossfn", "self") and m in MODULE_SELF_METHODS:
            return self._module_itself(rk)
        return self._callable_result_kind(func)

    def _module_itself(self, k: Kind) -> Kind | None:
        """What ``module.to(...)`` / ``.train()`` / ``.cuda()`` returns: the module (of a local class for ``self``)."""
        if k.cat in ("module", "lossfn"):
            return k
        return self._local_module(k.ref)

    def _local_module(self, cls) -> Kind | None:
        """An instance of the class ``cls`` of this file, when it is an nn.Module."""
        return Kind("module", "local", cls) if self.is_module_class(cls) else None

    def _callable_result_kind(self, func: ast.AST) -> Kind | None:
        """What calling the object ``func`` gives: a loss function's loss, a module's output, a local
        module class's instance."""
        fk = self.kind(func)  # a callable object: a loss, a module (self.fc, model.encoder), a class
        cat = _category(fk)
        if cat == "lossfn":
            return LOSS
        if cat == "class":
            return self._local_module(fk.ref)
        if cat == "module" and fk.detail in RNN_MODULES:
            return None  # (output, state): output is a PackedSequence when the input was packed
        if self.is_module_kind(fk):
            return Kind("tensor", self.output_activation(fk))
        return None

    def constructor_kind(self, q: str, node: ast.Call) -> Kind | None:
        if q in WRAPPERS and node.args:  # DataParallel(model), DDP(model), torch.compile(model) call model
            k = self.kind(node.args[0])
            return k if _category(k) == "module" else None
        return _nn_object_kind(q, node) or _library_object_kind(q, node) or _tensor_function_kind(q)


def _is_self_parameter(method: ast.AST, positional: list[ast.arg], name: str) -> bool:
    """``name`` is the first parameter of ``method`` (its ``self``: neither a staticmethod nor a classmethod)."""
    decorators = {dotted(d) for d in method.decorator_list}
    return bool(positional) and positional[0].arg == name and not decorators & {"staticmethod", "classmethod"}


def _calls_module_method_on(func: ast.AST, name: str) -> bool:
    """``func`` calls on ``name`` a method only modules have: ``name.eval()``, ``name.parameters()`` ..."""
    return any(called_method(node) in MODULE_ONLY_METHODS and is_name(node.func.value, name)
               for node in walk_local(func))
