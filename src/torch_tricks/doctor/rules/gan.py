"""A GAN's discriminator step on the generator's output without ``.detach()``: the discriminator's backward runs
through the generator too (its gradients computed for nothing, and the generator's graph freed, so the
generator's own step on the same output then fails with "Trying to backward through the graph a second time" or
"modified by an inplace operation").
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import (LOOPS, FileAnalysis, end, is_backward, optimizer_step, root_name,
                                          walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule


@static_rule
class DiscriminatorOnUndetachedFake(StaticRule):
    id = "TT136"
    name = "discriminator-on-undetached-fake"
    severity = "error"
    source = "X (GAN training); T27"
    message = ("the discriminator's step reads the generator's output without .detach(): its backward runs into "
               "the generator")
    explanation = ("In a GAN step the discriminator is trained on fake = G(z) as fixed data. Without "
                   "fake.detach(), D's loss.backward() also runs through G: G's gradients are computed (and left "
                   "to pile up), and G's graph is freed, so G's own step through D(fake) then fails ('Trying to "
                   "backward through the graph a second time', or 'modified by an inplace operation' once D's "
                   "optimizer stepped). Fix: D(fake.detach()) in the discriminator's loss; D(fake) only in the "
                   "generator's. Reported where the loss of a call D(fake) is backpropagated and the optimizer "
                   "stepped next is the one built on D's parameters.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for loop in (n for t in LOOPS for n in f.nodes[t]):
            body = list(walk_local(loop, into_loops=False))
            fakes = _generated(f, body)
            if not fakes:
                continue
            for call in body:
                hit = _d_on_fake(call, fakes)
                if hit is not None and _steps_d_next(f, body, call, hit[0]):
                    yield call, (f"`{ast.unparse(call)}`: {hit[0]}'s step on `{hit[1]}` without .detach() runs its "
                                 f"backward into the generator; use {hit[0]}({hit[1]}.detach(), ...)")


def _generated(f: FileAnalysis, body: list[ast.AST]) -> dict[str, str]:
    """``{fake: G}`` for ``fake = G(...)`` in the loop, G a module called (not under no_grad)."""
    out = {}
    for node in body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and _is_module(f, node.value.func) and not f.no_grad(node)):
            out[node.targets[0].id] = node.value.func.id
    return out


def _is_module(f: FileAnalysis, node: ast.AST) -> bool:
    k = f.kind(node)
    return k is not None and (k.cat == "module" or f.is_module_kind(k))


def _d_on_fake(call: ast.AST, fakes: dict[str, str]) -> tuple[str, str] | None:
    """(D, fake) for a call ``D(fake, ...)`` of another module than fake's generator, fake passed as is."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        return None
    for arg in call.args:
        if isinstance(arg, ast.Name) and arg.id in fakes and fakes[arg.id] != call.func.id:
            return call.func.id, arg.id
    return None


def _steps_d_next(f: FileAnalysis, body: list[ast.AST], call: ast.Call, d: str) -> bool:
    """The first backward after ``call`` in the loop is followed by a step of the optimizer built on ``d``'s
    parameters (before any other optimizer steps)."""
    # by where calls end: ``criterion(D(fake), y).backward()`` starts before D(fake) and ends after it
    after = sorted((n for n in body if isinstance(n, ast.Call) and end(n) >= end(call) and n is not call), key=end)
    backward = next((n for n in after if is_backward(n)), None)
    if backward is None:
        return False
    step = next((n for n in after if end(n) > end(backward) and _is_step(f, n)), None)
    return step is not None and _optimizes(f, step.func.value) == d


def _is_step(f: FileAnalysis, n: ast.Call) -> bool:
    return isinstance(n.func, ast.Attribute) and n.func.attr == "step" and optimizer_step(f, n)


def _optimizes(f: FileAnalysis, opt: ast.AST) -> str | None:
    """The module whose ``.parameters()`` the optimizer ``opt`` was built on, where the file shows it."""
    k = f.kind(opt)
    ctor = k.ref if k is not None and isinstance(k.ref, ast.Call) else None
    if ctor is None or not ctor.args:
        return None
    params = ctor.args[0]
    if isinstance(params, ast.Call) and isinstance(params.func, ast.Attribute) and params.func.attr == "parameters":
        return root_name(params.func.value)
    return None
