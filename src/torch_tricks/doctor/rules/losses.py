"""Rules about losses and their numerics: activations paired with the wrong loss
(log_softmax into cross-entropy, sigmoid into BCELoss, an activation applied twice), the
legacy ``size_average``/``reduce`` arguments, and a square root whose gradient is NaN at zero.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import ACTS, FileAnalysis, called_method, is_false, is_loss, kwarg, number
from torch_tricks.doctor.registry import StaticRule, static_rule


@static_rule
class SqrtOfSumOfSquares(StaticRule):
    id = "TT105"
    name = "sqrt-of-sum-of-squares"
    severity = "warning"
    source = "X (sqrt of a sum of squares); seeds/003 Pytorch 使用陷阱 §7 (torch.sqrt()在0处的左导数没有定义)"
    message = "sqrt of a sum of squares has a NaN gradient at zero: use torch.linalg.vector_norm, or add an eps"
    explanation = ("The derivative of sqrt(s) is 1/(2*sqrt(s)), infinite at s = 0, and the chain rule multiplies it "
                   "by ds/dx = 2x = 0: the gradient is inf*0 = NaN, which then spreads to every weight. It happens "
                   "whenever the vector is exactly zero (identical points, padding, a zero residual). Fix: "
                   "torch.linalg.vector_norm(x, dim=...) (or x.norm()), whose gradient at 0 is defined as 0, or "
                   "torch.sqrt(s + eps).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for node, arg, torch_op in _square_roots(f):
            if _root_of_squares_with_gradient(f, arg, torch_op) and _differentiated(f, node):
                yield node, self.message


def _root_of_squares_with_gradient(f: FileAnalysis, arg: ast.AST, torch_op: bool) -> bool:
    """``arg``, taken the square root of, is a sum of squares of a tensor a gradient flows through."""
    if not _sum_of_squares(f, arg) or _detached(f, arg) or _constant_tensor(f, arg):
        return False
    # `** 0.5` also works on floats and numpy arrays: ask for a tensor
    return torch_op or _on_tensor(f, arg)


def _differentiated(f: FileAnalysis, node: ast.AST) -> bool:
    """The square root ``node`` is not read as a number right away (a metric), nor computed under no_grad."""
    return not _taken_as_number(f, node) and not f.no_grad(node)


def _square_roots(f: FileAnalysis) -> list[tuple[ast.AST, ast.AST, bool]]:
    """(the square root, what it is taken of, whether it is a torch operation) for ``torch.sqrt(x)``,
    ``torch.pow(x, 0.5)``, ``x.sqrt()``, ``x.pow(0.5)`` and ``x ** 0.5``."""
    candidates = []
    for call in f.nodes[ast.Call]:
        taken = _square_root_call(f, call)
        if taken is not None:
            candidates.append((call, *taken))
    return candidates + [(binop, binop.left, False) for binop in _half_powers(f)]


def _half_powers(f: FileAnalysis) -> list[ast.BinOp]:
    """The ``x ** 0.5`` of the file."""
    return [b for b in f.nodes[ast.BinOp] if isinstance(b.op, ast.Pow) and number(b.right) == 0.5]


def _square_root_call(f: FileAnalysis, call: ast.Call) -> tuple[ast.AST, bool] | None:
    """(what ``call`` takes the square root of, whether it is a torch operation) for
    ``torch.sqrt(x)``, ``torch.pow(x, 0.5)``, ``x.sqrt()``, ``x.pow(0.5)``; None for other calls."""
    q = f.qualname(call.func)
    method = _method_of(q, call)
    if method is not None:
        return _square_root_method(call, method)
    return _square_root_function(call, q)


def _square_root_function(call: ast.Call, q: str | None) -> tuple[ast.AST, bool] | None:
    """As :func:`_square_root_call`, for ``torch.sqrt(x)`` and ``torch.pow(x, 0.5)``."""
    if q == "torch.sqrt" and len(call.args) == 1:
        return call.args[0], True
    if q == "torch.pow" and len(call.args) == 2 and number(call.args[1]) == 0.5:
        return call.args[0], True
    return None


def _square_root_method(call: ast.Call, method: str) -> tuple[ast.AST, bool] | None:
    """As :func:`_square_root_call`, for ``x.sqrt()`` and ``x.pow(0.5)``."""
    if method == "sqrt" and not call.args and not call.keywords:
        return call.func.value, True
    if method == "pow" and len(call.args) == 1 and number(call.args[0]) == 0.5:
        return call.func.value, False
    return None


def _method_of(q: str | None, call: ast.Call) -> str | None:
    """The name of the method ``call`` calls (``x.sum()``: "sum"), ``q`` its qualified name; None for
    a function of an import or a plain name."""
    return called_method(call) if q is None else None


def _on_tensor(f: FileAnalysis, arg: ast.AST) -> bool:
    """``arg`` (or the receiver of the method call it is) is known to be a tensor."""
    base = arg.func.value if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) else arg
    k = f.kind(base)
    return k is not None and k.cat == "tensor"


def _taken_as_number(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` is read as a Python number right away: ``.item()``, ``.tolist()``, ``float(...)``."""
    parent = f.parent.get(node)
    return (isinstance(parent, ast.Attribute) and parent.attr in ("item", "tolist")) or _is_float_call(parent)


def _is_float_call(node: ast.AST | None) -> bool:
    """``node`` is ``float(...)``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float"


def _followed(f: FileAnalysis, node: ast.Name, depth: int) -> ast.AST | None:
    """The value assigned to ``node``, followed through four assignments at most."""
    return f.binding_value(node) if depth < 4 else None


def _sum_of_squares(f: FileAnalysis, e: ast.AST, depth: int = 0) -> bool:
    """``e`` is ``(x ** 2).sum()``, ``torch.mean(x * x)``, ``a ** 2 + b ** 2`` (or a name assigned one)."""
    if isinstance(e, ast.Name):
        value = _followed(f, e, depth)
        return value is not None and _sum_of_squares(f, value, depth + 1)
    if isinstance(e, ast.Call):
        return _reduced_square(f, e, depth)
    if _is_addition(e):
        return all(_square(f, t, depth) for t in _added_terms(e))
    return False


def _reduced_square(f: FileAnalysis, e: ast.Call, depth: int) -> bool:
    """``e`` is the sum or mean of a square: ``torch.sum(x ** 2)``, ``(x * x).mean()``."""
    q = f.qualname(e.func)
    if q in ("torch.sum", "torch.mean", "torch.nansum") and e.args:
        return _square(f, e.args[0], depth)
    if _method_of(q, e) in ("sum", "mean", "nansum"):
        return _square(f, e.func.value, depth)
    return False


def _added_terms(e: ast.BinOp) -> list[ast.AST]:
    """The terms of a chain of ``+`` (in no particular order)."""
    terms, stack = [], [e]
    while stack:
        t = stack.pop()
        if _is_addition(t):
            stack += [t.left, t.right]
        else:
            terms.append(t)
    return terms


def _is_addition(e: ast.AST) -> bool:
    return isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add)


def _square(f: FileAnalysis, e: ast.AST, depth: int = 0) -> bool:
    """``e`` is ``x ** 2``, ``x * x``, ``torch.pow(x, 2)``, ``torch.square(x)``, ``x.pow(2)``,
    ``x.square()`` (or a name assigned one)."""
    if isinstance(e, ast.Name):
        value = _followed(f, e, depth)
        return value is not None and _square(f, value, depth + 1)
    if isinstance(e, ast.BinOp):
        return _square_operation(e)
    return isinstance(e, ast.Call) and _square_call(f, e)


def _square_operation(e: ast.BinOp) -> bool:
    """``x ** 2`` or ``x * x``."""
    if isinstance(e.op, ast.Pow):
        return number(e.right) == 2
    if isinstance(e.op, ast.Mult):
        return ast.dump(e.left) == ast.dump(e.right)
    return False


def _square_call(f: FileAnalysis, e: ast.Call) -> bool:
    q = f.qualname(e.func)
    if q == "torch.pow" and len(e.args) == 2:
        return number(e.args[1]) == 2
    if q == "torch.square":
        return True
    return _square_method(e, _method_of(q, e))


def _square_method(e: ast.Call, method: str | None) -> bool:
    """``x.pow(2)`` or ``x.square()`` (``method``: the method ``e`` calls)."""
    if method == "pow" and len(e.args) == 1:
        return number(e.args[0]) == 2
    return method == "square" and not e.args


_CONSTANT_MAKERS = frozenset(f"torch.{n}" for n in (
    "arange linspace logspace meshgrid zeros ones full eye tensor as_tensor from_numpy zeros_like ones_like "
    "full_like empty").split())


def _constant_tensor(f: FileAnalysis, expr: ast.AST, depth: int = 0) -> bool:
    """``expr`` is built only from numbers and tensor constructors (``torch.arange`` grids and the like,
    without ``requires_grad=True``), through operators and methods of such values: no gradient flows
    through it, so a sqrt at zero cannot give a NaN gradient (a distance grid, as in timm's convit)."""
    if depth > 6:  # variables followed back through six assignments at most
        return False
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, (int, float))
    if isinstance(expr, ast.Name):
        value = f.binding_value(expr)
        return value is not None and _constant_tensor(f, value, depth + 1)
    if isinstance(expr, ast.Call):
        return _constant_call(f, expr, depth)
    return _constant_operation(f, expr, depth)


def _constant_operation(f: FileAnalysis, expr: ast.AST, depth: int) -> bool:
    """:func:`_constant_tensor` for an operator applied to constants, or an index into one."""
    if isinstance(expr, ast.BinOp):
        return _constant_tensor(f, expr.left, depth) and _constant_tensor(f, expr.right, depth)
    if isinstance(expr, ast.UnaryOp):
        return _constant_tensor(f, expr.operand, depth)
    if isinstance(expr, ast.Subscript):
        return _constant_tensor(f, expr.value, depth)
    return False


def _constant_call(f: FileAnalysis, expr: ast.Call, depth: int) -> bool:
    """:func:`_constant_tensor` for a call: a tensor constructor, or a method of a constant with
    constant arguments."""
    if _asks_for_grad(expr):
        return False
    q = f.qualname(expr.func)
    if q in _CONSTANT_MAKERS:
        return True
    method = _method_of(q, expr)
    return method is not None and _constant_method_call(f, expr, method, depth)


def _asks_for_grad(call: ast.Call) -> bool:
    """``call`` passes ``requires_grad=`` with a value other than False."""
    return any(kw.arg == "requires_grad" and not is_false(kw.value) for kw in call.keywords)


def _constant_method_call(f: FileAnalysis, expr: ast.Call, method: str, depth: int) -> bool:
    """``expr`` calls ``method`` of a constant, with constant arguments."""
    args = list(expr.args) + [kw.value for kw in expr.keywords]
    shape_only = method in _SHAPE_METHODS  # sizes and dims: any argument that is not a tensor

    def fine(a: ast.AST) -> bool:
        if _constant_tensor(f, a, depth) or _harmless_arg(a):
            return True
        k = f.kind(a)
        return shape_only and (k is None or k.cat != "tensor")
    return _constant_tensor(f, expr.func.value, depth) and all(fine(a) for a in args)


_SHAPE_METHODS = frozenset("""view reshape repeat repeat_interleave expand permute transpose flatten unsqueeze squeeze
    contiguous float double half to t""".split())


def _harmless_arg(node: ast.AST) -> bool:
    """A method argument that carries no tensor: a dtype, a memory format, a string, a tuple of numbers."""
    if isinstance(node, ast.Constant):
        return True
    if _is_torch_attribute(node):
        return True  # torch.float32, torch.channels_last ...
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_harmless_arg(e) for e in node.elts)
    return _is_constant_name(node)


def _is_constant_name(node: ast.AST) -> bool:
    """A NAME IN CAPITALS: a module constant, by convention."""
    return isinstance(node, ast.Name) and node.id.isupper()


def _is_torch_attribute(node: ast.AST) -> bool:
    """``torch.<name>``."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"


def _detached(f: FileAnalysis, expr: ast.AST, depth: int = 0) -> bool:
    """``expr`` is computed from ``.detach()``/``.data``/numpy values: no gradient flows
    through it (also through the variables it reads, two assignments deep)."""
    return any(_detaches(f, n, depth) for n in ast.walk(expr))


def _detaches(f: FileAnalysis, n: ast.AST, depth: int) -> bool:
    """``n`` is ``.detach``/``.data``/``.numpy``/``.item``, or a variable assigned a detached value."""
    if isinstance(n, ast.Attribute):
        return n.attr in ("detach", "data", "numpy", "item")
    if isinstance(n, ast.Name) and depth < 2:
        value = f.binding_value(n)
        return value is not None and _detached(f, value, depth + 1)
    return False


def _activation_losses(f: FileAnalysis) -> list[tuple[ast.Call, str, str]]:
    """(loss call, loss type, activation of its input) for every cross-entropy / NLL / BCE call
    whose input is known to be a softmax, log_softmax or sigmoid output."""
    if "act_losses" in f.memo:
        return f.memo["act_losses"]
    out = []
    for call in f.nodes[ast.Call]:
        loss = _ACTIVATION_LOSSES.get(_loss_called(f, call))
        if loss is None:
            continue
        act = _input_activation(f, call)
        if act is not None:
            out.append((call, loss, act))
    f.memo["act_losses"] = out
    return out


_ACTIVATION_LOSSES = {"torch.nn.functional.cross_entropy": "ce", "torch.nn.CrossEntropyLoss": "ce",
                      "torch.nn.functional.binary_cross_entropy": "bce", "torch.nn.BCELoss": "bce",
                      "torch.nn.functional.binary_cross_entropy_with_logits": "bce_logits",
                      "torch.nn.BCEWithLogitsLoss": "bce_logits",
                      "torch.nn.functional.nll_loss": "nll", "torch.nn.NLLLoss": "nll"}


def _loss_called(f: FileAnalysis, call: ast.Call) -> str | None:
    """The qualified name of the function ``call`` calls, or of the loss object it calls."""
    q = f.qualname(call.func)
    if q is None:
        k = f.kind(call.func)
        q = k.detail if k is not None and k.cat == "lossfn" else None
    return q


def _input_activation(f: FileAnalysis, call: ast.Call) -> str | None:
    """The activation (softmax, log_softmax, sigmoid) whose output is the loss ``call``'s input."""
    k = f.kind(kwarg(call, "input", 0))
    if k is not None and k.cat == "tensor" and k.detail in ACTS:
        return k.detail
    return None


#: (loss, activation of its input) -> the finding of :class:`ActivationAppliedTwice`
_APPLIED_TWICE = {
    ("ce", "softmax"): "softmax output fed to cross-entropy, which applies log_softmax itself: pass the logits",
    ("bce_logits", "sigmoid"): ("sigmoid output fed to BCEWithLogitsLoss, which applies sigmoid itself: pass the "
                                "logits"),
    ("nll", "softmax"): ("softmax output fed to NLLLoss, which expects log-probabilities: use log_softmax, or "
                         "cross-entropy on the logits"),
}


@static_rule
class LogSoftmaxIntoCrossEntropy(StaticRule):
    id = "TT106"
    name = "log-softmax-into-cross-entropy"
    severity = "warning"
    source = ("X (log-softmax output fed to CrossEntropyLoss); seeds/003 网络结构可视化 §2 (a Net whose "
              "forward returns F.log_softmax)")
    message = "log_softmax output fed to cross-entropy, which applies log_softmax itself: use nll_loss, or pass the logits"
    explanation = ("nn.CrossEntropyLoss and F.cross_entropy take raw logits and apply log_softmax internally. Given "
                   "log-probabilities they apply it a second time: the value happens to be the same (log_softmax is "
                   "idempotent), but it costs an extra pass and contradicts what the model claims to output. Fix: "
                   "keep log_softmax and use nn.NLLLoss / F.nll_loss, or drop the log_softmax and keep "
                   "cross-entropy.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call, loss, act in _activation_losses(f):
            if loss == "ce" and act == "log_softmax":
                yield call, self.message


@static_rule
class ActivationAppliedTwice(StaticRule):
    id = "TT107"
    name = "activation-applied-twice"
    severity = "error"
    source = "X (log-softmax output fed to CrossEntropyLoss, and the other output/loss pairings)"
    message = "probabilities fed to a loss that expects logits (or log-probabilities): the activation is wrong"
    explanation = ("F.cross_entropy / nn.CrossEntropyLoss apply log_softmax to their input and "
                   "BCEWithLogitsLoss applies sigmoid. Fed probabilities (softmax or sigmoid output), they squash "
                   "them a second time: the loss can no longer approach 0, gradients shrink, and training is slow "
                   "or stalls, with no error. NLLLoss / F.nll_loss expect log-probabilities: fed softmax output, "
                   "they minimise -p instead of -log p, a different and much weaker objective, again with no "
                   "error. Fix: pass the logits (the output before softmax/sigmoid) to cross-entropy or "
                   "BCEWithLogitsLoss, or use log_softmax before NLLLoss; apply softmax/sigmoid only to make "
                   "predictions.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call, loss, act in _activation_losses(f):
            message = _APPLIED_TWICE.get((loss, act))
            if message is not None:
                yield call, message


@static_rule
class SigmoidIntoBceLoss(StaticRule):
    id = "TT108"
    name = "sigmoid-into-bce-loss"
    severity = "warning"
    source = "X (the other output/loss pairings); T1 (losses unsafe in float16)"
    message = "sigmoid output fed to BCELoss: use BCEWithLogitsLoss on the logits (stable, and allowed under autocast)"
    explanation = ("sigmoid followed by BCELoss computes log(sigmoid(x)), which saturates for large |x| (BCELoss "
                   "clamps the log at -100, so confidently wrong outputs get no gradient), and torch.autocast "
                   "refuses BCELoss in float16. BCEWithLogitsLoss fuses the two with the log-sum-exp trick. Fix: "
                   "drop the sigmoid from the output and use nn.BCEWithLogitsLoss / "
                   "F.binary_cross_entropy_with_logits; apply torch.sigmoid only to make predictions.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call, loss, act in _activation_losses(f):
            if loss == "bce" and act == "sigmoid":
                yield call, self.message


@static_rule
class LegacyLossReductionArgs(StaticRule):
    id = "TT109"
    name = "legacy-loss-reduction-args"
    severity = "warning"
    source = "X (deprecated size_average/reduce); seeds/003 Tensor的操作 §7 (reduce,size_average参数说明)"
    message = "size_average= / reduce= are deprecated: use reduction='mean' | 'sum' | 'none'"
    explanation = ("The size_average and reduce flags of the loss functions were merged into one argument, "
                   "reduction. They still work with a deprecation warning, and their interplay is easy to get wrong "
                   "(reduce=False ignores size_average). Map: reduce=False -> reduction='none'; "
                   "size_average=False -> 'sum'; otherwise 'mean'.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            q = f.qualname(call.func)
            if not is_loss(q):
                continue
            given = _legacy_args(call)
            if not given:
                continue  # none given, or a wrapper passing its caller's values through
            names = " and ".join(f"{k}=" for k in given)
            yield call, f"{names} deprecated in {q.rsplit('.', 1)[-1]}: use {_reduction_for(given)}"


def _legacy_args(call: ast.Call) -> dict[str, ast.Constant]:
    """The ``size_average=`` / ``reduce=`` arguments of ``call`` given as constants other than None."""
    return {kw.arg: kw.value for kw in call.keywords if _is_legacy_flag(kw)}


def _is_legacy_flag(kw: ast.keyword) -> bool:
    return kw.arg in ("size_average", "reduce") and isinstance(kw.value, ast.Constant) and kw.value.value is not None


def _reduction_for(given: dict[str, ast.Constant]) -> str:
    """The ``reduction=`` that the legacy arguments ``given`` mean."""
    if is_false(given.get("reduce")):
        return "reduction='none'"
    if is_false(given.get("size_average")):
        return "reduction='sum'"
    return "reduction='mean'"
