"""Rules about gradient accumulation: the step gated by ``i % N == 0`` on an index that starts at 0, whose first
update comes after a single micro-batch (and every later one after N, offset by one).
"""

from __future__ import annotations

import ast
import re
from typing import Iterator

from torch_tricks.doctor.analysis import (FileAnalysis, dotted, is_backward, kwarg, number, optimizer_step,
                                          walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule


@static_rule
class AccumulationOffByOne(StaticRule):
    id = "TT134"
    name = "accumulation-off-by-one"
    severity = "warning"
    source = "X (gradient accumulation); T11"
    message = ("optimizer step gated by `i % N == 0` with i from enumerate() starting at 0: the first update sees "
               "one micro-batch, not N; use `(i + 1) % N == 0`")
    explanation = ("Accumulating N micro-batches means stepping after micro-batches N, 2N, ... With `for i, batch "
                   "in enumerate(loader)` and `if i % N == 0: optimizer.step()`, the first step comes right after "
                   "micro-batch 0, on one micro-batch's gradients, and every later group straddles the boundary; the "
                   "last partial group is dropped. Fix: `if (i + 1) % N == 0:` (or enumerate(loader, start=1)). "
                   "Quiet where the backward runs inside the same `if` (a GAN's generator trained every N critic "
                   "steps is not accumulation), where gradients are zeroed every iteration (alternating updates), "
                   "and for N = 1.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for loop in f.nodes[ast.For] + f.nodes[ast.AsyncFor]:
            index = _zero_based_index(f, loop)
            if index is None or not _every_iteration(loop, is_backward) or _every_iteration(loop, _zeroes):
                continue  # gradients zeroed every iteration: not accumulation (TT126 says what is wrong there)
            for node in walk_local(loop, into_loops=False):
                if isinstance(node, ast.If) and _every_n_from_zero(node.test, index) and _steps(f, node):
                    yield node.test, (f"`{ast.unparse(node.test)}` gates the optimizer step, and {index} counts from "
                                      f"0: the first update comes after one micro-batch; use "
                                      f"`({index} + 1) % ... == 0`")


def _zero_based_index(f: FileAnalysis, loop: ast.AST) -> str | None:
    """``i`` of ``for i, x in enumerate(it)`` (no start, or start 0)."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate"):
        return None
    start = kwarg(it, "start", 1)
    if start is not None and number(start) != 0:
        return None
    if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name):
        return target.elts[0].id
    return None


def _every_iteration(loop: ast.AST, test) -> bool:
    """A call ``test`` accepts in the loop's own body outside any ``if`` (or nested loop): it runs every iteration."""
    for stmt in loop.body:
        if isinstance(stmt, (ast.If, ast.Try, ast.For, ast.AsyncFor, ast.While)):
            continue
        if any(test(n) for n in ast.walk(stmt)):
            return True
    return False


def _zeroes(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zero_grad"


def _every_n_from_zero(test: ast.AST, index: str) -> bool:
    """``index % N == 0`` (or ``not index % N``) with N other than 1."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _mod_of(test.operand, index)
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and number(test.comparators[0]) == 0 and _mod_of(test.left, index))


def _mod_of(expr: ast.AST, index: str) -> bool:
    return (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mod) and isinstance(expr.left, ast.Name)
            and expr.left.id == index and number(expr.right) != 1)


def _steps(f: FileAnalysis, node: ast.If) -> bool:
    """The ``if`` body steps an optimizer and runs no backward itself."""
    body = [n for stmt in node.body for n in ast.walk(stmt)]
    return any(_optimizer_step(f, n) for n in body) and not any(is_backward(n) for n in body)


def _optimizer_step(f: FileAnalysis, n: ast.AST) -> bool:
    """``x.step()`` of an optimizer: known as one, or named like one (``opt``, ``optimizer_g``; a function's
    parameter has no known kind), not a scheduler."""
    if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"):
        return False
    if optimizer_step(f, n):
        return True
    name = (dotted(n.func.value) or "").rsplit(".", 1)[-1].lower()
    return bool(_OPTIMIZER_NAME.search(name)) and "sched" not in name and "scaler" not in name


_OPTIMIZER_NAME = re.compile(r"(^|_)(opt|optim|optimizer)(_|$|\d)|^optimi[sz]er")
