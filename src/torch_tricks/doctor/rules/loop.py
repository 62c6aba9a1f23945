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
            func = call.func
            if not isinstance(func, ast.Attribute):
                continue
            to_eval = (func.attr == "eval" and not call.args and not call.keywords) or (
                func.attr == "train" and len(call.args) == 1 and isinstance(call.args[0], ast.Constant)
                and call.args[0].value is False)
            if not to_eval:
                continue
            k = f.kind(func.value)
            if k is not None and not (k.cat == "module" or (k.cat == "self" and f.is_module_class(k.ref))):
                continue
            if _parameter_free(f, func.value, k):
                continue  # Dropout, DropPath, an activation: no parameter, so autograd records nothing
            scope = f.function_scope(call)
            model = ast.dump(func.value)
            calls = f.calls_in(scope)
            stop = min((pos(c) for c in calls if pos(c) > pos(call) and isinstance(c.func, ast.Attribute)
                        and c.func.attr == "train" and ast.dump(c.func.value) == model
                        and not (c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value is False)),
                       default=NOWHERE)
            same = (lambda c: f.lookup(c.func) is f.lookup(func.value)) if isinstance(func.value, ast.Name) else (
                lambda c: True)
            forwards = [c for c in calls if pos(call) < pos(c) < stop and ast.dump(c.func) == model and same(c)]
            uncovered = [c for c in forwards if not f.no_grad(c)]
            if not uncovered and (scope, model) not in reported:
                helper = _forward_in_helper(f, calls, call, stop, func.value)
                if helper is not None:
                    reported.add((scope, model))
                    forward, name = helper
                    yield forward, (f"forward pass in {name}() of the model that line {call.lineno} put in eval() "
                                    f"mode, outside torch.no_grad()/inference_mode(): autograd still records the graph")
                continue
            if (scope, model) in reported:
                continue
            if any(is_backward(c) or f.qualname(c.func) in ("torch.autograd.grad", "torch.autograd.backward") for c in calls):
                continue  # gradients wanted (saliency, adversarial examples): no_grad would be wrong
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _called_without_grad(f, scope):
                continue
            if _frozen(f, scope, model, pos(uncovered[0])):
                continue  # no parameter requires grad: autograd records nothing
            reported.add((scope, model))
            name = ast.unparse(func.value)
            yield uncovered[0], (f"forward pass of `{name}` after {name}.eval() outside torch.no_grad()/inference_mode(): "
                                 f"autograd still records the graph")


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
        defs = f.plain_functions.get(c.func.id, [])
        if len(defs) != 1 or c.func.id in f.aliases or not isinstance(defs[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        helper = defs[0]
        params = [a.arg for a in helper.args.posonlyargs + helper.args.args]
        given = [(params[i] if i < len(params) else None) for i, a in enumerate(c.args) if ast.dump(a) == spelled]
        given += [kw.arg for kw in c.keywords if kw.arg is not None and ast.dump(kw.value) == spelled]
        name = next((g for g in given if g is not None), None)
        if name is None:
            continue
        inner = f.calls_in(helper)
        if any(is_backward(x) or f.qualname(x.func) in ("torch.autograd.grad", "torch.autograd.backward")
               or (isinstance(x.func, ast.Attribute) and x.func.attr == "train" and isinstance(x.func.value, ast.Name)
                   and x.func.value.id == name) for x in inner):
            continue
        if any(b[1] != "param" for b in f.bindings.get(helper, {}).get(name, ())):
            continue  # the name is rebound: not provably the model
        forward = next((x for x in inner if isinstance(x.func, ast.Name) and x.func.id == name and not f.no_grad(x)),
                       None)
        if forward is not None and not _frozen(f, helper, ast.dump(ast.Name(id=name, ctx=ast.Load())), pos(forward)):
            return forward, helper.name
    return None


def _frozen(f: FileAnalysis, scope: ast.AST, model: str, before: tuple[int, int]) -> bool:
    """Before ``before`` in ``scope``, the whole model (``model`` is its ``ast.dump``) was
    frozen: ``model.requires_grad_(False)``, or ``requires_grad_(False)`` /
    ``requires_grad = False`` on every ``p`` of ``for p in model.parameters()``."""
    def false_flag(call: ast.Call) -> bool:
        flag = kwarg(call, "requires_grad", 0)
        return isinstance(flag, ast.Constant) and flag.value is False

    for call in f.calls_in(scope):
        if pos(call) >= before:
            break
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "requires_grad_" and false_flag(call):
            receiver = func.value
            if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute) and \
                    receiver.func.attr in ("eval", "train", "to", "cuda", "cpu"):
                receiver = receiver.func.value  # model.eval().requires_grad_(False)
            if ast.dump(receiver) == model:
                return True
    for loop in walk_local(scope):
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and pos(loop) < before):
            continue
        it = loop.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "parameters"
                and ast.dump(it.func.value) == model):
            continue
        p = loop.target.id
        for stmt in loop.body:
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "requires_grad_" and dotted(value.func.value) == p and false_flag(value)):
                return True
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and dotted(stmt.targets[0]) == f"{p}.requires_grad"
                    and isinstance(stmt.value, ast.Constant) and stmt.value.value is False):
                return True
    return False


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
        def loss_name(value) -> ast.Name | None:
            if isinstance(value, ast.Name):
                return value
            if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
                names = [s for s in (value.left, value.right) if isinstance(s, ast.Name)]
                return names[0] if len(names) == 1 else None
            return None

        def carries_graph(name: ast.Name, scope) -> bool:
            b = f.lookup(name)
            if b is None or b[1] != "value" or b[3]:
                return False
            value = b[2]
            if value is not None and f.no_grad(value):
                return False  # computed under no_grad / inference_mode: it has no graph
            if isinstance(value, ast.Call) and (
                    (isinstance(value.func, ast.Attribute)
                     and value.func.attr in ("item", "detach", "tolist", "cpu", "numpy"))
                    or (isinstance(value.func, ast.Name) and value.func.id in ("float", "int"))):
                return False
            k = f.kind(name)
            if k is not None and k.cat == "tensor" and k.detail == "loss":
                return True
            return any(is_backward(c) and isinstance(c.func.value, ast.Name) and c.func.value.id == name.id
                       and pos(c) > b[0] and f.lookup(c.func.value) is b for c in f.calls_in(scope))

        def accumulates_across(acc: ast.Name, node: ast.AST, loop: ast.AST) -> bool:
            b = f.lookup(acc)
            return b is None or b[0] < pos(loop)

        for node in f.nodes[ast.AugAssign] + f.nodes[ast.Assign] + f.nodes[ast.Call]:
            if isinstance(node, ast.AugAssign):
                if not (isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name)):
                    continue
                acc, value, how = node.target, node.value, "+="
            elif isinstance(node, ast.Assign):
                v = node.value
                if not (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and isinstance(v, ast.BinOp)
                        and isinstance(v.op, ast.Add) and isinstance(v.left, ast.Name) and v.left.id == node.targets[0].id):
                    continue
                acc, value, how = v.left, v.right, "+"
            else:
                func = node.func
                if not (isinstance(func, ast.Attribute) and func.attr == "append" and isinstance(func.value, ast.Name)
                        and len(node.args) == 1):
                    continue
                acc, value, how = func.value, node.args[0], "append"
            loss = loss_name(value)
            loops = f.loops_around(node)
            if loss is None or not loops or f.no_grad(node):
                continue
            scope = f.function_scope(node)
            if not carries_graph(loss, scope) or not accumulates_across(acc, node, loops[0]):
                continue
            if f.backward_mentions(scope, acc.id):
                continue  # the sum is what gets backpropagated (gradient accumulation, multi-task)
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _called_without_grad(f, scope):
                continue  # an evaluation helper that its callers run under no_grad
            fix = f"{acc.id}.append({loss.id}.item())" if how == "append" else f"{acc.id} += {loss.id}.item()"
            yield node, (f"`{loss.id}` accumulated into `{acc.id}` across iterations keeps every step's graph alive: "
                         f"use {fix}")


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
