"""Rules about how a model is written: submodules it does not register, dropout that
ignores eval(), ``.data`` that hides a change from autograd, in-place writes to expanded views.
"""

from __future__ import annotations

import ast
import re
from typing import Callable, Iterator

from torch_tricks.doctor.analysis import (CONTAINERS, DROPOUT_FNS, FileAnalysis, NOWHERE, STATELESS_MODULES,
                                          backward_after, called_method, dotted, enclosing_function, forward_before,
                                          has_star_args, pos, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule


@static_rule
class ModuleInPlainContainer(StaticRule):
    id = "TT101"
    name = "module-in-plain-container"
    severity = "error"
    source = "X (plain-list submodules); seeds/003 网络模型构建 §1-2 (nn.Sequential和nn.ModuleList的区别)"
    message = "submodules kept in a plain list/dict attribute are not registered: use nn.ModuleList / nn.ModuleDict"
    explanation = ("An nn.Module registers only submodules assigned to it directly or held in nn.ModuleList, "
                   "nn.ModuleDict or nn.Sequential. Layers in a plain list or dict attribute are invisible to "
                   "parameters(), state_dict(), .to()/.cuda(), train()/eval() and DDP: the optimizer never updates "
                   "them, checkpoints lose them, they stay on the CPU, and nothing raises. Fix: "
                   "self.layers = nn.ModuleList([...]) or nn.ModuleDict({...}) (a nested list needs a ModuleList "
                   "at every level).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for cls in f.nodes[ast.ClassDef]:
            if f.is_module_class(cls):
                yield from _unregistered_in_class(f, cls)


def _unregistered_in_class(f: FileAnalysis, cls: ast.ClassDef) -> Iterator[tuple[ast.AST, str]]:
    """The places in the methods of ``cls`` that put modules into a plain container attribute."""
    wrapped, registers = _wrapped_and_registers(f, cls)
    if registers:
        return  # add_module / setattr: it may register the plain container's items itself
    for method in cls.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _plain_container_writes(f, method, wrapped)


def _wrapped_and_registers(f: FileAnalysis, cls: ast.ClassDef) -> tuple[set[str], bool]:
    """The attribute names that some method of ``cls`` hands to nn.ModuleList / nn.ModuleDict /
    nn.Sequential (registered after all), and whether it registers submodules by name
    (``add_module``, ``register_module``, ``setattr``)."""
    wrapped, registers = set(), False
    for call in _calls_in_methods(cls):
        if f.qualname(call.func) in CONTAINERS:
            wrapped.update(a.attr for a in ast.walk(call) if isinstance(a, ast.Attribute))
        registers = registers or _registers_by_name(call)
    return wrapped, registers


def _calls_in_methods(cls: ast.ClassDef) -> Iterator[ast.Call]:
    """The calls in the frames of the methods of ``cls``."""
    return (inner for node in walk_local(cls) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for inner in walk_local(node) if isinstance(inner, ast.Call))


def _registers_by_name(call: ast.Call) -> bool:
    """``self.add_module(name, m)``, ``self.register_module(name, m)``, ``setattr(self, name, m)``."""
    name = dotted(call.func) or ""
    return name.rsplit(".", 1)[-1] in ("add_module", "register_module") or name == "setattr"


def _plain_container_writes(f: FileAnalysis, method: ast.AST, wrapped: set[str]) -> Iterator[tuple[ast.AST, str]]:
    """In ``method``, the places that put modules into a plain container attribute of ``self``:
    ``self.x = [modules]``, or ``self.x[k] = module`` / ``self.x.append(module)`` after
    ``self.x = []`` (attributes in ``wrapped`` excepted)."""
    me = _self_name(method)
    if me is None:
        return
    empty: dict[str, str] = {}  # self.<attr> = [] / {} seen so far: attr -> container
    for node in _assignments_and_calls(method):
        emptied = _emptied_attr(node, me)
        if emptied is not None:
            empty[emptied[0]] = emptied[1]
            continue
        finding = _plain_assignment(f, node, me, wrapped) or _plain_fill(f, node, me, empty, wrapped)
        if finding is not None:
            yield finding


def _assignments_and_calls(method: ast.AST) -> list[ast.Assign | ast.Call]:
    """The assignments and calls in ``method``'s frame, in source order."""
    return sorted((n for n in walk_local(method) if isinstance(n, (ast.Assign, ast.Call))), key=pos)


def _self_name(method: ast.AST) -> str | None:
    """The name of the first parameter of ``method`` (``self``), None if it has none."""
    args = method.args.posonlyargs + method.args.args
    return args[0].arg if args else None


def _self_attr_assigned(node: ast.AST, me: str) -> str | None:
    """``x`` for ``self.x = ...``."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_self_attr(node.targets[0], me):
        return node.targets[0].attr
    return None


def _emptied_attr(node: ast.AST, me: str) -> tuple[str, str] | None:
    """(``x``, the container) for ``self.x = []`` / ``{}`` / ``list()``."""
    attr = _self_attr_assigned(node, me)
    container = _container(node.value) if attr is not None else None
    return (attr, container) if container and _is_empty(node.value) else None


def _plain_assignment(f: FileAnalysis, node: ast.AST, me: str, wrapped: set[str]) -> tuple[ast.AST, str] | None:
    """The finding for ``self.x = [modules]`` (``x`` not in ``wrapped``)."""
    attr = _self_attr_assigned(node, me)
    container = _container(node.value) if attr is not None else None
    if container and _holds_modules(f, node.value) and attr not in wrapped:
        return node, _plain_message(container, attr)
    return None


def _plain_fill(f: FileAnalysis, node: ast.AST, me: str, empty: dict[str, str],
                wrapped: set[str]) -> tuple[ast.AST, str] | None:
    """The finding for ``self.x[k] = module`` / ``self.x.append(module)`` where ``self.x`` was set to
    the empty container ``empty[x]`` (``x`` not in ``wrapped``)."""
    attr = _filled_attr(f, node, me, set(empty) - wrapped)
    return (node, _plain_message(empty[attr], attr)) if attr is not None else None


def _filled_attr(f: FileAnalysis, node: ast.AST, me: str, attrs: set[str]) -> str | None:
    """The attribute of ``attrs`` that ``node`` puts a module into: ``self.x[k] = module``,
    ``self.x.append(module)`` (``extend``, ``insert``, ``update``)."""
    if isinstance(node, ast.Assign):
        return _filled_by_index(f, node, me, attrs)
    if _fills(node) and _self_attr_in(node.func.value, me, attrs) and _puts_modules(f, node.args):
        return node.func.value.attr
    return None


def _filled_by_index(f: FileAnalysis, node: ast.Assign, me: str, attrs: set[str]) -> str | None:
    """``x`` of ``attrs`` for ``self.x[k] = module``."""
    target = node.targets[0] if len(node.targets) == 1 else None
    if isinstance(target, ast.Subscript) and _self_attr_in(target.value, me, attrs) and _is_module(f, node.value):
        return target.value.attr
    return None


def _self_attr_in(node: ast.AST, me: str, attrs: set[str]) -> bool:
    """``node`` is ``self.x`` for an ``x`` of ``attrs``."""
    return _is_self_attr(node, me) and node.attr in attrs


def _puts_modules(f: FileAnalysis, args: list[ast.AST]) -> bool:
    return any(_is_module(f, a) or _holds_modules(f, a) for a in args)


def _fills(node: ast.AST) -> bool:
    """``x.append(...)`` / ``extend`` / ``insert`` / ``update``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
        "append", "extend", "insert", "update")


def _is_self_attr(node: ast.AST, me: str) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me


_CONTAINER_NODES = {ast.List: "list", ast.ListComp: "list", ast.Tuple: "tuple", ast.GeneratorExp: "generator",
                    ast.Dict: "dict", ast.DictComp: "dict"}


def _container(node: ast.AST) -> str | None:
    if _builtin_container_call(node):
        return node.func.id
    return _CONTAINER_NODES.get(type(node))


def _builtin_container_call(node: ast.AST) -> bool:
    """``list(...)``, ``tuple(...)``, ``dict(...)``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple", "dict")


def _is_empty(node: ast.AST) -> bool:
    if isinstance(node, (ast.List, ast.Tuple)):
        return not node.elts
    if isinstance(node, ast.Dict):
        return not node.keys
    return isinstance(node, ast.Call) and not node.args and not node.keywords


def _holds_modules(f: FileAnalysis, node: ast.AST) -> bool:
    return any(_is_module(f, e) or _holds_modules(f, e) for e in _elements(node))


def _elements(node: ast.AST) -> list[ast.AST]:
    """What a container display, comprehension or ``list(...)`` call holds."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return node.elts
    if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        return [node.elt]
    if isinstance(node, ast.Dict):
        return node.values
    if isinstance(node, ast.DictComp):
        return [node.value]
    return node.args if _builtin_container_call(node) else []


def _is_module(f: FileAnalysis, node: ast.AST) -> bool:
    """A stateful module: parameters, buffers or train/eval behaviour to lose."""
    if isinstance(node, ast.Starred):
        node = node.value
    k = f.kind(node)
    return k is not None and k.cat == "module" and k.detail not in STATELESS_MODULES


def _plain_message(container: str, attr: str) -> str:
    fix = "nn.ModuleDict" if container == "dict" else "nn.ModuleList"
    return (f"submodules kept in a plain {container} `self.{attr}` are not registered (not trained, saved or "
            f"moved): use {fix}")


@static_rule
class FunctionalDropoutAlwaysOn(StaticRule):
    id = "TT102"
    name = "functional-dropout-always-on"
    severity = "error"
    source = "X (F.dropout without training=); seeds/003 测试阶段 §3 (Dropout里需要设置训练标志位)"
    message = "F.dropout without training= stays on after model.eval(): pass training=self.training or use nn.Dropout"
    explanation = ("torch.nn.functional.dropout defaults to training=True, so inside forward() it keeps dropping "
                   "activations after model.eval(): evaluation is random and wrong. Fix: "
                   "F.dropout(x, p, training=self.training), or an nn.Dropout(p) submodule, which follows the "
                   "module's train/eval mode.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            q = f.qualname(call.func)
            if q in DROPOUT_FNS and _dropout_always_on(f, call):
                fn = q.rsplit(".", 1)[-1]
                yield call, (f"F.{fn} without training= stays on after model.eval(): pass training=self.training "
                             f"or use an nn.Dropout module")


def _dropout_always_on(f: FileAnalysis, call: ast.Call) -> bool:
    """``call`` (a functional dropout) stays on in eval mode: it is in a method, passes no ``training=``
    (nor maybe one through ``*args`` or a third positional argument), and no ``self.training`` guards it."""
    if _may_pass_training(call) or f.method_class(call) is None:
        return False
    return not _guarded(f, call, _tests_training)  # `if self.training: x = F.dropout(x, p)` runs only in training


def _may_pass_training(call: ast.Call) -> bool:
    return has_star_args(call) or len(call.args) >= 3 or any(kw.arg == "training" for kw in call.keywords)


@static_rule
class TensorDataAttribute(StaticRule):
    id = "TT103"
    name = "tensor-data-attribute"
    severity = "warning"
    source = "X (.data instead of .detach()); seeds/003 Tensor的操作 §6 (data和detach()的区别)"
    message = "`.data` hides changes from autograd: a write before backward, or a read in forward, breaks gradients"
    explanation = ("x.data gives the tensor's values with autograd's checks cut off: an in-place change through it "
                   "is not recorded, so a backward pass that needs the old values computes wrong gradients instead "
                   "of raising; and a module's own parameter read through .data in forward gets no gradient from "
                   "that use. Fix: update parameters in place inside `with torch.no_grad():` (p.mul_(...), "
                   "p.copy_(...)), and use the parameter itself in forward (x.detach() where no gradient is meant). "
                   "Quiet where .data changes nothing: reads outside forward (p.grad.data.norm(), outputs.data for "
                   "an argmax), writes under no_grad, writes with no backward after them in the function (a manual "
                   "SGD step, a conversion that swaps a parameter's tensor), and weight initialisation (__init__, "
                   "init_weights, reset_parameters, a function given to module.apply), before any graph exists.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        """Only where ``.data`` changes what is computed: a write through it (in place, or replacing it) with
        autograd on between a forward (a module or loss called) and a ``.backward()`` in the same function,
        whose graph may hold the old values;
        or a read of a module's own tensor inside its ``forward`` that feeds the output (the parameter then
        gets no gradient through it). Reads elsewhere (``p.grad.data.norm()``, ``outputs.data`` for an
        argmax), writes under ``torch.no_grad()``, in init code or with no backward to follow (a manual SGD
        step after backward, a conversion that swaps a parameter's tensor) change nothing: quiet."""
        for node in f.nodes[ast.Attribute]:
            message = _data_message(f, node) if _tensor_data(f, node) else None
            if message is not None:
                yield node, message


def _tensor_data(f: FileAnalysis, node: ast.Attribute) -> bool:
    """``x.data`` on a tensor ``x``."""
    if node.attr != "data":
        return False
    k = f.kind(node.value)
    return k is not None and k.cat == "tensor"


def _data_message(f: FileAnalysis, node: ast.Attribute) -> str | None:
    """TT103's message for ``node`` (an ``x.data``) where it changes what is computed."""
    func = enclosing_function(f, node)
    if _written_through(f, node):
        if _write_changes_nothing(f, node, func):
            return None
        return ("writing through `.data` before the backward of a graph that may use it: autograd does not see "
                "the change and computes wrong gradients; change it after backward, under torch.no_grad()")
    if _own_tensor_in_forward(f, node, func):
        return (f"`{ast.unparse(node)}` in forward cuts the gradient: `{ast.unparse(node.value)}` is not "
                "trained through this use (use it directly, or .detach() if that is meant)")
    return None


def _written_through(f: FileAnalysis, node: ast.Attribute) -> bool:
    """``node`` is assigned (``x.data = y``, ``x.data += y``), assigned into (``x.data[i] = y``), or
    changed by an in-place method (``x.data.mul_(...)``)."""
    parent = f.parent.get(node)
    if isinstance(node.ctx, ast.Store) or (isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)):
        return True
    return _in_place_method(f, parent)


def _in_place_method(f: FileAnalysis, parent: ast.AST) -> bool:
    """``parent`` is an in-place method of its receiver, in a call: ``x.data.mul_(...)``."""
    return isinstance(parent, ast.Attribute) and _in_place(parent.attr) and isinstance(f.parent.get(parent), ast.Call)


def _in_place(method: str) -> bool:
    """A method name in torch's in-place spelling: ``add_``, ``copy_`` (not ``__iadd__``)."""
    return method.endswith("_") and not method.startswith("_")


def _write_changes_nothing(f: FileAnalysis, node: ast.AST, func: ast.AST | None) -> bool:
    """A write under no_grad, in init code, or not between a forward and a backward: no graph sees it."""
    return f.no_grad(node) or _init_code(f, func) or not (forward_before(f, node) and backward_after(f, node))


_INIT_NAME = re.compile(r"(^|_)(init|initialize|initialise|reset)(_|$)|^__init__$|_init$|^init", re.IGNORECASE)


def _init_code(f: FileAnalysis, func: ast.AST | None) -> bool:
    """A function that builds or (re)initialises weights (``__init__``, ``init_weights``, ``_init_weights``,
    ``reset_parameters`` ...), or one passed to ``module.apply``: no autograd graph holds them yet."""
    if func is None:
        return False
    return _INIT_NAME.search(func.name) is not None or _applied(f, func.name)


def _applied(f: FileAnalysis, name: str) -> bool:
    """The function ``name`` is passed to some ``x.apply(...)``."""
    return any(called_method(c) == "apply" and _passed(c, name)
               for c in f.nodes[ast.Call])


def _passed(call: ast.Call, name: str) -> bool:
    return any(isinstance(a, ast.Name) and a.id == name for a in call.args)


_INSPECTIONS = ("shape", "size", "dtype", "device", "clone", "cpu", "numpy", "tolist", "item", "norm", "dim", "numel")


def _own_tensor_in_forward(f: FileAnalysis, node: ast.Attribute, func: ast.AST | None) -> bool:
    """``self.<name>.data`` read in the ``forward`` of an nn.Module class, not under no_grad, and not
    only to be detached, copied or inspected (``.clone()``, ``.shape`` ...)."""
    if func is None or func.name != "forward" or f.no_grad(node) or not _in_module_class(f, func):
        return False
    return _is_self_attr(node.value, "self") and not _inspected(f.parent.get(node))


def _inspected(parent: ast.AST) -> bool:
    """``parent`` (of an ``x.data``) only detaches, copies or inspects it: ``.clone()``, ``.shape``."""
    return isinstance(parent, ast.Attribute) and parent.attr in _INSPECTIONS


def _in_module_class(f: FileAnalysis, func: ast.AST) -> bool:
    """``func`` is a method of an nn.Module class."""
    owner = f.parent.get(func)
    return isinstance(owner, ast.ClassDef) and f.is_module_class(owner)


def _guarded(f: FileAnalysis, node: ast.AST, test_ok: Callable[[ast.AST], bool]) -> bool:
    """``node`` runs only when a condition ``test_ok`` recognises holds: it sits in the
    body of ``if cond:`` / ``a if cond else b`` (or of ``if not cond:`` / ``if cond: ... else:``
    in the negated branch), ``cond`` possibly one term of an ``and``, inside its function."""
    child = node
    for anc in f.local_ancestors(node):
        if _in_branch_where(anc, child, test_ok) or _after_exit_unless(anc, child, test_ok):
            return True
        child = anc
    parent = f.parent.get(child)  # the function itself: its top-level statements
    return isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and _after_exit_unless(parent, child, test_ok)


def _in_branch_where(anc: ast.AST, child: ast.AST, test_ok: Callable[[ast.AST], bool]) -> bool:
    """``anc`` is an ``if`` / ``a if cond else b`` whose branch ``child`` runs only when ``test_ok``'s
    condition holds."""
    return isinstance(anc, (ast.If, ast.IfExp)) and child is not anc.test and _holds(
        anc.test, _in_true_branch(anc, child), test_ok)


def _after_exit_unless(anc: ast.AST, child: ast.AST, test_ok: Callable[[ast.AST], bool]) -> bool:
    """``child`` is a statement of a block of ``anc`` that an early exit precedes: ``if not
    self.training: return x``."""
    for block in ("body", "orelse", "finalbody"):
        stmts = getattr(anc, block, None)
        if isinstance(stmts, list) and child in stmts and _exited_unless(stmts[:stmts.index(child)], test_ok):
            return True
    return False


def _in_true_branch(branch: ast.If | ast.IfExp, child: ast.AST) -> bool:
    """``child`` (the body or a statement of it, or the else part) runs when the test is true."""
    return child in branch.body if isinstance(branch, ast.If) else child is branch.body


def _holds(test: ast.AST, branch_true: bool, test_ok: Callable[[ast.AST], bool]) -> bool:
    """In the branch of ``test`` taken when it is ``branch_true``, a condition ``test_ok`` recognises holds."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _holds(test.operand, not branch_true, test_ok)
    if _every_term_holds(test, branch_true):
        return any(_holds(v, branch_true, test_ok) for v in test.values)
    return branch_true and test_ok(test) is True


def _every_term_holds(test: ast.AST, branch_true: bool) -> bool:
    """In the branch of ``test`` taken when it is ``branch_true``, each of its terms holds: an ``and``
    that is true, an ``or`` that is false."""
    return isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And if branch_true else ast.Or)


def _exited_unless(stmts: list[ast.stmt], test_ok: Callable[[ast.AST], bool]) -> bool:
    """One of ``stmts`` is ``if not cond: return`` (or raise / continue / break): what follows
    runs only when ``cond`` holds."""
    return any(isinstance(stmt, ast.If) and _exits(stmt.body) and _holds(stmt.test, False, test_ok)
               for stmt in stmts)


def _exits(body: list) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _tests_training(test: ast.AST) -> bool | None:
    """True for ``self.training`` (any receiver), None for anything else."""
    return True if isinstance(test, ast.Attribute) and test.attr == "training" else None


_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad", "record_stream"})


@static_rule
class InplaceOnExpandedView(StaticRule):
    id = "TT104"
    name = "inplace-on-expanded-view"
    severity = "error"
    source = "X (expand() then in-place write); seeds/003 Pytorch 使用陷阱 §1 (expand, expand_as是共享内存的)"
    message = "in-place write to an expand()/expand_as() view, whose elements share memory: .clone() it first"
    explanation = ("expand(), expand_as() and broadcast_to() return views in which many elements share one memory "
                   "location. An in-place write through such a view either fails ('more than one element of the "
                   "written-to tensor refers to a single memory location') or, for index assignment, fill_ and "
                   "masked_fill_, silently writes every expanded copy and the source tensor. Fix: "
                   "y = x.expand(...).clone() before writing, or build the tensor with repeat().")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for name, use in _uses_of_expanded(f):
            node = _write_at(f, use)
            if node is not None:
                yield node, (f"in-place write to `{name}`, a view made by expand(): its elements share "
                             f"memory with each other and the source; .clone() it first")
        for call in f.nodes[ast.Call]:
            if _in_place_on_expand(f, call):
                yield call, (f"in-place {call.func.attr}() on an expand() view, whose elements share memory: "
                             f".clone() it first")


def _in_place_on_expand(f: FileAnalysis, call: ast.Call) -> bool:
    """``x.expand(...).add_(...)``: an in-place write straight on an expand() view."""
    func = call.func
    return isinstance(func, ast.Attribute) and _writes_in_place(func.attr) and _is_expand(f, func.value)


def _is_expand(f: FileAnalysis, value: ast.AST | None) -> bool:
    """``x.expand(...)``, ``x.expand_as(y)``, ``torch.broadcast_to(x, shape)``."""
    return isinstance(value, ast.Call) and (
        (isinstance(value.func, ast.Attribute) and value.func.attr in ("expand", "expand_as"))
        or f.qualname(value.func) == "torch.broadcast_to")


def _writes_in_place(method: str) -> bool:
    """An in-place method that writes the tensor's elements (not ``requires_grad_`` and the like)."""
    return _in_place(method) and method not in _NOT_WRITES


def _uses_of_expanded(f: FileAnalysis) -> Iterator[tuple[str, ast.Name]]:
    """(name, use) for each use of a name while it is bound to an expand() view."""
    for frame, name, b, stop in _expanded_bindings(f):
        for use in f.uses[frame].get(name, ()):
            if b[0] <= pos(use) < stop and f.lookup(use) is b:
                yield name, use


def _expanded_bindings(f: FileAnalysis) -> Iterator[tuple[ast.AST, str, tuple, tuple[int, int]]]:
    """(frame, name, binding, where the next binding of the name starts) for each binding of a name
    to an expand() view."""
    for scope, table in f.bindings.items():
        frame = f.frame_of(scope)
        for name, binds in table.items():
            for i, b in enumerate(binds):
                if _binds_expand(f, b):
                    yield frame, name, b, _binding_end(binds, i)


def _binds_expand(f: FileAnalysis, b: tuple) -> bool:
    """The binding ``b`` assigns a whole expand() view (not a part unpacked from one)."""
    return b[1] == "value" and not b[3] and _is_expand(f, b[2])


def _binding_end(binds: list[tuple], i: int) -> tuple[int, int]:
    """Where the binding ``binds[i]`` of a name stops holding: at the next one, else NOWHERE."""
    return binds[i + 1][0] if i + 1 < len(binds) else NOWHERE


def _write_at(f: FileAnalysis, use: ast.Name) -> ast.AST | None:
    """The write through ``use``: ``use.add_(...)``, ``use[i] = ...``, ``use += ...``."""
    parent = f.parent.get(use)
    if _in_place_write_call(f, parent):
        return f.parent[parent]
    if _assigned_through(parent, use):
        return parent
    return None


def _in_place_write_call(f: FileAnalysis, method: ast.AST) -> bool:
    """``method`` is an in-place method that writes, called: ``x.add_`` in ``x.add_(1)``."""
    call = f.parent.get(method)
    return isinstance(method, ast.Attribute) and _writes_in_place(method.attr) and isinstance(
        call, ast.Call) and call.func is method


def _assigned_through(parent: ast.AST, use: ast.Name) -> bool:
    """``parent`` assigns through ``use``: ``use[i] = ...`` or ``use += ...``."""
    if isinstance(parent, ast.Subscript):
        return parent.value is use and isinstance(parent.ctx, ast.Store)
    return isinstance(parent, ast.AugAssign) and parent.target is use
