"""Rules about how a model is written: submodules it does not register, dropout that
ignores eval(), ``.data`` that hides a change from autograd, in-place writes to expanded views.
"""

from __future__ import annotations

import ast
import re
from typing import Callable, Iterator

from torch_tricks.doctor.analysis import (CONTAINERS, DROPOUT_FNS, FileAnalysis, NOWHERE, STATELESS_MODULES,
                                          backward_after, dotted, enclosing_function, forward_before, has_star_args,
                                          pos, walk_local)
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
            if not f.is_module_class(cls):
                continue
            wrapped, registers = _wrapped_and_registers(f, cls)
            if registers:
                continue  # add_module / setattr: it may register the plain container's items itself
            for method in cls.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield from _plain_container_writes(f, method, wrapped)


def _wrapped_and_registers(f: FileAnalysis, cls: ast.ClassDef) -> tuple[set[str], bool]:
    """The attribute names that some method of ``cls`` hands to nn.ModuleList / nn.ModuleDict /
    nn.Sequential (registered after all), and whether it registers submodules by name
    (``add_module``, ``register_module``, ``setattr``)."""
    wrapped, registers = set(), False
    for node in walk_local(cls):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in walk_local(node):
            if not isinstance(inner, ast.Call):
                continue
            if f.qualname(inner.func) in CONTAINERS:
                wrapped.update(a.attr for a in ast.walk(inner) if isinstance(a, ast.Attribute))
            name = dotted(inner.func) or ""
            registers = registers or name.rsplit(".", 1)[-1] in ("add_module", "register_module") or name == "setattr"
    return wrapped, registers


def _plain_container_writes(f: FileAnalysis, method: ast.AST, wrapped: set[str]) -> Iterator[tuple[ast.AST, str]]:
    """In ``method``, the places that put modules into a plain container attribute of ``self``:
    ``self.x = [modules]``, or ``self.x[k] = module`` / ``self.x.append(module)`` after
    ``self.x = []`` (attributes in ``wrapped`` excepted)."""
    args = method.args.posonlyargs + method.args.args
    if not args:
        return
    me = args[0].arg
    empty: dict[str, str] = {}  # self.<attr> = [] / {} seen so far: attr -> container
    for node in sorted((n for n in walk_local(method) if isinstance(n, (ast.Assign, ast.Call))), key=pos):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_self_attr(node.targets[0], me):
            attr, container = node.targets[0].attr, _container(node.value)
            if container and _is_empty(node.value):
                empty[attr] = container
            elif container and _holds_modules(f, node.value) and attr not in wrapped:
                yield node, _plain_message(container, attr)
            continue
        attr = _filled_attr(f, node, me, set(empty) - wrapped)
        if attr is not None:
            yield node, _plain_message(empty[attr], attr)


def _filled_attr(f: FileAnalysis, node: ast.AST, me: str, attrs: set[str]) -> str | None:
    """The attribute of ``attrs`` that ``node`` puts a module into: ``self.x[k] = module``,
    ``self.x.append(module)`` (``extend``, ``insert``, ``update``)."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        if (isinstance(target, ast.Subscript) and _is_self_attr(target.value, me) and target.value.attr in attrs
                and _is_module(f, node.value)):
            return target.value.attr
        return None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend", "insert", "update")
            and _is_self_attr(node.func.value, me) and node.func.value.attr in attrs
            and any(_is_module(f, a) or _holds_modules(f, a) for a in node.args)):
        return node.func.value.attr
    return None


def _is_self_attr(node: ast.AST, me: str) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me


def _container(node: ast.AST) -> str | None:
    if isinstance(node, (ast.List, ast.ListComp)):
        return "list"
    if isinstance(node, ast.Tuple):
        return "tuple"
    if isinstance(node, ast.GeneratorExp):
        return "generator"
    if isinstance(node, (ast.Dict, ast.DictComp)):
        return "dict"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple", "dict"):
        return node.func.id
    return None


def _is_empty(node: ast.AST) -> bool:
    return ((isinstance(node, (ast.List, ast.Tuple)) and not node.elts)
            or (isinstance(node, ast.Dict) and not node.keys)
            or (isinstance(node, ast.Call) and not node.args and not node.keywords))


def _holds_modules(f: FileAnalysis, node: ast.AST) -> bool:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        elements = node.elts
    elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        elements = [node.elt]
    elif isinstance(node, ast.Dict):
        elements = node.values
    elif isinstance(node, ast.DictComp):
        elements = [node.value]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple", "dict"):
        elements = node.args
    else:
        return False
    return any(_is_module(f, e) or _holds_modules(f, e) for e in elements)


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
            if q not in DROPOUT_FNS or has_star_args(call) or len(call.args) >= 3:
                continue
            if any(kw.arg == "training" for kw in call.keywords) or f.method_class(call) is None:
                continue
            if _guarded(f, call, _tests_training):
                continue  # `if self.training: x = F.dropout(x, p)` runs only in training
            fn = q.rsplit(".", 1)[-1]
            yield call, (f"F.{fn} without training= stays on after model.eval(): pass training=self.training "
                         f"or use an nn.Dropout module")


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
            if node.attr != "data":
                continue
            k = f.kind(node.value)
            if k is None or k.cat != "tensor":
                continue
            parent = f.parent.get(node)
            writes = isinstance(node.ctx, ast.Store) or (
                isinstance(parent, ast.Attribute) and parent.attr.endswith("_") and not parent.attr.startswith("_")
                and isinstance(f.parent.get(parent), ast.Call)) or (
                isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)) or (
                isinstance(parent, ast.AugAssign) and parent.target is node)
            func = enclosing_function(f, node)
            if writes:
                if f.no_grad(node) or _init_code(f, func) or not (forward_before(f, node) and backward_after(f, node)):
                    continue
                yield node, ("writing through `.data` before the backward of a graph that may use it: autograd does not see "
                             "the change and computes wrong gradients; change it after backward, under torch.no_grad()")
            elif _own_tensor_in_forward(f, node, func):
                yield node, (f"`{ast.unparse(node)}` in forward cuts the gradient: `{ast.unparse(node.value)}` is not "
                             "trained through this use (use it directly, or .detach() if that is meant)")


_INIT_NAME = re.compile(r"(^|_)(init|initialize|initialise|reset)(_|$)|^__init__$|_init$|^init", re.IGNORECASE)


def _init_code(f: FileAnalysis, func: ast.AST | None) -> bool:
    """A function that builds or (re)initialises weights (``__init__``, ``init_weights``, ``_init_weights``,
    ``reset_parameters`` ...), or one passed to ``module.apply``: no autograd graph holds them yet."""
    if func is None:
        return False
    if _INIT_NAME.search(func.name):
        return True
    return any(isinstance(c.func, ast.Attribute) and c.func.attr == "apply" and any(
        isinstance(a, ast.Name) and a.id == func.name for a in c.args) for c in f.nodes[ast.Call])


def _own_tensor_in_forward(f: FileAnalysis, node: ast.Attribute, func: ast.AST | None) -> bool:
    """``self.<name>.data`` read in the ``forward`` of an nn.Module class, not under no_grad, and not
    only to be detached, copied or inspected (``.clone()``, ``.shape`` ...)."""
    if func is None or func.name != "forward" or f.no_grad(node):
        return False
    owner = f.parent.get(func)
    if not (isinstance(owner, ast.ClassDef) and f.is_module_class(owner)):
        return False
    value = node.value
    if not (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self"):
        return False
    parent = f.parent.get(node)
    return not (isinstance(parent, ast.Attribute) and parent.attr in (
        "shape", "size", "dtype", "device", "clone", "cpu", "numpy", "tolist", "item", "norm", "dim", "numel"))


def _guarded(f: FileAnalysis, node: ast.AST, test_ok: Callable[[ast.AST], bool]) -> bool:
    """``node`` runs only when a condition ``test_ok`` recognises holds: it sits in the
    body of ``if cond:`` / ``a if cond else b`` (or of ``if not cond:`` / ``if cond: ... else:``
    in the negated branch), ``cond`` possibly one term of an ``and``, inside its function."""
    child = node
    for anc in f.local_ancestors(node):
        if isinstance(anc, (ast.If, ast.IfExp)) and child is not anc.test and _holds(
                anc.test, _in_true_branch(anc, child), test_ok):
            return True
        for block in ("body", "orelse", "finalbody"):  # an early exit: `if not self.training: return x`
            stmts = getattr(anc, block, None)
            if isinstance(stmts, list) and child in stmts and _exited_unless(stmts[:stmts.index(child)], test_ok):
                return True
        child = anc
    parent = f.parent.get(child)  # the function itself: its top-level statements
    return (isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and child in parent.body
            and _exited_unless(parent.body[:parent.body.index(child)], test_ok))


def _in_true_branch(branch: ast.If | ast.IfExp, child: ast.AST) -> bool:
    """``child`` (the body or a statement of it, or the else part) runs when the test is true."""
    return child in branch.body if isinstance(branch, ast.If) else child is branch.body


def _holds(test: ast.AST, branch_true: bool, test_ok: Callable[[ast.AST], bool]) -> bool:
    """In the branch of ``test`` taken when it is ``branch_true``, a condition ``test_ok`` recognises holds."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _holds(test.operand, not branch_true, test_ok)
    if branch_true and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_holds(v, True, test_ok) for v in test.values)
    if not branch_true and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return any(_holds(v, False, test_ok) for v in test.values)
    return branch_true and test_ok(test) is True


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
        def is_expand(value) -> bool:
            return isinstance(value, ast.Call) and (
                (isinstance(value.func, ast.Attribute) and value.func.attr in ("expand", "expand_as"))
                or f.qualname(value.func) == "torch.broadcast_to")

        def write_at(use: ast.Name):
            parent = f.parent.get(use)
            if (isinstance(parent, ast.Attribute) and parent.attr.endswith("_") and not parent.attr.startswith("_")
                    and parent.attr not in _NOT_WRITES and isinstance(f.parent.get(parent), ast.Call)
                    and f.parent[parent].func is parent):
                return f.parent[parent]
            if isinstance(parent, ast.Subscript) and parent.value is use and isinstance(parent.ctx, ast.Store):
                return parent
            if isinstance(parent, ast.AugAssign) and parent.target is use:
                return parent
            return None

        for scope, table in f.bindings.items():
            frame = f.frame_of(scope)
            for name, binds in table.items():
                for i, b in enumerate(binds):
                    if b[1] != "value" or b[3] or not is_expand(b[2]):
                        continue
                    stop = binds[i + 1][0] if i + 1 < len(binds) else NOWHERE
                    for use in f.uses[frame].get(name, ()):
                        if b[0] <= pos(use) < stop and f.lookup(use) is b:
                            node = write_at(use)
                            if node is not None:
                                yield node, (f"in-place write to `{name}`, a view made by expand(): its elements share "
                                             f"memory with each other and the source; .clone() it first")
        for call in f.nodes[ast.Call]:
            func = call.func
            if (isinstance(func, ast.Attribute) and func.attr.endswith("_") and not func.attr.startswith("_")
                    and func.attr not in _NOT_WRITES and is_expand(func.value)):
                yield call, f"in-place {func.attr}() on an expand() view, whose elements share memory: .clone() it first"
