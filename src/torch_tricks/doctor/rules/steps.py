"""Rules about the optimizer step: gradients that are never zeroed or zeroed at the wrong
moment, gradients clipped while still scaled by a GradScaler, and a host sync every step.
"""

from __future__ import annotations

import ast
import re
from typing import Iterator

from torch_tricks.doctor.analysis import (LOOPS, SAFE_BUILTINS, SYNC_FUNCS, FileAnalysis, Kind, ancestors_until,
                                          called_method, dotted, exclusive_branches, is_backward, kwarg,
                                          optimizer_step, pos, rate_limited, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule

_GRAD_INPLACE = frozenset("zero_ zero_grad fill_ mul_ detach_ copy_ set_ requires_grad_".split())
_KNOWN_KINDS = frozenset("tensor batch module lossfn loader device optimizer scheduler params named_params".split())
_SCALER_METHODS = frozenset("scale step update unscale_ get_scale state_dict load_state_dict".split())
_CLIPS = frozenset("clip_grad_norm_ clip_grad_value_ clip_grad_norm clip_grads_with_norm_".split())


def _receiver(f: FileAnalysis, step: ast.Call) -> ast.AST:
    """The optimizer of ``optimizer.step()`` or ``scaler.step(optimizer)``."""
    if _category(f, step.func.value) == "optimizer":
        return step.func.value
    return step.args[0] if step.args else step.func.value


def _category(f: FileAnalysis, node: ast.AST) -> str | None:
    """The category of ``node``'s kind (``"optimizer"``, ``"tensor"`` ...), None where the file does not show it."""
    k = f.kind(node)
    return k.cat if k is not None else None


def _is_method_call(node: ast.AST, *names: str) -> bool:
    """``node`` is a call ``x.name(...)`` of a method with one of ``names``."""
    return called_method(node) in names


def _zeroes_grads(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` clears or replaces gradients: ``x.zero_grad()``, ``p.grad = None``, ``p.grad.zero_()``,
    ``del p.grad``, ``torch._foreach_zero_(grads)``."""
    if isinstance(node, ast.Call):
        return _zero_grad_call(f, node)
    if isinstance(node, (ast.Assign, ast.Delete)):
        return any(_mentions_grad(t) for t in node.targets)
    return False


def _zero_grad_call(f: FileAnalysis, call: ast.Call) -> bool:
    if _is_method_call(call, "zero_grad"):
        return True
    if _is_method_call(call, *_GRAD_INPLACE) and _mentions_grad(call.func.value):
        return True
    return (f.qualname(call.func) or "").startswith("torch._foreach_zero")


def _mentions_grad(node: ast.AST) -> bool:
    """Some ``x.grad`` in ``node``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "grad" for n in ast.walk(node))


def _is_modelish(f: FileAnalysis, node: ast.AST) -> bool:
    if _is_model_kind(f, f.kind(node)) or _category(f, node) in ("params", "named_params"):
        return True
    return _is_method_call(node, "parameters", "named_parameters") or _model_like_name(node)


def _is_model_kind(f: FileAnalysis, k: Kind | None) -> bool:
    """A module, or ``self`` in a module class."""
    return k is not None and (k.cat == "module" or (k.cat == "self" and f.is_module_class(k.ref)))


def _model_like_name(node: ast.AST) -> bool:
    """A name (or the last part of ``a.b``) that says model / net / network / module."""
    last = (dotted(node) or "").rsplit(".", 1)[-1].lower()
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
_QUIET_BUILTINS = SAFE_BUILTINS | {"print", "float", "int", "bool", "open"}
_QUIET_METHODS = ("append", "extend", "add", "update", "items", "keys", "values", "get", "format", "join",
                  "info", "debug", "warning", "write", "set_description", "set_postfix", "log")


def _function_callees(f: FileAnalysis, func: ast.Name) -> list[ast.AST] | None:
    """:func:`_callees` for a call by plain name: a function of this file, or a builtin."""
    b = f.lookup(func)
    if b is not None:
        return [b[2]] if _defines_function(b) else None
    if func.id in f.plain_functions:
        return list(f.plain_functions[func.id])
    return [] if func.id in _QUIET_BUILTINS else None


def _defines_function(b: tuple | None) -> bool:
    """The binding ``b`` (from ``f.lookup``) is a ``def``."""
    return b is not None and b[1] == "def" and isinstance(b[2], (ast.FunctionDef, ast.AsyncFunctionDef))


def _method_callees(f: FileAnalysis, func: ast.Attribute) -> list[ast.AST] | None:
    """:func:`_callees` for a method call: a method of this file's class, or one of a known kind."""
    k = f.kind(func.value)
    if k is not None and k.cat == "self":
        found = f.method(k.ref, func.attr)
        return [found] if found is not None else None
    if (k is not None and k.cat in _KNOWN_KINDS) or _quiet_method(f, func):
        return []
    return None


def _quiet_method(f: FileAnalysis, func: ast.Attribute) -> bool:
    """A method that does not touch gradients whatever it is called on (``append``, ``log``), or a
    GradScaler's."""
    return func.attr in _QUIET_METHODS or (func.attr in _SCALER_METHODS and bool(_scaler_calls(f, func.value)))


def _roots(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _zeroed_in(f: FileAnalysis, loop: ast.AST, opt: ast.AST) -> bool:
    """Gradients are cleared somewhere in ``loop`` (nested functions and loops included), in a
    function of this file that it calls (three deep), or maybe in a call the file does not show that
    is handed the optimizer or the model (or is a method of the object that holds the optimizer)."""
    for node, unseen in _code_run_by(f, loop):
        if _zeroes_grads(f, node) or (unseen and _may_zero_unseen(f, node, opt)):
            return True
    return False


def _code_run_by(f: FileAnalysis, loop: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every node of ``loop`` and of the functions of this file that it calls (three deep), each with
    whether it is a call whose code the file does not show."""
    todo, seen = [(loop, 0)], set()
    while todo:
        root, depth = todo.pop()
        if root in seen:
            continue
        seen.add(root)
        for node in ast.walk(root):
            callees = _callees_within(f, node, depth)
            yield node, callees is None
            todo.extend((c, depth + 1) for c in callees or ())


def _callees_within(f: FileAnalysis, node: ast.AST, depth: int) -> list[ast.AST] | None:
    """:func:`_callees` of ``node`` while ``depth`` is at most three calls deep; [] for what is not a call."""
    if not isinstance(node, ast.Call) or depth > 3:
        return []
    return _callees(f, node)


def _may_zero_unseen(f: FileAnalysis, call: ast.Call, opt: ast.AST) -> bool:
    """A call the file does not show may clear ``opt``'s gradients."""
    spelled = dotted(opt)
    opt_root = spelled.split(".", 1)[0] if spelled else None
    return _method_of_holder(call, opt_root, spelled) or _handed_optimizer_or_model(f, call, opt_root)


def _method_of_holder(call: ast.Call, opt_root: str | None, spelled: str | None) -> bool:
    """``call`` is a method of the object that holds the optimizer (``self.fit()`` for ``self.optimizer``)."""
    receiver = dotted(call.func.value) if isinstance(call.func, ast.Attribute) else None
    return receiver is not None and receiver.split(".", 1)[0] == opt_root and opt_root != spelled


def _handed_optimizer_or_model(f: FileAnalysis, call: ast.Call, opt_root: str | None) -> bool:
    args = list(call.args) + [kw.value for kw in call.keywords]
    return any(opt_root in _roots(a) for a in args) or any(_is_modelish(f, a) for a in args)


def _same_optimizer(f: FileAnalysis, zero: ast.Call, opt: ast.AST) -> bool:
    """``zero`` (an ``x.zero_grad()``) clears the gradients ``opt`` steps with: the same optimizer,
    or the model whose parameters the file built that optimizer on."""
    target = zero.func.value
    if ast.dump(target) == ast.dump(opt):
        return True
    params = _optimizer_params(f, opt)
    name = dotted(target)
    return params is not None and name is not None and _built_on(f, params, name)


def _optimizer_params(f: FileAnalysis, opt: ast.AST) -> ast.AST | None:
    """The parameters argument of the ``torch.optim`` call that built ``opt``, where the file shows it."""
    k = f.kind(opt)
    if k is None or k.cat != "optimizer" or not isinstance(k.ref, ast.Call):
        return None
    return kwarg(k.ref, "params", 0)


def _built_on(f: FileAnalysis, params: ast.AST, name: str) -> bool:
    """``params`` (or the value of a name in it) mentions ``name``: ``model.parameters()`` for ``model``."""
    exprs = [params] + [f.binding_value(n) for n in ast.walk(params) if isinstance(n, ast.Name)]
    return any(dotted(n) == name for e in exprs if e is not None for n in ast.walk(e))


def _reaches(f: FileAnalysis, a: ast.AST, b: ast.AST) -> bool:
    """Running the statement of ``a`` goes on to the statement holding ``b``: ``b`` is in a later
    statement of the same block as ``a`` (not in another branch, not after a ``continue``)."""
    found = _enclosing_block(f, a)
    if found is None:
        return False
    block, stmt = found
    i = block.index(stmt)
    return not _exits_before(block[i:], b) and any(_contains(s, b) for s in block[i + 1:])


_BLOCKS = ("body", "orelse", "finalbody")


def _enclosing_block(f: FileAnalysis, node: ast.AST) -> tuple[list[ast.stmt], ast.stmt] | None:
    """The list of statements (a body, an else, a finally) that holds the statement of ``node``, and
    that statement."""
    stmt = _statement_of(f, node)
    parent = f.parent.get(stmt)
    for field in _BLOCKS:
        block = getattr(parent, field, None)
        if isinstance(block, list) and stmt in block:
            return block, stmt
    return None


def _statement_of(f: FileAnalysis, node: ast.AST) -> ast.stmt | None:
    while node is not None and not isinstance(node, ast.stmt):
        node = f.parent.get(node)
    return node


def _exits_before(stmts: list[ast.stmt], node: ast.AST) -> bool:
    """A ``continue`` / ``break`` / ``return`` / ``raise`` among ``stmts`` before ``node``."""
    return any(isinstance(s, (ast.Continue, ast.Break, ast.Return, ast.Raise)) for s in stmts if pos(s) < pos(node))


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(tree))


def _modulo_if(f: FileAnalysis, node: ast.AST, loop: ast.AST) -> ast.If | None:
    child = node
    for anc in f.ancestors(node):
        if anc is loop:
            return None
        if isinstance(anc, ast.If) and child is not anc.test and _has_modulo(anc.test):
            return anc
        child = anc
    return None


def _has_modulo(test: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))


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
        if not _is_optimizer_step(f, call):
            continue
        loops = f.loops_around(call)
        backwards = _loop_backwards(f, loops[0]) if loops else []
        if backwards:
            yield loops[0], call, backwards


def _is_optimizer_step(f: FileAnalysis, node: ast.AST) -> bool:
    """``optimizer.step()`` or ``scaler.step(optimizer)``."""
    return _is_method_call(node, "step") and optimizer_step(f, node)


def _loop_backwards(f: FileAnalysis, loop: ast.AST) -> list[ast.Call]:
    """The ``.backward()`` calls in ``loop``'s frame; none where gradients come from ``torch.autograd.grad``."""
    calls = [n for n in walk_local(loop) if isinstance(n, ast.Call)]
    if any(f.qualname(c.func) == "torch.autograd.grad" for c in calls):
        return []
    return [c for c in calls if is_backward(c)]


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
    return _registers_step_hook(f) or any(_zeroes_grads(f, n) for lam in f.nodes[ast.Lambda] for n in ast.walk(lam))


def _registers_step_hook(f: FileAnalysis) -> bool:
    """``optimizer.register_step_pre_hook(...)`` / ``register_step_post_hook(...)``."""
    return any(isinstance(c.func, ast.Attribute) and c.func.attr.startswith("register_step_")
               for c in f.nodes[ast.Call])


def _zero_grad_problem(f: FileAnalysis, loop: ast.AST, step: ast.Call, backwards: list[ast.Call], opt: ast.AST,
                       hooked: bool) -> tuple[ast.AST, str] | None:
    """The first of TT126's three findings that holds for ``step`` in ``loop``: gradients never
    zeroed, zeroed between backward() and step(), or zeroed every micro-batch of an accumulation."""
    if not hooked and not _zeroed_in(f, loop, opt):
        return step, (f"`{ast.unparse(step)}` in a loop that never zeroes the gradients: backward() keeps adding "
                      f"into .grad, so every step applies the sum of all gradients so far; call "
                      f"{ast.unparse(opt)}.zero_grad() once per step")
    zeros = _zero_grads_of(f, loop, opt)
    misplaced = _zeroed_before_step(f, zeros, step, backwards)
    return misplaced or _zeroed_every_micro_batch(f, loop, zeros, step, backwards)


def _zero_grads_of(f: FileAnalysis, loop: ast.AST, opt: ast.AST) -> list[ast.Call]:
    """The ``x.zero_grad()`` calls in ``loop``'s frame that clear ``opt``'s gradients, in order."""
    return sorted((n for n in walk_local(loop) if _is_method_call(n, "zero_grad") and _same_optimizer(f, n, opt)),
                  key=pos)


def _zeroed_before_step(f: FileAnalysis, zeros: list[ast.Call], step: ast.Call,
                        backwards: list[ast.Call]) -> tuple[ast.AST, str] | None:
    """A ``zero_grad()`` that runs after the backward and before ``step``, with no backward between."""
    for zero in zeros:
        if pos(zero) < pos(step) and _erases_before_step(f, zero, step, backwards):
            return zero, (f"`{ast.unparse(zero)}` between backward() and `{ast.unparse(step)}` erases the "
                          f"gradients before the step applies them: zero them before backward() or after "
                          f"the step")
    return None


def _erases_before_step(f: FileAnalysis, zero: ast.Call, step: ast.Call, backwards: list[ast.Call]) -> bool:
    """``zero`` follows a backward (in the same branch), no backward comes between it and ``step``, and
    running it goes on to ``step``."""
    before = any(pos(b) < pos(zero) and not exclusive_branches(f, b, zero) for b in backwards)
    between = any(pos(zero) < pos(b) < pos(step) for b in backwards)
    return before and not between and _reaches(f, zero, step)


def _zeroed_every_micro_batch(f: FileAnalysis, loop: ast.AST, zeros: list[ast.Call], step: ast.Call,
                              backwards: list[ast.Call]) -> tuple[ast.AST, str] | None:
    """Under gradient accumulation (``step`` inside ``if i % k == 0:``), a ``zero_grad()`` outside
    that ``if`` that runs every iteration, while backward runs every iteration too."""
    accumulation = _accumulation_if(f, step, loop)
    if accumulation is None or not _accumulates(f, loop, step, backwards, accumulation):
        return None
    zero = _zeroed_every_iteration(f, zeros, loop, accumulation)
    if zero is None:
        return None
    return zero, (f"`{ast.unparse(zero)}` runs every micro-batch while `{ast.unparse(step)}` runs "
                  f"only under `if {ast.unparse(accumulation.test)}:`: the accumulated gradients "
                  f"are erased and each step sees one micro-batch; zero them inside the `if`, "
                  f"after the step")


def _accumulation_if(f: FileAnalysis, step: ast.Call, loop: ast.AST) -> ast.If | None:
    """The ``if i % k == 0:`` that ``step`` runs under in ``loop``; None without one, or where it
    has an else (alternating updates: the else steps something else) or runs a backward itself."""
    accumulation = _modulo_if(f, step, loop)
    if accumulation is None or accumulation.orelse or any(is_backward(n) for n in ast.walk(accumulation)):
        return None
    return accumulation


def _accumulates(f: FileAnalysis, loop: ast.AST, step: ast.Call, backwards: list[ast.Call],
                 accumulation: ast.If) -> bool:
    """Gradients add up over the iterations that ``accumulation`` skips: some backward runs outside it,
    and no other optimizer steps every iteration (then updates alternate, they do not accumulate)."""
    return not _other_step_every_iteration(f, loop, step, accumulation) and not all(
        _inside(f, b, accumulation) for b in backwards)


def _zeroed_every_iteration(f: FileAnalysis, zeros: list[ast.Call], loop: ast.AST,
                            accumulation: ast.If) -> ast.Call | None:
    """The first of ``zeros`` that runs on every iteration of ``loop``: unguarded, outside ``accumulation``."""
    return next((z for z in zeros if not _guarded(f, z, loop) and not _inside(f, z, accumulation)), None)


def _other_step_every_iteration(f: FileAnalysis, loop: ast.AST, step: ast.Call, accumulation: ast.If) -> bool:
    """Some optimizer other than ``step``'s steps in ``loop`` outside the accumulation ``if``."""
    return any(n is not step and _is_optimizer_step(f, n) and not _inside(f, n, accumulation)
               for n in walk_local(loop))


def _inside(f: FileAnalysis, node: ast.AST, outer: ast.AST) -> bool:
    return any(a is outer for a in f.ancestors(node))


# --------------------------------------------------------------------------- GradScaler and clipping


def _scaler_calls(f: FileAnalysis, node: ast.AST) -> list[ast.Call]:
    """The ``GradScaler(...)`` constructions of this file assigned to the name ``node`` ends with
    (``scaler``, ``self.scaler``, a parameter called like a scaler the file builds)."""
    if "scalers" not in f.memo:
        f.memo["scalers"] = _scalers_by_name(f)
    spelled = dotted(node)
    return f.memo["scalers"].get(spelled.rsplit(".", 1)[-1], []) if spelled is not None else []


def _scalers_by_name(f: FileAnalysis) -> dict[str, list[ast.Call]]:
    """The ``GradScaler(...)`` constructions of this file by the last part of the name they are assigned to."""
    table: dict[str, list[ast.Call]] = {}
    for assign in f.nodes[ast.Assign] + f.nodes[ast.AnnAssign]:
        made = _grad_scalers_in(f, assign.value)
        if made:
            for name in _target_names(assign):
                table.setdefault(name, []).extend(made)
    return table


def _grad_scalers_in(f: FileAnalysis, value: ast.AST | None) -> list[ast.Call]:
    if value is None:
        return []
    return [n for n in ast.walk(value) if isinstance(n, ast.Call) and _is_grad_scaler(f.qualname(n.func))]


def _is_grad_scaler(q: str | None) -> bool:
    """``torch.amp.GradScaler``, ``torch.cuda.amp.GradScaler`` ..."""
    return q is not None and q.startswith("torch.") and q.endswith("GradScaler")


def _target_names(assign: ast.Assign | ast.AnnAssign) -> list[str]:
    """The last part of each name ``assign`` binds: ``scaler`` for ``self.scaler = ...``."""
    targets = assign.targets if isinstance(assign, ast.Assign) else [assign.target]
    spelled = [dotted(t) for t in targets]
    return [s.rsplit(".", 1)[-1] for s in spelled if s is not None]


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
            clip_name = _clip_name(f, clip)
            message = _clipped_while_scaled(f, clip, clip_name) if clip_name is not None else None
            if message is not None:
                yield clip, message


def _clip_name(f: FileAnalysis, call: ast.Call) -> str | None:
    """``clip_grad_norm_`` for a call of ``torch.nn.utils.clip_grad_norm_`` (or another clipping function)."""
    q = f.qualname(call.func) or ""
    name = q.rsplit(".", 1)[-1]
    return name if q.startswith("torch.nn.utils.") and name in _CLIPS else None


def _clipped_while_scaled(f: FileAnalysis, clip: ast.Call, clip_name: str) -> str | None:
    """TT127's message if ``clip`` runs after a ``scaler.scale(loss).backward()`` and before that
    scaler's ``step()``, with no ``unscale_`` between the backward and the clip."""
    calls = _calls_alongside(f, clip)
    backward = _last_scaled_backward(f, calls, clip)
    if backward is None:
        return None
    scaler = _scale_call(f, backward.func.value).func.value
    if not _scaler_enabled(f, scaler):
        return None
    step = _next_step(calls, scaler, clip)
    if step is None or _unscaled_between(calls, scaler, backward, clip):
        return None
    return _unscale_first_message(clip_name, scaler, step)


def _calls_alongside(f: FileAnalysis, node: ast.AST) -> list[ast.Call]:
    """The calls of ``node``'s function that can run in the same pass (not in a branch exclusive with it)."""
    return [c for c in f.calls_in(f.function_scope(node)) if not exclusive_branches(f, c, node)]


def _last_scaled_backward(f: FileAnalysis, calls: list[ast.Call], before: ast.AST) -> ast.Call | None:
    """The last ``scaler.scale(loss).backward()`` among ``calls`` before ``before``."""
    scaled = [c for c in calls if pos(c) < pos(before) and _is_scaled_backward(f, c)]
    return scaled[-1] if scaled else None


def _is_scaled_backward(f: FileAnalysis, call: ast.Call) -> bool:
    """``scaler.scale(loss).backward()``, for a scaler this file builds."""
    return is_backward(call) and _scale_call(f, call.func.value) is not None


def _scale_call(f: FileAnalysis, node: ast.AST) -> ast.Call | None:
    """``scaler.scale(loss)`` (the receiver of a ``.backward()``), for a scaler this file builds."""
    if _is_method_call(node, "scale") and _scaler_calls(f, node.func.value):
        return node
    return None


def _scaler_enabled(f: FileAnalysis, scaler: ast.AST) -> bool:
    """The file builds ``scaler``, and not only with ``enabled=False``."""
    made = _scaler_calls(f, scaler)
    return bool(made) and not all(_disabled(c) for c in made)


def _next_step(calls: list[ast.Call], scaler: ast.AST, clip: ast.Call) -> ast.Call | None:
    """The first ``scaler.step(...)`` among ``calls`` after ``clip``."""
    return next((c for c in _method_calls(calls, scaler, "step") if pos(c) > pos(clip)), None)


def _unscaled_between(calls: list[ast.Call], scaler: ast.AST, backward: ast.Call, clip: ast.Call) -> bool:
    """Some ``scaler.unscale_(...)`` among ``calls`` between ``backward`` and ``clip``."""
    return any(pos(backward) < pos(c) < pos(clip) for c in _method_calls(calls, scaler, "unscale_"))


def _method_calls(calls: list[ast.Call], receiver: ast.AST, method: str) -> list[ast.Call]:
    """The calls of ``receiver.method(...)`` among ``calls``, in their order."""
    same = ast.dump(receiver)
    return [c for c in calls if _is_method_call(c, method) and ast.dump(c.func.value) == same]


def _unscale_first_message(clip_name: str, scaler: ast.AST, step: ast.Call) -> str:
    s = ast.unparse(scaler)
    opt = ast.unparse(step.args[0]) if step.args else "optimizer"
    return (f"`{clip_name}` between `{s}.scale(...).backward()` and `{s}.step()` without "
            f"`{s}.unscale_({opt})` first: the threshold applies to gradients multiplied by the "
            f"loss scale; call {s}.unscale_({opt}) before clipping")


# --------------------------------------------------------------------------- host syncs


_SYNC_METHODS = frozenset({"item", "cpu", "numpy", "tolist"})
_LOGGING_WORDS = ("log", "print", "verbose", "debug", "display", "interval", "freq", "every")


def _device_value(f: FileAnalysis, node: ast.AST, losses: set[str], depth: int = 0) -> bool:
    """``node`` holds a result of the step's device work: the loss a ``.backward()`` of the loop is
    called on, a loss function's or a module's output (or a part of one), or an expression of those."""
    node = _strip_views(node)
    if _step_result(f, node, losses):
        return True
    return depth < 3 and any(_device_value(f, part, losses, depth + 1) for part in _value_sources(f, node))


def _step_result(f: FileAnalysis, node: ast.AST, losses: set[str]) -> bool:
    """``node`` is itself one of ``losses`` or the output of a model or a loss function."""
    if isinstance(node, ast.Name):
        return node.id in losses
    return _module_output(f, node) or _model_output_by_name(f, node)


_VIEW_METHODS = ("detach", "mean", "sum", "float", "argmax", "max", "eq", "view", "clone")


def _strip_views(node: ast.AST) -> ast.AST:
    """What ``node`` is a part or a reduction of: ``loss`` for ``loss.detach().mean()``, ``out[0]``."""
    while isinstance(node, (ast.Subscript, ast.Attribute)) or _is_method_call(node, *_VIEW_METHODS):
        node = node.func.value if isinstance(node, ast.Call) else node.value
    return node


def _module_output(f: FileAnalysis, node: ast.AST) -> bool:
    """A call of a module, a loss function or a ``torch.nn.functional`` function giving a tensor."""
    return _tensor_call(f, node) and _calls_model_or_loss(f, node)


def _tensor_call(f: FileAnalysis, node: ast.AST) -> bool:
    """A call giving a tensor (a loss, or a tensor of no particular sort)."""
    k = f.kind(node)
    return k is not None and k.cat == "tensor" and k.detail in ("loss", None) and isinstance(node, ast.Call)


def _calls_model_or_loss(f: FileAnalysis, call: ast.Call) -> bool:
    fk = f.kind(call.func)
    if _is_model_kind(f, fk) or (fk is not None and fk.cat == "lossfn"):
        return True
    return (f.qualname(call.func) or "").startswith("torch.nn.functional.")


def _model_output_by_name(f: FileAnalysis, node: ast.AST) -> bool:
    """The output of a model passed in: a call of an unknown name that says model / net / encoder."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and f.kind(node.func) is None and bool(
        re.search(r"model|net|encoder|decoder", node.func.id, re.IGNORECASE))


def _value_sources(f: FileAnalysis, node: ast.AST) -> list[ast.AST]:
    """The expressions ``node``'s value comes from: a name's assigned value (or the call it is
    unpacked from, ``out, aux = model(x)``), both sides of an arithmetic expression."""
    if isinstance(node, ast.Name):
        return _name_sources(f, node)
    if isinstance(node, ast.BinOp):
        return [node.left, node.right]
    return []


def _name_sources(f: FileAnalysis, name: ast.Name) -> list[ast.AST]:
    value = f.binding_value(name)
    if value is not None:
        return [value]
    b = f.lookup(name)
    return [b[2]] if _unpacked_from_call(b) else []


def _unpacked_from_call(b: tuple | None) -> bool:
    """The binding ``b`` is a part of a call's result: ``out`` in ``out, aux = model(x)``."""
    return b is not None and b[1] == "value" and bool(b[3]) and isinstance(b[2], ast.Call)


def _loss_names(node: ast.AST) -> set[str]:
    """The names a backward is called on: ``loss`` in ``loss.backward()``, ``(loss / k).backward()``,
    ``scaler.scale(loss).backward()``, ``loss.mean().backward()``."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.BinOp):
        return _loss_names(node.left) | _loss_names(node.right)
    inner = _wrapped_loss(node)
    return _loss_names(inner) if inner is not None else set()


def _wrapped_loss(node: ast.AST) -> ast.AST | None:
    """``loss`` for ``scaler.scale(loss)``, ``loss.sum()``, ``loss.mean()``, ``loss.float()``."""
    if _is_method_call(node, "scale") and node.args:
        return node.args[0]
    if _is_method_call(node, "sum", "mean", "float"):
        return node.func.value
    return None


def _backward_names(f: FileAnalysis, loop: ast.AST) -> set[str] | None:
    """None if ``loop`` runs no backward in its own body (not counting nested loops); else the names
    of what it backpropagates. A function of the file that the loop calls with the loss and that runs
    the backward itself (timm's ``_backward(loss)``) counts, its arguments being the loss."""
    names, found = set(), False
    for node in walk_local(loop, into_loops=False):
        if is_backward(node):
            found = True
            names |= _loss_names(node.func.value)
        elif _calls_backward_helper(f, node):
            found = True
            names |= _name_args(node)
    return names if found else None


def _name_args(call: ast.Call) -> set[str]:
    """The names passed positionally to ``call``."""
    return {a.id for a in call.args if isinstance(a, ast.Name)}


def _calls_backward_helper(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` calls by name a function of this file that runs a ``.backward()`` itself."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    b = f.lookup(node.func)
    return _defines_function(b) and any(is_backward(n) for n in walk_local(b[2]))


def _quiet_guard(f: FileAnalysis, node: ast.AST, loop: ast.AST) -> bool:
    """``node`` does not run every step: under a rate-limiting ``if`` (``step % n == 0``, a logging
    switch) inside ``loop``."""
    return any(_skips_steps(f, anc, node) for anc in ancestors_until(f, node, loop))


def _skips_steps(f: FileAnalysis, anc: ast.AST, node: ast.AST) -> bool:
    """The ancestor ``anc`` of ``node`` runs it only on some steps: a rate-limiting ``if``, an
    ``except``, or the body of a NaN / divergence guard (it runs when training is about to stop)."""
    if isinstance(anc, ast.ExceptHandler) or _in_guard_body(f, anc, node):
        return True
    return isinstance(anc, (ast.If, ast.IfExp)) and (rate_limited(anc.test) or _mentions_logging(anc.test))


def _in_guard_body(f: FileAnalysis, anc: ast.AST, node: ast.AST) -> bool:
    """``node`` is in the body (not the test) of ``anc``, an ``if`` whose test checks a value on the host."""
    return isinstance(anc, ast.If) and node not in ast.walk(anc.test) and _guard_test(f, anc.test)


def _mentions_logging(test: ast.AST) -> bool:
    """A name in ``test`` that says logging: ``log_interval``, ``args.verbose``, ``print_freq``."""
    return any(word in (dotted(n) or "").lower() for n in ast.walk(test)
               if isinstance(n, (ast.Name, ast.Attribute)) for word in _LOGGING_WORDS)


def _after_synchronize(f: FileAnalysis, node: ast.AST) -> bool:
    """The statement reading ``node`` comes right after an explicit ``torch.cuda.synchronize()`` (or a
    stream's / event's ``.synchronize()``) in the same block: the device is idle, the read waits for
    nothing, and the sync is a deliberate choice (timing a step for the logger)."""
    found = _enclosing_block(f, node)
    if found is None:
        return False
    block, stmt = found
    i = block.index(stmt)
    return i > 0 and _synchronizes(f, block[i - 1])


def _synchronizes(f: FileAnalysis, stmt: ast.stmt) -> bool:
    """``stmt`` is a call of ``torch.cuda.synchronize()`` (or another sync function) or of a ``.synchronize()``."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return isinstance(call, ast.Call) and (f.qualname(call.func) in SYNC_FUNCS or _is_method_call(call, "synchronize"))


_GUARD_FUNCS = frozenset({"math.isfinite", "math.isnan", "math.isinf", "torch.isfinite", "torch.isnan", "torch.isinf"})


def _guard_test(f: FileAnalysis, test: ast.AST) -> bool:
    """``test`` checks a value already brought to the host (``loss.item()``, ``math.isfinite(...)``):
    the sync is paid by the test, and its body runs only when the check trips."""
    return any(isinstance(n, ast.Call) and (f.qualname(n.func) in _GUARD_FUNCS or _is_method_call(
        n, "item", "isfinite", "isnan", "isinf")) for n in ast.walk(test))


def _control_flow(f: FileAnalysis, call: ast.AST, loop: ast.AST) -> bool:
    """The synced value decides what the loop does this step (a NaN guard, early stopping): used in
    an ``if``/``while`` test or an ``assert``, directly or through the name it is assigned to."""
    return _tested(f, call, loop) or _tested_by_name(f, call, loop)


def _tested(f: FileAnalysis, call: ast.AST, loop: ast.AST) -> bool:
    """``call`` is part of the test of an ``if`` / ``while`` / ``assert`` in ``loop``."""
    return any(isinstance(anc, (ast.If, ast.While, ast.Assert, ast.IfExp)) and _contains(anc.test, call)
               for anc in ancestors_until(f, call, loop))


def _tested_by_name(f: FileAnalysis, call: ast.AST, loop: ast.AST) -> bool:
    """``call`` is assigned to a name (through arithmetic and calls) that a later ``if`` / ``while`` /
    ``assert`` of ``loop`` tests."""
    assign = _assignment_of(f, call)
    if assign is None:
        return False
    name = assign.targets[0].id
    return any(isinstance(node, (ast.If, ast.While, ast.Assert)) and pos(node) > pos(assign)
               and _mentions_name(node.test, name) for node in walk_local(loop))


def _assignment_of(f: FileAnalysis, call: ast.AST) -> ast.Assign | None:
    """The ``name = ...`` whose value ``call`` is a part of, through arithmetic and calls."""
    parent = f.parent.get(call)
    while isinstance(parent, (ast.BinOp, ast.UnaryOp, ast.Call)):
        parent = f.parent.get(parent)
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name):
        return parent
    return None


def _mentions_name(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(tree))


def _uses_accelerator(f: FileAnalysis) -> bool:
    """The file moves work to an asynchronous device: CUDA, or ``torch.accelerator`` / MPS / XPU."""
    return f.mentions_cuda or _calls_accelerator_api(f) or _names_accelerator_device(f)


def _calls_accelerator_api(f: FileAnalysis) -> bool:
    return any((f.qualname(n) or "").startswith(("torch.accelerator.", "torch.mps.", "torch.xpu."))
               for n in f.nodes[ast.Attribute])


def _names_accelerator_device(f: FileAnalysis) -> bool:
    """A string naming an MPS or XPU device: ``"mps"``, ``"xpu:0"``."""
    return any(isinstance(n.value, str) and n.value.split(":", 1)[0] in ("mps", "xpu") for n in f.nodes[ast.Constant])


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

    tier = "hygiene"
    tier_why = ("a loop that already waits for the GPU every step elsewhere (a print of the loss, a GradScaler's "
                "step) or a tiny demo loses little to one more read (5 of 12 findings on the real-code set were such): reported by default only where the read is the step's only host sync and feeds "
                "nothing but a running sum or meter (read every N steps anyway)")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        if not _uses_accelerator(f):
            return
        for loop in _loops(f):
            found = _first_host_sync(f, loop)
            if found is not None:
                yield found, (f"`{ast.unparse(found)}` every training step waits for the GPU (a host sync per "
                              f"step): accumulate on the device and read it every N steps")

    def matters(self, f: FileAnalysis, node: ast.AST) -> bool:
        loop = next((a for a in f.local_ancestors(node) if isinstance(a, LOOPS) and _first_host_sync(f, a) is node),
                    None)
        return loop is not None and _only_sync_into_a_sum(f, node, loop)


def _only_sync_into_a_sum(f: FileAnalysis, node: ast.AST, loop: ast.AST) -> bool:
    """``node`` is the only per-step host sync of ``loop`` (no other read of a device result, no GradScaler step,
    which reads its inf check every step), and its value only goes into a running sum or a meter."""
    losses = _backward_names(f, loop) or set()
    syncs = [n for n in walk_local(loop, into_loops=False) if _syncs_every_step(f, n, loop, losses)]
    if len(syncs) != 1 or any(_scaler_step(c) for c in walk_local(loop, into_loops=False)):
        return False
    return _feeds_a_sum(f, node)


def _scaler_step(node: ast.AST) -> bool:
    """``<something>scaler.step(...)``: a GradScaler's step, which syncs to read its inf check."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"
            and "scaler" in ast.unparse(node.func.value).lower())


def _feeds_a_sum(f: FileAnalysis, node: ast.AST) -> bool:
    """``total += x.item()`` (times a number), ``meter.update(x.item(), n)`` or ``values.append(x.item())``."""
    child, parent = node, f.parent.get(node)
    while isinstance(parent, ast.BinOp):  # loss.item() * accum_steps
        child, parent = parent, f.parent.get(parent)
    if isinstance(parent, ast.AugAssign):
        return parent.value is child
    return (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
            and parent.func.attr in ("update", "append") and child in parent.args)


def _loops(f: FileAnalysis) -> Iterator[ast.AST]:
    return (n for t in LOOPS for n in f.nodes[t])


def _first_host_sync(f: FileAnalysis, loop: ast.AST) -> ast.Call | None:
    """The earliest call in ``loop``'s own body that reads a device result on the host every step
    (not rate-limited, not deciding control flow, not right after an explicit synchronize), where the
    loop runs a backward."""
    losses = _backward_names(f, loop)
    if losses is None:
        return None
    syncs = [node for node in walk_local(loop, into_loops=False) if _syncs_every_step(f, node, loop, losses)]
    return min(syncs, key=pos, default=None)


def _syncs_every_step(f: FileAnalysis, node: ast.AST, loop: ast.AST, losses: set[str]) -> bool:
    """``node`` brings a result of the step's device work to the host, and runs every step of ``loop``."""
    value = _synced_value(f, node) if isinstance(node, ast.Call) else None
    if value is None or not _reads_device_result(f, value, losses):
        return False
    return not (_quiet_guard(f, node, loop) or _control_flow(f, node, loop) or _after_synchronize(f, node))


def _reads_device_result(f: FileAnalysis, value: ast.AST, losses: set[str]) -> bool:
    return _category(f, value) in (None, "tensor") and _device_value(f, value, losses)


def _synced_value(f: FileAnalysis, call: ast.Call) -> ast.AST | None:
    """What ``call`` brings to the host: ``x`` of ``x.item()`` / ``x.cpu()`` / ... or ``float(x)``."""
    if _is_method_call(call, *_SYNC_METHODS) and not call.args:
        return call.func.value
    if _is_builtin_float(f, call):
        return call.args[0]
    return None


def _is_builtin_float(f: FileAnalysis, call: ast.Call) -> bool:
    """``float(x)`` with the builtin ``float``."""
    func = call.func
    return isinstance(func, ast.Name) and func.id == "float" and len(call.args) == 1 and f.lookup(func) is None
