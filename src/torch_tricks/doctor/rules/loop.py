"""Rules about the training loop itself: evaluation with autograd on or never switched
back to train(), a loss accumulated with its graph, backward() with autograd off, the
scheduler stepped before the optimizer, Adam's coupled weight decay.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import (LOOPS, NOWHERE, PARAMETER_FREE_MODULES, PARAMETER_FREE_NAME, FileAnalysis,
                                          ancestors_until, dotted, is_backward, kwarg, looks_like_model, number,
                                          optimizer_step, pos, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule


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
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    to_eval = (func.attr == "eval" and not call.args and not call.keywords) or (
        func.attr == "train" and len(call.args) == 1 and _first_arg_false(call))
    if not to_eval:
        return False
    k = f.kind(func.value)
    if k is not None and not (k.cat == "module" or (k.cat == "self" and f.is_module_class(k.ref))):
        return False
    return not _parameter_free(f, func.value, k)  # Dropout, DropPath, an activation: autograd records nothing


def _first_arg_false(call: ast.Call) -> bool:
    return bool(call.args) and isinstance(call.args[0], ast.Constant) and call.args[0].value is False


def _forward_with_grad_after_eval(f: FileAnalysis, eval_call: ast.Call, scope: ast.AST) -> tuple[ast.AST, str] | None:
    """TT116's finding for ``eval_call`` in ``scope``: the first forward of the model after it (and
    before the model's next ``train()``) outside no_grad, in the scope itself or in a helper it
    calls; None where autograd is wanted there or records nothing."""
    model = eval_call.func.value
    calls = f.calls_in(scope)
    stop = _next_train(calls, eval_call, model)
    uncovered = [c for c in _model_calls(f, calls, model, eval_call, stop) if not f.no_grad(c)]
    if not uncovered:
        helper = _forward_in_helper(f, calls, eval_call, stop, model)
        if helper is None:
            return None
        forward, name = helper
        return forward, (f"forward pass in {name}() of the model that line {eval_call.lineno} put in eval() "
                         f"mode, outside torch.no_grad()/inference_mode(): autograd still records the graph")
    if any(_asks_gradients(f, c) for c in calls):
        return None  # gradients wanted (saliency, adversarial examples): no_grad would be wrong
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _called_without_grad(f, scope):
        return None
    if _frozen(f, scope, ast.dump(model), pos(uncovered[0])):
        return None  # no parameter requires grad: autograd records nothing
    name = ast.unparse(model)
    return uncovered[0], (f"forward pass of `{name}` after {name}.eval() outside torch.no_grad()/inference_mode(): "
                          f"autograd still records the graph")


def _next_train(calls: list[ast.Call], eval_call: ast.Call, model: ast.AST) -> tuple[int, int]:
    """Where ``model.train()`` (not ``train(False)``) first follows ``eval_call``; NOWHERE if it does not."""
    spelled = ast.dump(model)
    return min((pos(c) for c in calls if pos(c) > pos(eval_call) and isinstance(c.func, ast.Attribute)
                and c.func.attr == "train" and ast.dump(c.func.value) == spelled and not _first_arg_false(c)),
               default=NOWHERE)


def _model_calls(f: FileAnalysis, calls: list[ast.Call], model: ast.AST, after: ast.AST,
                 stop: tuple[int, int]) -> list[ast.Call]:
    """The calls of ``model(...)`` itself between ``after`` and ``stop`` (a name: bound the same way)."""
    spelled = ast.dump(model)
    return [c for c in calls if pos(after) < pos(c) < stop and ast.dump(c.func) == spelled
            and (not isinstance(model, ast.Name) or f.lookup(c.func) is f.lookup(model))]


def _asks_gradients(f: FileAnalysis, call: ast.Call) -> bool:
    """A ``.backward()`` or ``torch.autograd.grad`` / ``backward`` call."""
    return is_backward(call) or f.qualname(call.func) in ("torch.autograd.grad", "torch.autograd.backward")


def _parameter_free(f: FileAnalysis, model: ast.AST, k) -> bool:
    """``model`` is a layer without parameters: a torch one by its kind, another library's by the name
    of the class it was built from (``drop = DropPath(0.1)``)."""
    if k is not None:
        return k.cat == "module" and k.detail in PARAMETER_FREE_MODULES
    value = f.binding_value(model) if isinstance(model, ast.Name) else None
    if isinstance(value, ast.Call):
        callee = dotted(value.func)
        return callee is not None and PARAMETER_FREE_NAME.match(callee.rsplit(".", 1)[-1]) is not None
    return False


def _forward_in_helper(f: FileAnalysis, calls: list[ast.Call], eval_call: ast.Call, stop: tuple[int, int],
                       model: ast.AST) -> tuple[ast.Call, str] | None:
    """After ``model.eval()`` (and before ``stop``), a call of a plain function of this file
    that is handed the model and runs its forward outside no_grad, with no backward and no
    ``train()`` of its own: (that forward, the function's name). The call itself must not be
    under no_grad either."""
    spelled = ast.dump(model)
    for c in calls:
        if not (pos(eval_call) < pos(c) < stop and isinstance(c.func, ast.Name)) or f.no_grad(c):
            continue
        helper = _sole_function(f, c.func.id)
        name = _parameter_given(helper, c, spelled) if helper is not None else None
        if name is None:
            continue
        forward = _ungraded_forward(f, helper, name)
        if forward is not None:
            return forward, helper.name
    return None


def _sole_function(f: FileAnalysis, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The one plain function of this file called ``name`` (None if there are several, or an alias)."""
    defs = f.plain_functions.get(name, [])
    if len(defs) != 1 or name in f.aliases or not isinstance(defs[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return defs[0]


def _parameter_given(helper: ast.AST, call: ast.Call, spelled: str) -> str | None:
    """The parameter of ``helper`` that ``call`` passes the expression ``spelled`` (an ``ast.dump``) to."""
    params = [a.arg for a in helper.args.posonlyargs + helper.args.args]
    given = [(params[i] if i < len(params) else None) for i, a in enumerate(call.args) if ast.dump(a) == spelled]
    given += [kw.arg for kw in call.keywords if kw.arg is not None and ast.dump(kw.value) == spelled]
    return next((g for g in given if g is not None), None)


def _ungraded_forward(f: FileAnalysis, helper: ast.AST, name: str) -> ast.Call | None:
    """In ``helper``, the first call of its parameter ``name`` (the model) outside no_grad, where
    the helper neither wants gradients, nor calls ``name.train()``, nor rebinds or freezes ``name``."""
    inner = f.calls_in(helper)
    if any(_asks_gradients(f, x) or _trains(x, name) for x in inner):
        return None
    if any(b[1] != "param" for b in f.bindings.get(helper, {}).get(name, ())):
        return None  # the name is rebound: not provably the model
    forward = next((x for x in inner if isinstance(x.func, ast.Name) and x.func.id == name and not f.no_grad(x)),
                   None)
    if forward is not None and not _frozen(f, helper, ast.dump(ast.Name(id=name, ctx=ast.Load())), pos(forward)):
        return forward
    return None


def _trains(call: ast.Call, name: str) -> bool:
    """``call`` is ``name.train(...)``."""
    return (isinstance(call.func, ast.Attribute) and call.func.attr == "train" and isinstance(call.func.value, ast.Name)
            and call.func.value.id == name)


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
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "requires_grad_" and _false_flag(call):
            receiver = func.value
            if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute) and \
                    receiver.func.attr in ("eval", "train", "to", "cuda", "cpu"):
                receiver = receiver.func.value  # model.eval().requires_grad_(False)
            if ast.dump(receiver) == model:
                return True
    return False


def _frozen_per_parameter(scope: ast.AST, model: str, before: tuple[int, int]) -> bool:
    """``for p in model.parameters():`` before ``before`` whose body freezes ``p``."""
    for loop in walk_local(scope):
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and pos(loop) < before):
            continue
        it = loop.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "parameters"
                and ast.dump(it.func.value) == model):
            continue
        if any(_freezes(stmt, loop.target.id) for stmt in loop.body):
            return True
    return False


def _freezes(stmt: ast.stmt, p: str) -> bool:
    """``stmt`` is ``p.requires_grad_(False)`` or ``p.requires_grad = False``."""
    value = stmt.value if isinstance(stmt, ast.Expr) else None
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr == "requires_grad_" and dotted(value.func.value) == p and _false_flag(value)):
        return True
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and dotted(stmt.targets[0]) == f"{p}.requires_grad"
            and isinstance(stmt.value, ast.Constant) and stmt.value.value is False)


def _false_flag(call: ast.Call) -> bool:
    flag = kwarg(call, "requires_grad", 0)
    return isinstance(flag, ast.Constant) and flag.value is False


def _called_without_grad(f: FileAnalysis, func: ast.AST) -> bool:
    """Some call of ``func`` in this file runs under no_grad (so its body does too)."""
    if isinstance(f.parent.get(func), ast.ClassDef):
        calls = [c for c in f.nodes[ast.Call] if isinstance(c.func, ast.Attribute) and c.func.attr == func.name]
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
            accumulated = _accumulation(node)
            if accumulated is None:
                continue
            acc, value, how = accumulated
            loss = _loss_name(value)
            loops = f.loops_around(node)
            if loss is None or not loops or f.no_grad(node):
                continue
            scope = f.function_scope(node)
            if not _carries_graph(f, loss, scope) or not _bound_before(f, acc, loops[0]):
                continue
            if f.backward_mentions(scope, acc.id):
                continue  # the sum is what gets backpropagated (gradient accumulation, multi-task)
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _called_without_grad(f, scope):
                continue  # an evaluation helper that its callers run under no_grad
            fix = f"{acc.id}.append({loss.id}.item())" if how == "append" else f"{acc.id} += {loss.id}.item()"
            yield node, (f"`{loss.id}` accumulated into `{acc.id}` across iterations keeps every step's graph alive: "
                         f"use {fix}")


def _accumulation(node: ast.AST) -> tuple[ast.Name, ast.AST, str] | None:
    """(accumulator, added value, how) for ``acc += v``, ``acc = acc + v`` and ``acc.append(v)``."""
    if isinstance(node, ast.AugAssign):
        if isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name):
            return node.target, node.value, "+="
        return None
    if isinstance(node, ast.Assign):
        v = node.value
        if (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and isinstance(v, ast.BinOp)
                and isinstance(v.op, ast.Add) and isinstance(v.left, ast.Name) and v.left.id == node.targets[0].id):
            return v.left, v.right, "+"
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "append" and isinstance(func.value, ast.Name) \
            and len(node.args) == 1:
        return func.value, node.args[0], "append"
    return None


def _loss_name(value: ast.AST) -> ast.Name | None:
    """The loss an accumulated value is: ``loss``, ``loss * k``, ``loss / k``."""
    if isinstance(value, ast.Name):
        return value
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
        names = [s for s in (value.left, value.right) if isinstance(s, ast.Name)]
        return names[0] if len(names) == 1 else None
    return None


def _carries_graph(f: FileAnalysis, name: ast.Name, scope: ast.AST) -> bool:
    """``name`` holds a tensor with an autograd graph: a loss by its kind, or something the scope
    calls ``.backward()`` on; not a value computed under no_grad or taken off the graph."""
    b = f.lookup(name)
    if b is None or b[1] != "value" or b[3]:
        return False
    value = b[2]
    if value is not None and f.no_grad(value):
        return False  # computed under no_grad / inference_mode: it has no graph
    if _off_graph(value):
        return False
    k = f.kind(name)
    if k is not None and k.cat == "tensor" and k.detail == "loss":
        return True
    return any(is_backward(c) and isinstance(c.func.value, ast.Name) and c.func.value.id == name.id
               and pos(c) > b[0] and f.lookup(c.func.value) is b for c in f.calls_in(scope))


def _off_graph(value: ast.AST | None) -> bool:
    """``value`` is a detached tensor or a Python number: ``x.item()``, ``x.detach()``, ``float(x)``."""
    return isinstance(value, ast.Call) and (
        (isinstance(value.func, ast.Attribute) and value.func.attr in ("item", "detach", "tolist", "cpu", "numpy"))
        or (isinstance(value.func, ast.Name) and value.func.id in ("float", "int")))


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
        def nonzero(node) -> bool:
            value = f.binding_value(node) if isinstance(node, ast.Name) else node
            if isinstance(value, ast.UnaryOp):
                value = value.operand
            n = number(value)
            return n is not None and n != 0

        for call in f.nodes[ast.Call]:
            if f.qualname(call.func) != "torch.optim.Adam":
                continue
            decoupled = kwarg(call, "decoupled_weight_decay")
            if decoupled is not None and not (isinstance(decoupled, ast.Constant) and decoupled.value is False):
                continue
            decay = kwarg(call, "weight_decay", 4)
            groups = call.args[0] if call.args else kwarg(call, "params")
            in_groups = isinstance(groups, ast.List) and any(
                isinstance(g, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "weight_decay" and nonzero(v)
                                                for k, v in zip(g.keys, g.values)) for g in groups.elts)
            if (decay is not None and nonzero(decay)) or in_groups:
                yield call, self.message


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
        for loop in (n for t in LOOPS for n in f.nodes[t]):
            if any(isinstance(a, LOOPS) for a in f.local_ancestors(loop)):
                continue  # judged from the outermost loop, which sees the inner loops' steps in its order
            steps = sorted((c for c in walk_local(loop) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                            and c.func.attr == "step"), key=pos)
            first_opt = next((c for c in steps if optimizer_step(f, c)), None)
            if first_opt is None:
                continue
            for c in steps:
                if pos(c) >= pos(first_opt):
                    break
                k = f.kind(c.func.value)
                if k is not None and k.cat == "scheduler" and not any(
                        isinstance(a, ast.If) for a in ancestors_until(f, c, loop)):
                    yield c, self.message


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
        for t in LOOPS:
            for loop in f.nodes[t]:
                if any(isinstance(a, LOOPS) for a in f.local_ancestors(loop)):
                    continue  # the outermost loop: an epoch loop sees its inner step loop's backward
                calls = [n for n in walk_local(loop) if isinstance(n, ast.Call)]
                if not any(is_backward(c) for c in calls):
                    continue
                if any(isinstance(c.func, ast.Attribute) and c.func.attr == "train" for c in calls):
                    continue
                for c in calls:
                    if isinstance(c.func, ast.Attribute) and c.func.attr == "eval" and not c.args and looks_like_model(f, c.func.value):
                        yield c, self.message
                    elif isinstance(c.func, ast.Name) and _helper_leaves_eval(f, c.func.id):
                        yield c, (f"`{c.func.id}()` switches the model to eval() and nothing in this training loop calls "
                                  "train() again: the following epochs train in eval mode; call model.train() after it")


def _helper_leaves_eval(f: FileAnalysis, name: str) -> bool:
    """A function of this file that calls ``.eval()`` on something and never ``.train()``."""
    defs = f.plain_functions.get(name)
    if not defs or len(defs) != 1 or name in f.aliases:
        return False
    calls = [n for n in walk_local(defs[0]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return any(c.func.attr == "eval" and not c.args for c in calls) and not any(c.func.attr == "train" for c in calls)


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
