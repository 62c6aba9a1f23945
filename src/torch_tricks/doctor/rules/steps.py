"""Rules about the optimizer step: gradients that are never zeroed or zeroed at the wrong
moment, gradients clipped while still scaled by a GradScaler, and a host sync every step.
"""

from __future__ import annotations

import ast
import re
from typing import Iterator

from torch_tricks.doctor.analysis import (LOOPS, SAFE_BUILTINS, SYNC_FUNCS, FileAnalysis, dotted,
                                          exclusive_branches, is_backward, kwarg, optimizer_step, pos, rate_limited,
                                          walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule

_GRAD_INPLACE = frozenset("zero_ zero_grad fill_ mul_ detach_ copy_ set_ requires_grad_".split())
_KNOWN_KINDS = frozenset("tensor batch module lossfn loader device optimizer scheduler params named_params".split())
_SCALER_METHODS = frozenset("scale step update unscale_ get_scale state_dict load_state_dict".split())
_CLIPS = frozenset("clip_grad_norm_ clip_grad_value_ clip_grad_norm clip_grads_with_norm_".split())


def _receiver(f: FileAnalysis, step: ast.Call) -> ast.AST:
    """The optimizer of ``optimizer.step()`` or ``scaler.step(optimizer)``."""
    k = f.kind(step.func.value)
    if k is not None and k.cat == "optimizer":
        return step.func.value
    return step.args[0] if step.args else step.func.value


def _zeroes_grads(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` clears or replaces gradients: ``x.zero_grad()``, ``p.grad = None``, ``p.grad.zero_()``,
    ``del p.grad``, ``torch._foreach_zero_(grads)``."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            if func.attr == "zero_grad":
                return True
            if func.attr in _GRAD_INPLACE and any(isinstance(n, ast.Attribute) and n.attr == "grad"
                                                  for n in ast.walk(func.value)):
                return True
        return (f.qualname(func) or "").startswith("torch._foreach_zero")
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = node.targets
        return any(isinstance(n, ast.Attribute) and n.attr == "grad" for t in targets for n in ast.walk(t))
    return False


def _is_modelish(f: FileAnalysis, node: ast.AST) -> bool:
    k = f.kind(node)
    if k is not None and (k.cat in ("module", "params", "named_params")
                          or (k.cat == "self" and f.is_module_class(k.ref))):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "parameters", "named_parameters"):
        return True
    spelled = dotted(node) or ""
    last = spelled.rsplit(".", 1)[-1].lower()
    return "model" in last or last in ("net", "network", "module")


def _callees(f: FileAnalysis, call: ast.Call) -> list[ast.AST] | None:
    """The functions of this file that ``call`` runs: [] for a call that is known not to touch
    gradients (torch, builtins, methods of known kinds), None for one the file does not show."""
    func = call.func
    q = f.qualname(func)
    if q is not None:
        return [] if q.split(".", 1)[0] in _QUIET_LIBRARIES else None
    if isinstance(func, ast.Name):
        return _function_callees(f, func)
    if isinstance(func, ast.Attribute):
        return _method_callees(f, func)
    return None


_QUIET_LIBRARIES = ("torch", "math", "numpy", "time", "os", "random", "logging", "tqdm", "json", "sys")
_QUIET_METHODS = ("append", "extend", "add", "update", "items", "keys", "values", "get", "format", "join",
                  "info", "debug", "warning", "write", "set_description", "set_postfix", "log")


def _function_callees(f: FileAnalysis, func: ast.Name) -> list[ast.AST] | None:
    """:func:`_callees` for a call by plain name: a function of this file, or a builtin."""
    b = f.lookup(func)
    if b is not None and b[1] == "def" and isinstance(b[2], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [b[2]]
    if b is None and func.id in f.plain_functions:
        return list(f.plain_functions[func.id])
    if b is None and (func.id in SAFE_BUILTINS or func.id in ("print", "float", "int", "bool", "open")):
        return []
    return None


def _method_callees(f: FileAnalysis, func: ast.Attribute) -> list[ast.AST] | None:
    """:func:`_callees` for a method call: a method of this file's class, or one of a known kind."""
    k = f.kind(func.value)
    if k is not None and k.cat in _KNOWN_KINDS:
        return []
    if k is not None and k.cat == "self":
        found = f.method(k.ref, func.attr)
        return [found] if found is not None else None
    if func.attr in _QUIET_METHODS:
        return []
    if func.attr in _SCALER_METHODS and _scaler_calls(f, func.value):
        return []
    return None


def _roots(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _zeroed_in(f: FileAnalysis, loop: ast.AST, opt: ast.AST) -> bool:
    """Gradients are cleared somewhere in ``loop`` (nested functions and loops included), in a
    function of this file that it calls (three deep), or maybe in a call the file does not show that
    is handed the optimizer or the model (or is a method of the object that holds the optimizer)."""
    opt_root = dotted(opt).split(".", 1)[0] if dotted(opt) else None
    todo, seen = [(loop, 0)], set()
    while todo:
        root, depth = todo.pop()
        if root in seen:
            continue
        seen.add(root)
        for node in ast.walk(root):
            if _zeroes_grads(f, node):
                return True
            if not isinstance(node, ast.Call) or depth > 3:
                continue
            callees = _callees(f, node)
            if callees is None:
                args = list(node.args) + [kw.value for kw in node.keywords]
                if isinstance(node.func, ast.Attribute):
                    receiver = dotted(node.func.value)
                    if opt_root is not None and receiver is not None and receiver.split(".", 1)[0] == opt_root \
                            and opt_root != dotted(opt):
                        return True  # a method of the object that holds the optimizer (self.optimizer)
                if any(opt_root in _roots(a) for a in args) or any(_is_modelish(f, a) for a in args):
                    return True
                continue
            todo.extend((c, depth + 1) for c in callees)
    return False


def _same_optimizer(f: FileAnalysis, zero: ast.Call, opt: ast.AST) -> bool:
    """``zero`` (an ``x.zero_grad()``) clears the gradients ``opt`` steps with: the same optimizer,
    or the model whose parameters the file built that optimizer on."""
    target = zero.func.value
    if ast.dump(target) == ast.dump(opt):
        return True
    k = f.kind(opt)
    if k is None or k.cat != "optimizer" or not isinstance(k.ref, ast.Call):
        return False
    params = kwarg(k.ref, "params", 0)
    name = dotted(target)
    if params is None or name is None:
        return False
    exprs = [params] + [f.binding_value(n) for n in ast.walk(params) if isinstance(n, ast.Name)]
    return any(dotted(n) == name for e in exprs if e is not None for n in ast.walk(e))


def _reaches(f: FileAnalysis, a: ast.AST, b: ast.AST) -> bool:
    """Running the statement of ``a`` goes on to the statement holding ``b``: ``b`` is in a later
    statement of the same block as ``a`` (not in another branch, not after a ``continue``)."""
    stmt, parent = a, f.parent.get(a)
    while parent is not None and not isinstance(stmt, ast.stmt):
        stmt, parent = parent, f.parent.get(parent)
    if parent is None:
        return False
    for field in ("body", "orelse", "finalbody", "handlers"):
        block = getattr(parent, field, None)
        if isinstance(block, list) and stmt in block:
            later = block[block.index(stmt) + 1:]
            if any(isinstance(s, (ast.Continue, ast.Break, ast.Return, ast.Raise)) for s in block[block.index(stmt):]
                   if pos(s) < pos(b)):
                return False
            return any(n is b for s in later for n in ast.walk(s))
    return False


def _modulo_if(f: FileAnalysis, node: ast.AST, loop: ast.AST) -> ast.If | None:
    child = node
    for anc in f.ancestors(node):
        if anc is loop:
            return None
        if isinstance(anc, ast.If) and child is not anc.test and any(
                isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(anc.test)):
            return anc
        child = anc
    return None


def _guarded(f: FileAnalysis, node: ast.AST, loop: ast.AST) -> bool:
    for anc in f.ancestors(node):
        if anc is loop:
            return False
        if isinstance(anc, (ast.If, ast.IfExp, ast.ExceptHandler) + LOOPS):
            return True
    return False


def _training_loops(f: FileAnalysis) -> Iterator[tuple[ast.AST, ast.Call, list[ast.Call]]]:
    """(loop, optimizer step, backward calls) for each ``optimizer.step()`` whose innermost loop runs
    a ``.backward()`` in the same frame (in it or in a nested loop)."""
    for call in f.nodes[ast.Call]:
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == "step" and optimizer_step(f, call)):
            continue
        loops = f.loops_around(call)
        if not loops:
            continue
        loop = loops[0]
        calls = [n for n in walk_local(loop) if isinstance(n, ast.Call)]
        backwards = [c for c in calls if is_backward(c)]
        if not backwards or any(f.qualname(c.func) == "torch.autograd.grad" for c in calls):
            continue
        yield loop, call, backwards


@static_rule
class ZeroGradMissingOrMisplaced(StaticRule):
    id = "TT126"
    name = "zero-grad-missing-or-misplaced"
    severity = "warning"
    source = ("X (zero_grad); T11; seeds/002 自动微分 §3 计算图与反向传播 (张量的grad梯度不会自动清零,需要手动置零); "
              "seeds/000 PyTorch节省显存 梯度累加; seeds/003 Pytorch训练阶段 §2 (通过梯度积累变相增大batch size)")
    message = ("gradients are never zeroed, or zeroed between backward() and step(): backward() adds into .grad, so "
               "each step applies the wrong gradients")
    explanation = ("backward() adds the new gradients into each parameter's .grad; nothing clears them but "
                   "zero_grad() (or p.grad = None). A loop that steps without ever zeroing applies the sum of every "
                   "gradient since the start, so the updates grow and training diverges; zero_grad() between "
                   "backward() and step() erases the gradients before they are applied (the step does nothing, or "
                   "only weight decay); under gradient accumulation (step() inside `if (i + 1) % k == 0:`) a "
                   "zero_grad() that runs every micro-batch keeps only the last micro-batch's gradients. Fix: call "
                   "optimizer.zero_grad(set_to_none=True) once per update, before the first backward() of the "
                   "update or right after step() (inside the accumulation `if` with the step). Quiet when the "
                   "loop calls something the file does not show that is handed the optimizer or the model, and "
                   "where gradients come from torch.autograd.grad.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        reported = set()
        hooked = _zeroing_hooked(f)
        for loop, step, backwards in _training_loops(f):
            opt = _receiver(f, step)
            key = (loop, ast.dump(opt))
            if key in reported:
                continue
            finding = _zero_grad_problem(f, loop, step, backwards, opt, hooked)
            if finding is not None:
                reported.add(key)
                yield finding


def _zeroing_hooked(f: FileAnalysis) -> bool:
    """The file registers an optimizer step hook or a lambda that clears gradients: they may be
    zeroed where the loop does not show it."""
    return any(isinstance(c.func, ast.Attribute) and c.func.attr.startswith("register_step_")
               for c in f.nodes[ast.Call]) or any(
        _zeroes_grads(f, n) for lam in f.nodes[ast.Lambda] for n in ast.walk(lam))


def _zero_grad_problem(f: FileAnalysis, loop: ast.AST, step: ast.Call, backwards: list[ast.Call], opt: ast.AST,
                       hooked: bool) -> tuple[ast.AST, str] | None:
    """The first of TT126's three findings that holds for ``step`` in ``loop``: gradients never
    zeroed, zeroed between backward() and step(), or zeroed every micro-batch of an accumulation."""
    if not hooked and not _zeroed_in(f, loop, opt):
        return step, (f"`{ast.unparse(step)}` in a loop that never zeroes the gradients: backward() keeps adding "
                      f"into .grad, so every step applies the sum of all gradients so far; call "
                      f"{ast.unparse(opt)}.zero_grad() once per step")
    zeros = sorted((n for n in walk_local(loop) if isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute) and n.func.attr == "zero_grad"
                    and _same_optimizer(f, n, opt)), key=pos)
    misplaced = _zeroed_before_step(f, zeros, step, backwards)
    return misplaced or _zeroed_every_micro_batch(f, loop, zeros, step, backwards)


def _zeroed_before_step(f: FileAnalysis, zeros: list[ast.Call], step: ast.Call,
                        backwards: list[ast.Call]) -> tuple[ast.AST, str] | None:
    """A ``zero_grad()`` that runs after the backward and before ``step``, with no backward between."""
    for zero in zeros:
        if not pos(zero) < pos(step):
            continue
        before = [b for b in backwards if pos(b) < pos(zero) and not exclusive_branches(f, b, zero)]
        between = [b for b in backwards if pos(zero) < pos(b) < pos(step)]
        if before and not between and _reaches(f, zero, step):
            return zero, (f"`{ast.unparse(zero)}` between backward() and `{ast.unparse(step)}` erases the "
                          f"gradients before the step applies them: zero them before backward() or after "
                          f"the step")
    return None


def _zeroed_every_micro_batch(f: FileAnalysis, loop: ast.AST, zeros: list[ast.Call], step: ast.Call,
                              backwards: list[ast.Call]) -> tuple[ast.AST, str] | None:
    """Under gradient accumulation (``step`` inside ``if i % k == 0:``), a ``zero_grad()`` outside
    that ``if`` that runs every iteration, while backward runs every iteration too."""
    accumulation = _modulo_if(f, step, loop)
    if accumulation is None or accumulation.orelse or any(is_backward(n) for n in ast.walk(accumulation)):
        return None  # no accumulation, or alternating updates (an else steps something else)
    if _other_step_every_iteration(f, loop, step, accumulation):
        return None  # another optimizer steps every iteration: updates alternate, they do not accumulate
    if all(_inside(f, b, accumulation) for b in backwards):
        return None
    for zero in zeros:
        if not _guarded(f, zero, loop) and not _inside(f, zero, accumulation):
            return zero, (f"`{ast.unparse(zero)}` runs every micro-batch while `{ast.unparse(step)}` runs "
                          f"only under `if {ast.unparse(accumulation.test)}:`: the accumulated gradients "
                          f"are erased and each step sees one micro-batch; zero them inside the `if`, "
                          f"after the step")
    return None


def _other_step_every_iteration(f: FileAnalysis, loop: ast.AST, step: ast.Call, accumulation: ast.If) -> bool:
    """Some optimizer other than ``step``'s steps in ``loop`` outside the accumulation ``if``."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"
               and n is not step and optimizer_step(f, n) and not _inside(f, n, accumulation)
               for n in walk_local(loop))


def _inside(f: FileAnalysis, node: ast.AST, outer: ast.AST) -> bool:
    return any(a is outer for a in f.ancestors(node))


# --------------------------------------------------------------------------- GradScaler and clipping


def _scaler_calls(f: FileAnalysis, node: ast.AST) -> list[ast.Call]:
    """The ``GradScaler(...)`` constructions of this file assigned to the name ``node`` ends with
    (``scaler``, ``self.scaler``, a parameter called like a scaler the file builds)."""
    if "scalers" not in f.memo:
        table: dict[str, list[ast.Call]] = {}
        for assign in f.nodes[ast.Assign] + f.nodes[ast.AnnAssign]:
            value = assign.value
            if value is None:
                continue
            made = [n for n in ast.walk(value) if isinstance(n, ast.Call) and (f.qualname(n.func) or "").startswith(
                "torch.") and (f.qualname(n.func) or "").endswith("GradScaler")]
            if not made:
                continue
            targets = assign.targets if isinstance(assign, ast.Assign) else [assign.target]
            for t in targets:
                spelled = dotted(t)
                if spelled is not None:
                    table.setdefault(spelled.rsplit(".", 1)[-1], []).extend(made)
        f.memo["scalers"] = table
    spelled = dotted(node)
    return f.memo["scalers"].get(spelled.rsplit(".", 1)[-1], []) if spelled is not None else []


def _disabled(call: ast.Call) -> bool:
    flag = kwarg(call, "enabled")
    return isinstance(flag, ast.Constant) and flag.value is False


@static_rule
class ClipScaledGradients(StaticRule):
    id = "TT127"
    name = "clip-scaled-gradients"
    severity = "error"
    source = ("T1; seeds/000 混合精度 (torch.cuda.amp, PyTorch 的 amp_examples 文档); "
              "seeds/000 训练策略 低精度训练; PyTorch AMP examples (gradient clipping: unscale_ first)")
    message = ("gradients clipped between scaler.scale(loss).backward() and scaler.step() without "
               "scaler.unscale_(optimizer) first: the threshold applies to gradients multiplied by the loss scale")
    explanation = ("With a GradScaler, backward() runs on loss * scale (65536 at the start), so every .grad is "
                   "scaled too until scaler.step() unscales it. clip_grad_norm_ / clip_grad_value_ before that "
                   "compare the scaled gradients with the threshold: the norm is thousands of times too large, so "
                   "clipping cuts almost every step to a tiny update (or, with clip_grad_value_, distorts the "
                   "direction). Fix: scaler.unscale_(optimizer) right before clipping, then scaler.step(optimizer) "
                   "(it does not unscale twice) and scaler.update(). Quiet when unscale_ comes first and when the "
                   "scaler is built with enabled=False.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for clip in f.nodes[ast.Call]:
            q = f.qualname(clip.func) or ""
            if q.startswith("torch.nn.utils.") and q.rsplit(".", 1)[-1] in _CLIPS:
                message = _clipped_while_scaled(f, clip, q.rsplit(".", 1)[-1])
                if message is not None:
                    yield clip, message


def _clipped_while_scaled(f: FileAnalysis, clip: ast.Call, clip_name: str) -> str | None:
    """TT127's message if ``clip`` runs after a ``scaler.scale(loss).backward()`` and before that
    scaler's ``step()``, with no ``unscale_`` between the backward and the clip."""
    calls = [c for c in f.calls_in(f.function_scope(clip)) if not exclusive_branches(f, c, clip)]
    backward = _last_scaled_backward(f, calls, clip)
    if backward is None:
        return None
    scaler = _scale_call(f, backward.func.value).func.value
    made = _scaler_calls(f, scaler)
    if not made or all(_disabled(c) for c in made):
        return None
    steps = [c for c in _method_calls(calls, scaler, "step") if pos(c) > pos(clip)]
    unscaled = [c for c in _method_calls(calls, scaler, "unscale_") if pos(backward) < pos(c) < pos(clip)]
    if not steps or unscaled:
        return None
    s = ast.unparse(scaler)
    opt = ast.unparse(steps[0].args[0]) if steps[0].args else "optimizer"
    return (f"`{clip_name}` between `{s}.scale(...).backward()` and `{s}.step()` without "
            f"`{s}.unscale_({opt})` first: the threshold applies to gradients multiplied by the "
            f"loss scale; call {s}.unscale_({opt}) before clipping")


def _last_scaled_backward(f: FileAnalysis, calls: list[ast.Call], before: ast.AST) -> ast.Call | None:
    """The last ``scaler.scale(loss).backward()`` among ``calls`` before ``before``."""
    scaled = [c for c in calls if is_backward(c) and pos(c) < pos(before) and _scale_call(f, c.func.value)]
    return scaled[-1] if scaled else None


def _method_calls(calls: list[ast.Call], receiver: ast.AST, method: str) -> list[ast.Call]:
    """The calls of ``receiver.method(...)`` among ``calls``, in their order."""
    same = ast.dump(receiver)
    return [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == method
            and ast.dump(c.func.value) == same]


def _scale_call(f: FileAnalysis, node: ast.AST) -> ast.Call | None:
    """``scaler.scale(loss)`` (the receiver of a ``.backward()``), for a scaler this file builds."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "scale" \
            and _scaler_calls(f, node.func.value):
        return node
    return None


# --------------------------------------------------------------------------- host syncs


_SYNC_METHODS = frozenset({"item", "cpu", "numpy", "tolist"})
_LOGGING_WORDS = ("log", "print", "verbose", "debug", "display", "interval", "freq", "every")


def _device_value(f: FileAnalysis, node: ast.AST, losses: set[str], depth: int = 0) -> bool:
    """``node`` holds a result of the step's device work: the loss a ``.backward()`` of the loop is
    called on, a loss function's or a module's output (or a part of one), or an expression of those."""
    node = _strip_views(node)
    if isinstance(node, ast.Name) and node.id in losses:
        return True
    if _module_output(f, node) or _model_output_by_name(f, node):
        return True
    return depth < 3 and any(_device_value(f, part, losses, depth + 1) for part in _value_sources(f, node))


_VIEW_METHODS = ("detach", "mean", "sum", "float", "argmax", "max", "eq", "view", "clone")


def _strip_views(node: ast.AST) -> ast.AST:
    """What ``node`` is a part or a reduction of: ``loss`` for ``loss.detach().mean()``, ``out[0]``."""
    while isinstance(node, (ast.Subscript, ast.Attribute)) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _VIEW_METHODS):
        node = node.func.value if isinstance(node, ast.Call) else node.value
    return node


def _module_output(f: FileAnalysis, node: ast.AST) -> bool:
    """A call of a module, a loss function or a ``torch.nn.functional`` function giving a tensor."""
    k = f.kind(node)
    if not (k is not None and k.cat == "tensor" and k.detail in ("loss", None) and isinstance(node, ast.Call)):
        return False
    fk = f.kind(node.func)
    if fk is not None and (fk.cat in ("module", "lossfn") or (fk.cat == "self" and f.is_module_class(fk.ref))):
        return True
    return (f.qualname(node.func) or "").startswith("torch.nn.functional.")


def _model_output_by_name(f: FileAnalysis, node: ast.AST) -> bool:
    """The output of a model passed in: a call of an unknown name that says model / net / encoder."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and f.kind(node.func) is None and bool(
        re.search(r"model|net|encoder|decoder", node.func.id, re.IGNORECASE))


def _value_sources(f: FileAnalysis, node: ast.AST) -> list[ast.AST]:
    """The expressions ``node``'s value comes from: a name's assigned value (or the call it is
    unpacked from, ``out, aux = model(x)``), both sides of an arithmetic expression."""
    if isinstance(node, ast.Name):
        value = f.binding_value(node)
        if value is not None:
            return [value]
        b = f.lookup(node)
        return [b[2]] if b is not None and b[1] == "value" and b[3] and isinstance(b[2], ast.Call) else []
    if isinstance(node, ast.BinOp):
        return [node.left, node.right]
    return []


def _loss_names(node: ast.AST) -> set[str]:
    """The names a backward is called on: ``loss`` in ``loss.backward()``, ``(loss / k).backward()``,
    ``scaler.scale(loss).backward()``, ``loss.mean().backward()``."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.BinOp):
        return _loss_names(node.left) | _loss_names(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "scale" and node.args:
            return _loss_names(node.args[0])
        if node.func.attr in ("sum", "mean", "float"):
            return _loss_names(node.func.value)
    return set()


def _backward_names(f: FileAnalysis, loop: ast.AST) -> set[str] | None:
    """None if ``loop`` runs no backward in its own body (not counting nested loops); else the names
    of what it backpropagates. A function of the file that the loop calls with the loss and that runs
    the backward itself (timm's ``_backward(loss)``) counts, its arguments being the loss."""
    names, found = set(), False
    for node in walk_local(loop, into_loops=False):
        if not isinstance(node, ast.Call):
            continue
        if is_backward(node):
            found = True
            names |= _loss_names(node.func.value)
        elif isinstance(node.func, ast.Name):
            b = f.lookup(node.func)
            if b is not None and b[1] == "def" and isinstance(b[2], (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    is_backward(n) for n in walk_local(b[2])):
                found = True
                names |= {a.id for a in node.args if isinstance(a, ast.Name)}
    return names if found else None


def _quiet_guard(f: FileAnalysis, node: ast.AST, loop: ast.AST) -> bool:
    """``node`` does not run every step: under a rate-limiting ``if`` (``step % n == 0``, a logging
    switch) inside ``loop``."""
    for anc in f.ancestors(node):
        if anc is loop:
            return False
        if isinstance(anc, (ast.If, ast.IfExp)) and (rate_limited(anc.test) or any(
                word in (dotted(n) or "").lower() for n in ast.walk(anc.test)
                if isinstance(n, (ast.Name, ast.Attribute)) for word in _LOGGING_WORDS)):
            return True
        if isinstance(anc, ast.ExceptHandler):
            return True
        if isinstance(anc, ast.If) and node not in ast.walk(anc.test) and _guard_test(f, anc.test):
            return True  # the body of a NaN / divergence guard: runs when training is about to stop
    return False


def _after_synchronize(f: FileAnalysis, node: ast.AST) -> bool:
    """The statement reading ``node`` comes right after an explicit ``torch.cuda.synchronize()`` (or a
    stream's / event's ``.synchronize()``) in the same block: the device is idle, the read waits for
    nothing, and the sync is a deliberate choice (timing a step for the logger)."""
    stmt = node
    while stmt is not None and not isinstance(stmt, ast.stmt):
        stmt = f.parent.get(stmt)
    block = next((getattr(f.parent.get(stmt), name) for name in ("body", "orelse", "finalbody")
                  if stmt in getattr(f.parent.get(stmt), name, ())), None) if stmt is not None else None
    if not block:
        return False
    i = block.index(stmt)
    prev = block[i - 1] if i else None
    return (isinstance(prev, ast.Expr) and isinstance(prev.value, ast.Call)
            and (f.qualname(prev.value.func) in SYNC_FUNCS or (isinstance(prev.value.func, ast.Attribute)
                                                             and prev.value.func.attr == "synchronize")))


_GUARD_FUNCS = frozenset({"math.isfinite", "math.isnan", "math.isinf", "torch.isfinite", "torch.isnan", "torch.isinf"})


def _guard_test(f: FileAnalysis, test: ast.AST) -> bool:
    """``test`` checks a value already brought to the host (``loss.item()``, ``math.isfinite(...)``):
    the sync is paid by the test, and its body runs only when the check trips."""
    return any(isinstance(n, ast.Call) and (f.qualname(n.func) in _GUARD_FUNCS or (
        isinstance(n.func, ast.Attribute) and n.func.attr in ("item", "isfinite", "isnan", "isinf")))
        for n in ast.walk(test))


def _control_flow(f: FileAnalysis, call: ast.AST, loop: ast.AST) -> bool:
    """The synced value decides what the loop does this step (a NaN guard, early stopping): used in
    an ``if``/``while`` test or an ``assert``, directly or through the name it is assigned to."""
    for anc in f.ancestors(call):
        if anc is loop:
            break
        if isinstance(anc, (ast.If, ast.While, ast.Assert, ast.IfExp)) and any(n is call for n in ast.walk(anc.test)):
            return True
    parent = f.parent.get(call)
    while isinstance(parent, (ast.BinOp, ast.UnaryOp, ast.Call)) and not isinstance(parent, ast.stmt):
        parent = f.parent.get(parent)
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name):
        name = parent.targets[0].id
        for node in walk_local(loop):
            if isinstance(node, (ast.If, ast.While, ast.Assert)) and pos(node) > pos(parent) and any(
                    isinstance(n, ast.Name) and n.id == name for n in ast.walk(node.test)):
                return True
    return False


def _uses_accelerator(f: FileAnalysis) -> bool:
    """The file moves work to an asynchronous device: CUDA, or ``torch.accelerator`` / MPS / XPU."""
    return f.mentions_cuda or any((f.qualname(n) or "").startswith(("torch.accelerator.", "torch.mps.", "torch.xpu."))
                                  for n in f.nodes[ast.Attribute]) or any(
        isinstance(n.value, str) and n.value.split(":", 1)[0] in ("mps", "xpu") for n in f.nodes[ast.Constant])


@static_rule
class PerStepHostSync(StaticRule):
    id = "TT131"
    name = "per-step-host-sync"
    severity = "info"
    source = ("T3; seeds/001 基本操作 check list (不要用 .cpu() 来取 GPU 里面出来的图片. 这样做的话训练时长可能翻倍); "
              "seeds/000 代码层面 (Avoid unnecessary transfer of data from the GPU); seeds/003 测试阶段 §1 "
              "(result.cpu() waits for the GPU)")
    message = ("loss.item() / .cpu() / .numpy() / .tolist() / float(loss) every training step: each one waits for "
               "the GPU to finish, so the host cannot queue the next step ahead")
    explanation = ("CUDA work is asynchronous: the Python loop normally runs ahead and queues the next step while "
                   "the GPU computes. Reading a device value on the host (.item(), float(t), .cpu(), .numpy(), "
                   ".tolist(), print(loss)) blocks until every queued kernel has finished, so each step the GPU "
                   "idles while Python prepares the next one. Fix: keep running sums on the device "
                   "(total += loss.detach()) and read them every N steps (`if step % log_interval == 0:`) or once "
                   "per epoch. Quiet when the read is rate-limited, outside the loop, or decides the loop's control "
                   "flow (a NaN guard).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        if not _uses_accelerator(f):
            return
        for t in LOOPS:
            for loop in f.nodes[t]:
                losses = _backward_names(f, loop)
                found = _first_host_sync(f, loop, losses) if losses is not None else None
                if found is not None:
                    yield found, (f"`{ast.unparse(found)}` every training step waits for the GPU (a host sync per "
                                  f"step): accumulate on the device and read it every N steps")


def _first_host_sync(f: FileAnalysis, loop: ast.AST, losses: set[str]) -> ast.Call | None:
    """The earliest call in ``loop``'s own body that reads a device result on the host every step
    (not rate-limited, not deciding control flow, not right after an explicit synchronize)."""
    found = None
    for node in walk_local(loop, into_loops=False):
        if not isinstance(node, ast.Call):
            continue
        value = _synced_value(f, node)
        if value is None:
            continue
        k = f.kind(value)
        if (k is not None and k.cat != "tensor") or not _device_value(f, value, losses):
            continue
        if _quiet_guard(f, node, loop) or _control_flow(f, node, loop) or _after_synchronize(f, node):
            continue
        if found is None or pos(node) < pos(found):
            found = node
    return found


def _synced_value(f: FileAnalysis, call: ast.Call) -> ast.AST | None:
    """What ``call`` brings to the host: ``x`` of ``x.item()`` / ``x.cpu()`` / ... or ``float(x)``."""
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS and not call.args:
        return func.value
    if isinstance(func, ast.Name) and func.id == "float" and len(call.args) == 1 and f.lookup(func) is None:
        return call.args[0]
    return None
