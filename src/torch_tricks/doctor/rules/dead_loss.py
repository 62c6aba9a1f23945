"""A loss computed in a training loop and never read again: its gradients never reach the weights, and the
optimizer steps on the other losses' only (a term added to the objective in one line and forgotten in the sum).
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import LOOPS, FileAnalysis, is_backward, walk_local
from torch_tricks.doctor.registry import StaticRule, static_rule

_FUNCTIONAL_LOSSES = frozenset(f"torch.nn.functional.{n}" for n in (
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "cosine_embedding_loss", "margin_ranking_loss",
    "triplet_margin_loss", "ctc_loss", "poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss",
    "multi_margin_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "soft_margin_loss"))


@static_rule
class LossNeverBackpropagated(StaticRule):
    id = "TT135"
    name = "loss-never-backpropagated"
    severity = "error"
    source = "X (the objective); T27"
    message = ("a loss computed in the training loop is never read again: its gradients never reach the weights; "
               "add it to the loss that goes to backward()")
    explanation = ("A loss term that is computed but never used does not train anything: backward() runs on the "
                   "other loss only, and the optimizer steps on those gradients alone, while the forgotten term "
                   "still costs its forward. It is usually a term meant for the sum (loss = loss_a + w * loss_b) "
                   "or for its own backward. Fix: add it to the loss that goes to backward(), or delete it. Reported "
                   "where a loop runs a backward and a variable assigned a loss (a loss module's call, a "
                   "torch.nn.functional loss) in that loop is never read afterwards; a loss that is printed, logged "
                   "or summed is read, and quiet.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for loop in (n for t in LOOPS for n in f.nodes[t]):
            for node, name in _dead_losses(f, loop):
                yield node, (f"`{name}` is computed as a loss in the training loop and never read again: it does "
                             f"not reach backward(), so it trains nothing; add it to the loss that does")


def _dead_losses(f: FileAnalysis, loop: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """(assignment, name) of each loss assigned in ``loop`` (one that runs a backward) and never read."""
    body = list(walk_local(loop, into_loops=False))
    if not any(is_backward(n) for n in body):
        return
    read = {n.id for n in walk_local(loop) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for node in body:
        name = _loss_assigned(f, node)
        if name is not None and name not in read and not _read_after_loop(f, loop, name):
            yield node, name


def _loss_assigned(f: FileAnalysis, node: ast.AST) -> str | None:
    """``name`` of ``name = <loss call>`` (a loss module's call, or a torch.nn.functional loss)."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
        return None
    name, value = node.targets[0].id, node.value
    if name == "_" or not isinstance(value, ast.Call):
        return None
    k = f.kind(value.func)
    if (k is not None and k.cat == "lossfn") or f.qualname(value.func) in _FUNCTIONAL_LOSSES:
        return name
    return None


def _read_after_loop(f: FileAnalysis, loop: ast.AST, name: str) -> bool:
    """``name`` is read in the loop's frame outside the loop (after it: the last value is used)."""
    scope = f.function_scope(loop)
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
               for n in walk_local(scope) if not _inside(f, n, loop))


def _inside(f: FileAnalysis, node: ast.AST, loop: ast.AST) -> bool:
    return any(a is loop for a in f.ancestors(node))
