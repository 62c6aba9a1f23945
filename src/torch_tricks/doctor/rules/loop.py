"""Rules about the training loop itself: evaluation with autograd on or never switched
back to train(), a loss accumulated with its graph, backward() with autograd off, the
scheduler stepped before the optimizer, Adam's coupled weight decay.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import (LOOPS, NOWHERE, PARAMETER_FREE_MODULES, PARAMETER_FREE_NAME, FileAnalysis,
                                          ancestors_until, called_method, dotted, is_backward, is_false, is_name,
                                          kwarg, looks_like_model, number, optimizer_step, pos, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule


def is_test_path(path: str) -> bool:
    """``path`` is test code: under a ``tests``/``test`` folder, or a ``test_*.py`` / ``*_test.py`` file."""
    parts = path.replace("\\", "/").split("/")
    name = parts[-1]
    return any(p in ("tests", "test") for p in parts[:-1]) or name.startswith("test_") or name.endswith("_test.py")


@static_rule
class EvalWithoutNoGrad(StaticRule):
    id = "TT116"
    name = "eval-without-no-grad"
    severity = "warning"
    source = ("X (eval without no_grad); T13; seeds/003 测试阶段 §2b; seeds/001 基本操作 check list "
              "(用 eval() 和 with torch.no_grad())")
    message = "forward pass after model.eval() outside torch.no_grad()/inference_mode(): autograd still records the graph"
    explanation = ("model.eval() switches dropout and batch norm to inference behaviour; it does not stop "
                   "autograd. Without torch.no_grad() (or torch.inference_mode()) every evaluation forward keeps "
                   "its activations for a backward pass that never comes: more memory, slower. Fix: wrap the loop "
                   "in `with torch.no_grad():` or decorate the function with @torch.no_grad() / "
                   "@torch.inference_mode().")
    tier = "hygiene"
    tier_why = ("in test code a forward with autograd on costs a test nothing worth a change (5 of 6 findings on the "
                "real-code set were unit tests): reported by default outside tests (not under a tests/ folder, not "
                "a test_*.py or *_test.py file)")

    def matters(self, f: FileAnalysis, node: ast.AST) -> bool:
        return not is_test_path(getattr(f, "path", ""))

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        reported = set()
        for call in f.nodes[ast.Call]:
            if not _puts_model_in_eval(f, call):
                continue
            scope = f.function_scope(call)
            key = (scope, ast.dump(call.func.value))
            if key in reported:
                continue
            finding = _forward_with_grad_after_eval(f, call, scope)
            if finding is not None:
                reported.add(key)
                yield finding


def _puts_model_in_eval(f: FileAnalysis, call: ast.Call) -> bool:
    """``call`` is ``model.eval()`` / ``model.train(False)`` on a module with parameters (or on
    something the file does not show)."""
    if not _switches_to_eval(call):
        return False
    model = call.func.value
    k = f.kind(model)
    if k is not None and not looks_like_model(f, model):
        return False
    return not _parameter_free(f, model, k)  # Dropout, DropPath, an activation: autograd records nothing


def _switches_to_eval(call: ast.Call) -> bool:
    """``x.eval()`` or ``x.train(False)``."""
    name = called_method(call)
    if name == "eval":
        return not call.args and not call.keywords
    return name == "train" and len(call.args) == 1 and _first_arg_false(call)


def _first_arg_false(call: ast.Call) -> bool:
    return bool(call.args) and is_false(call.args[0])


def _forward_with_grad_after_eval(f: FileAnalysis, eval_call: ast.Call, scope: ast.AST) -> tuple[ast.AST, str] | None:
    """TT116's finding for ``eval_call`` in ``scope``: the first forward of the model after it (and
    before the model's next ``train()``) outside no_grad, in the scope itself or in a helper it
    calls; None where autograd is wanted there or records nothing."""
    model = eval_call.func.value
    calls = f.calls_in(scope)
    stop = _next_train(calls, eval_call, model)
    uncovered = [c for c in _model_calls(f, calls, model, eval_call, stop) if not f.no_grad(c)]
    if not uncovered:
        return _helper_forward_finding(f, calls, eval_call, stop, model)
    if _no_grad_unneeded(f, calls, scope, model, uncovered[0]):
        return None
    name = ast.unparse(model)
    return uncovered[0], (f"forward pass of `{name}` after {name}.eval() outside torch.no_grad()/inference_mode(): "
                          f"autograd still records the graph")


def _helper_forward_finding(f: FileAnalysis, calls: list[ast.Call], eval_call: ast.Call, stop: tuple[int, int],
                            model: ast.AST) -> tuple[ast.AST, str] | None:
    """TT116's finding for a forward of the model in a helper that the scope hands it to."""
    helper = _forward_in_helper(f, calls, eval_call, stop, model)
    if helper is None:
        return None
    forward, name = helper
    return forward, (f"forward pass in {name}() of the model that line {eval_call.lineno} put in eval() "
                     f"mode, outside torch.no_grad()/inference_mode(): autograd still records the graph")


def _no_grad_unneeded(f: FileAnalysis, calls: list[ast.Call], scope: ast.AST, model: ast.AST,
                      forward: ast.Call) -> bool:
    """``forward`` needs no no_grad: gradients are wanted in ``scope`` (saliency, adversarial
    examples: no_grad would be wrong), its callers run it under no_grad, or the model is frozen
    (autograd records nothing)."""
    if any(_asks_gradients(f, c) for c in calls) or _runs_under_no_grad(f, scope):
        return True
    return _frozen(f, scope, ast.dump(model), pos(forward))


def _next_train(calls: list[ast.Call], eval_call: ast.Call, model: ast.AST) -> tuple[int, int]:
    """Where ``model.train()`` (not ``train(False)``) first follows ``eval_call``; NOWHERE if it does not."""
    spelled = ast.dump(model)
    return min((pos(c) for c in calls if pos(c) > pos(eval_call) and _switches_to_train(c, spelled)), default=NOWHERE)


def _switches_to_train(call: ast.Call, spelled: str) -> bool:
    """``call`` is ``model.train()`` (not ``train(False)``) on the model ``spelled`` (its ``ast.dump``)."""
    return called_method(call) == "train" and ast.dump(call.func.value) == spelled and not _first_arg_false(call)


def _model_calls(f: FileAnalysis, calls: list[ast.Call], model: ast.AST, after: ast.AST,
                 stop: tuple[int, int]) -> list[ast.Call]:
    """The calls of ``model(...)`` itself between ``after`` and ``stop`` (a name: bound the same way)."""
    spelled = ast.dump(model)
    return [c for c in calls if pos(after) < pos(c) < stop and ast.dump(c.func) == spelled
            and _same_binding(f, c.func, model)]


def _same_binding(f: FileAnalysis, node: ast.AST, model: ast.AST) -> bool:
    """``node`` (spelled like ``model``) is bound where ``model`` is, if ``model`` is a name."""
    return not isinstance(model, ast.Name) or f.lookup(node) is f.lookup(model)


def _asks_gradients(f: FileAnalysis, call: ast.Call) -> bool:
    """A ``.backward()`` or ``torch.autograd.grad`` / ``backward`` call."""
    return is_backward(call) or f.qualname(call.func) in ("torch.autograd.grad", "torch.autograd.backward")


def _parameter_free(f: FileAnalysis, model: ast.AST, k) -> bool:
    """``model`` is a layer without parameters: a torch one by its kind, another library's by the name
    of the class it was built from (``drop = DropPath(0.1)``)."""
    if k is not None:
        return k.cat == "module" and k.detail in PARAMETER_FREE_MODULES
    value = f.binding_value(model) if isinstance(model, ast.Name) else None
    return isinstance(value, ast.Call) and _parameter_free_class(value.func)


def _parameter_free_class(func: ast.AST) -> bool:
    """A class named like a layer without parameters: ``DropPath``, ``timm.layers.Identity``."""
    callee = dotted(func)
    return callee is not None and PARAMETER_FREE_NAME.match(callee.rsplit(".", 1)[-1]) is not None


def _forward_in_helper(f: FileAnalysis, calls: list[ast.Call], eval_call: ast.Call, stop: tuple[int, int],
                       model: ast.AST) -> tuple[ast.Call, str] | None:
    """After ``model.eval()`` (and before ``stop``), a call of a plain function of this file
    that is handed the model and runs its forward outside no_grad, with no backward and no
    ``train()`` of its own: (that forward, the function's name). The call itself must not be
    under no_grad either."""
    for helper, name in _helpers_given_model(f, calls, eval_call, stop, model):
        forward = _ungraded_forward(f, helper, name)
        if forward is not None:
            return forward, helper.name
    return None


def _helpers_given_model(f: FileAnalysis, calls: list[ast.Call], eval_call: ast.Call, stop: tuple[int, int],
                         model: ast.AST) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """(function, parameter) for each call among ``calls`` between ``eval_call`` and ``stop``, not under
    no_grad, of a plain function of this file that is handed ``model`` as that parameter."""
    spelled = ast.dump(model)
    for c in calls:
        if not _plain_call_between(f, c, eval_call, stop):
            continue
        helper = _sole_function(f, c.func.id)
        name = _parameter_given(helper, c, spelled) if helper is not None else None
        if name is not None:
            yield helper, name


def _plain_call_between(f: FileAnalysis, call: ast.Call, after: ast.AST, stop: tuple[int, int]) -> bool:
    """``call`` is a call by plain name between ``after`` and ``stop``, not under no_grad."""
    return pos(after) < pos(call) < stop and isinstance(call.func, ast.Name) and not f.no_grad(call)


def _sole_function(f: FileAnalysis, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The one plain function of this file called ``name`` (None if there are several, or an alias)."""
    single = _single_definition(f, name)
    return single if isinstance(single, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _single_definition(f: FileAnalysis, name: str) -> ast.AST | None:
    """What the file defines ``name`` as, where it defines it once and does not alias it."""
    defs = f.plain_functions.get(name, [])
    return defs[0] if len(defs) == 1 and name not in f.aliases else None


def _parameter_given(helper: ast.AST, call: ast.Call, spelled: str) -> str | None:
    """The parameter of ``helper`` that ``call`` passes the expression ``spelled`` (an ``ast.dump``) to."""
    given = _positional_given(helper, call, spelled) + [kw.arg for kw in call.keywords if ast.dump(kw.value) == spelled]
    return next((g for g in given if g is not None), None)


def _positional_given(helper: ast.AST, call: ast.Call, spelled: str) -> list[str | None]:
    """The parameters of ``helper`` that the positional arguments of ``call`` spelled ``spelled`` go
    to (None for one past its last parameter)."""
    params = [a.arg for a in helper.args.posonlyargs + helper.args.args]
    return [(params[i] if i < len(params) else None) for i, a in enumerate(call.args) if ast.dump(a) == spelled]


def _ungraded_forward(f: FileAnalysis, helper: ast.AST, name: str) -> ast.Call | None:
    """In ``helper``, the first call of its parameter ``name`` (the model) outside no_grad, where
    the helper neither wants gradients, nor calls ``name.train()``, nor rebinds or freezes ``name``."""
    inner = f.calls_in(helper)
    if _may_want_graph(f, helper, name, inner):
        return None
    forward = _first_forward(f, inner, name)
    if forward is not None and not _frozen(f, helper, ast.dump(ast.Name(id=name, ctx=ast.Load())), pos(forward)):
        return forward
    return None


def _first_forward(f: FileAnalysis, calls: list[ast.Call], name: str) -> ast.Call | None:
    """The first of ``calls`` that calls ``name`` outside no_grad."""
    return next((x for x in calls if is_name(x.func, name) and not f.no_grad(x)), None)


def _may_want_graph(f: FileAnalysis, helper: ast.AST, name: str, inner: list[ast.Call]) -> bool:
    """Among its calls ``inner``, ``helper`` asks for gradients or calls ``name.train()``, or it rebinds ``name``."""
    return any(_asks_gradients(f, x) or _trains(x, name) for x in inner) or _rebound(f, helper, name)


def _rebound(f: FileAnalysis, helper: ast.AST, name: str) -> bool:
    """The parameter ``name`` of ``helper`` is bound again in it: not provably what was passed."""
    return any(b[1] != "param" for b in f.bindings.get(helper, {}).get(name, ()))


def _trains(call: ast.Call, name: str) -> bool:
    """``call`` is ``name.train(...)``."""
    return called_method(call) == "train" and is_name(call.func.value, name)


def _frozen(f: FileAnalysis, scope: ast.AST, model: str, before: tuple[int, int]) -> bool:
    """Before ``before`` in ``scope``, the whole model (``model`` is its ``ast.dump``) was
    frozen: ``model.requires_grad_(False)``, or ``requires_grad_(False)`` /
    ``requires_grad = False`` on every ``p`` of ``for p in model.parameters()``."""
    return _frozen_whole(f, scope, model, before) or _frozen_per_parameter(scope, model, before)


def _frozen_whole(f: FileAnalysis, scope: ast.AST, model: str, before: tuple[int, int]) -> bool:
    """``model.requires_grad_(False)`` (also ``model.eval().requires_grad_(False)``) before ``before``."""
    for call in f.calls_in(scope):
        if pos(call) >= before:
            break
        if _freezes_model(call, model):
            return True
    return False


_CHAINED = ("eval", "train", "to", "cuda", "cpu")


def _freezes_model(call: ast.Call, model: str) -> bool:
    """``call`` is ``model.requires_grad_(False)``, or ``model.eval().requires_grad_(False)`` (``.to(...)``,
    ``.cuda()`` ... between)."""
    if not (called_method(call) == "requires_grad_" and _false_flag(call)):
        return False
    receiver = call.func.value
    if called_method(receiver) in _CHAINED:
        receiver = receiver.func.value  # model.eval().requires_grad_(False)
    return ast.dump(receiver) == model


def _frozen_per_parameter(scope: ast.AST, model: str, before: tuple[int, int]) -> bool:
    """``for p in model.parameters():`` before ``before`` whose body freezes ``p``."""
    return any(_over_parameters(loop, model, before) and any(_freezes(stmt, loop.target.id) for stmt in loop.body)
               for loop in walk_local(scope))


def _over_parameters(loop: ast.AST, model: str, before: tuple[int, int]) -> bool:
    """``loop`` is a ``for p in model.parameters():`` before ``before``."""
    if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and pos(loop) < before):
        return False
    return called_method(loop.iter) == "parameters" and ast.dump(loop.iter.func.value) == model


def _freezes(stmt: ast.stmt, p: str) -> bool:
    """``stmt`` is ``p.requires_grad_(False)`` or ``p.requires_grad = False``."""
    if isinstance(stmt, ast.Expr):
        return _freezes_by_call(stmt.value, p)
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and dotted(stmt.targets[0]) == f"{p}.requires_grad" and is_false(stmt.value))


def _freezes_by_call(node: ast.AST, p: str) -> bool:
    """``node`` is ``p.requires_grad_(False)``."""
    return called_method(node) == "requires_grad_" and dotted(node.func.value) == p and _false_flag(node)


def _false_flag(call: ast.Call) -> bool:
    return is_false(kwarg(call, "requires_grad", 0))


def _runs_under_no_grad(f: FileAnalysis, scope: ast.AST) -> bool:
    """``scope`` is a function that some caller runs under no_grad."""
    return isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _called_without_grad(f, scope)


def _called_without_grad(f: FileAnalysis, func: ast.AST) -> bool:
    """Some call of ``func`` in this file runs under no_grad (so its body does too)."""
    if isinstance(f.parent.get(func), ast.ClassDef):
        calls = [c for c in f.nodes[ast.Call] if called_method(c) == func.name]
    else:
        calls = f.calls_by_name.get(func.name, [])
    return any(f.no_grad(c) for c in calls)


@static_rule
class LossAccumulatedWithGraph(StaticRule):
    id = "TT117"
    name = "loss-accumulated-with-graph"
    severity = "warning"
    source = "X; T27; seeds/003 Pytorch 使用陷阱 §2 (在循环中使用全局变量当做累加器)"
    message = "loss tensor accumulated across iterations keeps every step's graph alive: accumulate loss.item()"
    explanation = ("A loss tensor carries its autograd graph. Adding it to a running total (or appending it to a "
                   "list) that outlives the iteration keeps every step's graph and saved activations reachable, "
                   "so memory grows each step until it runs out. Fix: total += loss.item() (or "
                   "loss.detach()); append loss.item() to lists.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for node in f.nodes[ast.AugAssign] + f.nodes[ast.Assign] + f.nodes[ast.Call]:
            found = _loss_accumulated_in_loop(f, node)
            if found is None or not _keeps_graphs(f, node, found[0], found[1]):
                continue
            acc, loss, how = found
            fix = f"{acc.id}.append({loss.id}.item())" if how == "append" else f"{acc.id} += {loss.id}.item()"
            yield node, (f"`{loss.id}` accumulated into `{acc.id}` across iterations keeps every step's graph alive: "
                         f"use {fix}")


def _loss_accumulated_in_loop(f: FileAnalysis, node: ast.AST) -> tuple[ast.Name, ast.Name, str] | None:
    """(accumulator, loss, how) where ``node`` adds a loss to an accumulator in a loop, with autograd on."""
    accumulated = _accumulation(node)
    if accumulated is None:
        return None
    acc, value, how = accumulated
    loss = _loss_name(value)
    if loss is None or not f.loops_around(node) or f.no_grad(node):
        return None
    return acc, loss, how


def _keeps_graphs(f: FileAnalysis, node: ast.AST, acc: ast.Name, loss: ast.Name) -> bool:
    """The accumulation ``node`` keeps each iteration's graph alive: ``loss`` carries one, ``acc``
    outlives the iteration, and the sum is neither backpropagated nor computed under no_grad."""
    scope = f.function_scope(node)
    if not _carries_graph(f, loss, scope) or not _bound_before(f, acc, f.loops_around(node)[0]):
        return False
    if f.backward_mentions(scope, acc.id):
        return False  # the sum is what gets backpropagated (gradient accumulation, multi-task)
    return not _runs_under_no_grad(f, scope)  # an evaluation helper that its callers run under no_grad


def _accumulation(node: ast.AST) -> tuple[ast.Name, ast.AST, str] | None:
    """(accumulator, added value, how) for ``acc += v``, ``acc = acc + v`` and ``acc.append(v)``."""
    if isinstance(node, ast.AugAssign):
        return _added_in_place(node)
    if isinstance(node, ast.Assign):
        return _added_and_rebound(node)
    return _appended(node)


def _added_in_place(node: ast.AugAssign) -> tuple[ast.Name, ast.AST, str] | None:
    if isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name):
        return node.target, node.value, "+="
    return None


def _added_and_rebound(node: ast.Assign) -> tuple[ast.Name, ast.AST, str] | None:
    target = node.targets[0] if len(node.targets) == 1 else None
    v = node.value
    if isinstance(target, ast.Name) and isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and is_name(
            v.left, target.id):
        return v.left, v.right, "+"
    return None


def _appended(call: ast.Call) -> tuple[ast.Name, ast.AST, str] | None:
    if called_method(call) == "append" and isinstance(call.func.value, ast.Name) and len(call.args) == 1:
        return call.func.value, call.args[0], "append"
    return None


def _loss_name(value: ast.AST) -> ast.Name | None:
    """The loss an accumulated value is: ``loss``, ``loss * k``, ``loss / k``."""
    if isinstance(value, ast.Name):
        return value
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
        return _sole_name(value.left, value.right)
    return None


def _sole_name(*nodes: ast.AST) -> ast.Name | None:
    """The one name among ``nodes`` (None for none or two)."""
    names = [n for n in nodes if isinstance(n, ast.Name)]
    return names[0] if len(names) == 1 else None


def _carries_graph(f: FileAnalysis, name: ast.Name, scope: ast.AST) -> bool:
    """``name`` holds a tensor with an autograd graph: a loss by its kind, or something the scope
    calls ``.backward()`` on; not a value computed under no_grad or taken off the graph."""
    b = f.lookup(name)
    if not _whole_value(b) or _no_graph(f, b[2]):
        return False
    k = f.kind(name)
    if k is not None and k.cat == "tensor" and k.detail == "loss":
        return True
    return _backward_called_on(f, name, b, scope)


def _whole_value(b: tuple | None) -> bool:
    """The binding ``b`` (from ``f.lookup``) assigns a whole value: not a parameter, not a part unpacked."""
    return b is not None and b[1] == "value" and not b[3]


def _no_graph(f: FileAnalysis, value: ast.AST | None) -> bool:
    """``value`` is computed under no_grad / inference_mode, or taken off the graph: it has no graph."""
    return (value is not None and f.no_grad(value)) or _off_graph(value)


def _backward_called_on(f: FileAnalysis, name: ast.Name, b: tuple, scope: ast.AST) -> bool:
    """``scope`` calls ``name.backward()`` after the binding ``b`` of ``name``, on that binding."""
    return any(is_backward(c) and is_name(c.func.value, name.id) and pos(c) > b[0] and f.lookup(c.func.value) is b
               for c in f.calls_in(scope))


def _off_graph(value: ast.AST | None) -> bool:
    """``value`` is a detached tensor or a Python number: ``x.item()``, ``x.detach()``, ``float(x)``."""
    return called_method(value) in ("item", "detach", "tolist", "cpu", "numpy") or (
        isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("float", "int"))


def _bound_before(f: FileAnalysis, acc: ast.Name, loop: ast.AST) -> bool:
    """``acc`` was bound before ``loop`` (or elsewhere): it outlives each iteration."""
    b = f.lookup(acc)
    return b is None or b[0] < pos(loop)


@static_rule
class AdamWeightDecay(StaticRule):
    id = "TT119"
    name = "adam-weight-decay"
    severity = "warning"
    source = "X (weight decay pitfalls); T15; seeds/003 Pytorch 使用陷阱 §5 (L2正则不等于权值衰减)"
    message = "Adam with weight_decay is an L2 penalty that the adaptive step rescales: use AdamW for decoupled weight decay"
    explanation = ("torch.optim.Adam adds weight_decay*w to the gradient, which is then divided by the running RMS "
                   "of the gradient: weights with large gradients are hardly decayed, so it is not weight decay "
                   "(Loshchilov & Hutter). AdamW applies the decay to the weights directly. Fix: "
                   "torch.optim.AdamW(params, lr, weight_decay=...) (AdamW's usual values are larger, 0.01-0.1), "
                   "or Adam(..., decoupled_weight_decay=True).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            if f.qualname(call.func) == "torch.optim.Adam" and _coupled_weight_decay(f, call):
                yield call, self.message


def _coupled_weight_decay(f: FileAnalysis, adam: ast.Call) -> bool:
    """``adam`` has a nonzero weight decay, for all parameters or for a group, and does not decouple it."""
    decoupled = kwarg(adam, "decoupled_weight_decay")
    if decoupled is not None and not is_false(decoupled):
        return False
    return _nonzero(f, kwarg(adam, "weight_decay", 4)) or _group_weight_decay(f, adam)


def _group_weight_decay(f: FileAnalysis, adam: ast.Call) -> bool:
    """A parameter group of ``adam`` (a dict in a list) sets a nonzero ``weight_decay``."""
    groups = adam.args[0] if adam.args else kwarg(adam, "params")
    return isinstance(groups, ast.List) and any(_sets_weight_decay(f, g) for g in groups.elts)


def _sets_weight_decay(f: FileAnalysis, group: ast.AST) -> bool:
    return isinstance(group, ast.Dict) and any(
        isinstance(k, ast.Constant) and k.value == "weight_decay" and _nonzero(f, v) for k, v in zip(group.keys,
                                                                                                      group.values))


def _nonzero(f: FileAnalysis, node: ast.AST | None) -> bool:
    """A number other than 0 (maybe negated, maybe through the name it is assigned to)."""
    value = f.binding_value(node) if isinstance(node, ast.Name) else node
    if isinstance(value, ast.UnaryOp):
        value = value.operand
    n = number(value)
    return n is not None and n != 0


@static_rule
class SchedulerStepBeforeOptimizerStep(StaticRule):
    id = "TT122"
    name = "scheduler-step-before-optimizer-step"
    severity = "warning"
    source = "T21; seeds/003 Pytorch 使用陷阱 (学习率调度); PyTorch 1.1 release notes (the order of step())"
    message = ("lr_scheduler.step() before optimizer.step() in the loop: the first value of the schedule is skipped; "
               "call it after optimizer.step()")
    explanation = ("Since PyTorch 1.1 a scheduler's step() is meant to follow the optimizer's: called first (the "
                   "older order), it moves the learning rate before the first update, so the schedule's first "
                   "value is never used and every later change comes one step (or epoch) early; PyTorch warns at "
                   "run time. Fix: in each iteration, optimizer.step() (or scaler.step(optimizer)) first, then "
                   "scheduler.step(). Quiet when the scheduler step is guarded by an if in the loop (if epoch > 0: "
                   "..., a warm-up switch) or comes after the optimizer's in the loop's order.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for loop in _outermost_loops(f):  # it sees the inner loops' steps in its order
            for c in _scheduler_steps_first(f, loop):
                yield c, self.message


def _outermost_loops(f: FileAnalysis) -> Iterator[ast.AST]:
    """The loops of the file that no loop of the same function holds."""
    for t in LOOPS:
        yield from (loop for loop in f.nodes[t] if not _nested_loop(f, loop))


def _nested_loop(f: FileAnalysis, loop: ast.AST) -> bool:
    return any(isinstance(a, LOOPS) for a in f.local_ancestors(loop))


def _scheduler_steps_first(f: FileAnalysis, loop: ast.AST) -> list[ast.Call]:
    """The unguarded ``scheduler.step()`` calls in ``loop`` before its first optimizer step."""
    steps = _step_calls(loop)
    first_opt = next((c for c in steps if optimizer_step(f, c)), None)
    if first_opt is None:
        return []
    return [c for c in steps if pos(c) < pos(first_opt) and _unguarded_scheduler_step(f, c, loop)]


def _step_calls(loop: ast.AST) -> list[ast.Call]:
    """The ``x.step()`` calls in ``loop``'s frame, in source order."""
    return sorted((c for c in walk_local(loop) if called_method(c) == "step"), key=pos)


def _unguarded_scheduler_step(f: FileAnalysis, step: ast.Call, loop: ast.AST) -> bool:
    """``step`` is a scheduler's, under no ``if`` in ``loop`` (``if epoch > 0:``, a warm-up switch)."""
    k = f.kind(step.func.value)
    return k is not None and k.cat == "scheduler" and not any(
        isinstance(a, ast.If) for a in ancestors_until(f, step, loop))


@static_rule
class EvalWithoutTrain(StaticRule):
    id = "TT124"
    name = "eval-without-train"
    severity = "warning"
    source = "X (eval() without train() again); T13; seeds/003 测试阶段 §2 (model.eval() 与 model.train())"
    message = ("model.eval() inside the training loop and no model.train() in it: after the first evaluation the "
               "model trains in eval mode (dropout off, BatchNorm statistics frozen); call model.train() again")
    explanation = ("eval() switches dropout off and makes BatchNorm use (and stop updating) its running statistics, "
                   "for every later forward until train() switches them back. An evaluation inside the epoch loop "
                   "(directly, or in a helper the loop calls) with no train() anywhere in that loop leaves every "
                   "following epoch training in eval mode: no regularisation from dropout, no statistics update, "
                   "silently. Fix: model.train() at the start of each epoch (or at the end of the evaluation). "
                   "Quiet when the loop calls train() anywhere, when the helper restores it itself, and in loops "
                   "that do not train (no backward in them).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for loop in _outermost_loops(f):  # an epoch loop sees its inner step loop's backward
            calls = _frame_calls(loop)
            if not _trains_without_train_call(calls):
                continue
            for c, helper in _eval_switches(f, calls):
                yield c, (self.message if helper is None else
                          f"`{helper}()` switches the model to eval() and nothing in this training loop calls "
                          "train() again: the following epochs train in eval mode; call model.train() after it")


def _frame_calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in walk_local(node) if isinstance(n, ast.Call)]


def _trains_without_train_call(calls: list[ast.Call]) -> bool:
    """``calls`` run a backward and no ``.train()``."""
    return any(is_backward(c) for c in calls) and not _calls_train(calls)


def _calls_train(calls: list[ast.Call]) -> bool:
    return any(called_method(c) == "train" for c in calls)


def _eval_switches(f: FileAnalysis, calls: list[ast.Call]) -> Iterator[tuple[ast.Call, str | None]]:
    """(call, None) for each ``model.eval()`` among ``calls``, (call, its name) for each call of a
    function of this file that leaves a model in eval mode."""
    for c in calls:
        if _is_eval(c) and looks_like_model(f, c.func.value):
            yield c, None
        elif isinstance(c.func, ast.Name) and _helper_leaves_eval(f, c.func.id):
            yield c, c.func.id


def _is_eval(call: ast.Call) -> bool:
    """``x.eval()``."""
    return called_method(call) == "eval" and not call.args


def _helper_leaves_eval(f: FileAnalysis, name: str) -> bool:
    """A function of this file that calls ``.eval()`` on something and never ``.train()``."""
    helper = _single_definition(f, name)
    calls = _frame_calls(helper) if helper is not None else []
    return any(_is_eval(c) for c in calls) and not _calls_train(calls)


@static_rule
class BackwardUnderNoGrad(StaticRule):
    id = "TT125"
    name = "backward-under-no-grad"
    severity = "error"
    source = "X (backward with autograd off); seeds/003 测试阶段 §2b (torch.no_grad)"
    message = ("backward() where autograd is off (under torch.no_grad() / inference_mode / a decorated function): the "
               "loss has no graph and backward raises; compute the loss with autograd on")
    explanation = ("Under torch.no_grad() (or inference_mode, or in a function decorated with either) no graph is "
                   "recorded, so a loss computed there has no grad_fn and loss.backward() raises 'element 0 of "
                   "tensors does not require grad' (inference_mode: a tensor created in inference mode cannot be "
                   "saved for backward). It usually means a training step was put inside an evaluation block, or a "
                   "whole function was decorated. Fix: compute the loss and call backward outside no_grad, or "
                   "inside `with torch.enable_grad():`.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            if is_backward(call) and f.no_grad(call):
                yield call, self.message
