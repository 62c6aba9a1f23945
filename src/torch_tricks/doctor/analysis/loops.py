"""Training steps: which loop is one, and what runs before and after a node in it.

The queries on a :class:`FileAnalysis` that the loop, step, module and GAN rules share: a forward
before a node (:func:`forward_before`), a backward after it (:func:`backward_after`), a loop over
batches or with a backward in it (:func:`is_step_loop`), an optimizer's step
(:func:`optimizer_step`), an expression that is a model (:func:`looks_like_model`), and the
enclosing function or ancestors up to a loop.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis.file import FileAnalysis
from torch_tricks.doctor.analysis.kind import _category
from torch_tricks.doctor.analysis.syntax import _called_function, is_backward, pos, walk_local
from torch_tricks.doctor.analysis.vocab import TQDM


def forward_before(f: FileAnalysis, node: ast.AST) -> bool:
    """A module or loss is called before ``node`` in its function's frame (a graph may exist): a module
    of this file or torch.nn, or a callable passed in as a parameter (a model given to a train step)."""
    here = pos(node)
    for c in f.calls_in(f.function_scope(node)):
        if pos(c) >= here:
            return False
        if _calls_model(f, c):
            return True
    return False


def backward_after(f: FileAnalysis, node: ast.AST) -> bool:
    """A ``.backward()`` (or ``torch.autograd.backward``) runs after ``node`` in its function's frame."""
    here = pos(node)
    return any(pos(c) > here and (is_backward(c) or f.qualname(c.func) == "torch.autograd.backward")
               for c in f.calls_in(f.function_scope(node)))


def is_step_loop(f: FileAnalysis, loop: ast.AST) -> bool:
    """A loop whose iterations are training steps: it iterates a loader, or its own body
    (not a nested loop) calls backward() or optimizer.step()."""
    if isinstance(loop, (ast.For, ast.AsyncFor)) and element_is_batch(f, loop):
        return True
    return any(is_backward(node) for node in walk_local(loop, into_loops=False))


def element_is_batch(f: FileAnalysis, loop: ast.AST) -> bool:
    it = unwrap_iterable(f, loop.iter)
    k = f.kind(it)
    return (k is not None and k.cat == "loader") or (k is None and f.looks_like_loader(it))


def unwrap_iterable(f: FileAnalysis, it: ast.AST) -> ast.AST:
    """``loader`` for ``enumerate(loader)``, ``tqdm(loader)``, ``iter(loader)``."""
    while isinstance(it, ast.Call) and it.args and (
            _called_function(it) in ("enumerate", "tqdm", "iter") or f.qualname(it.func) in TQDM):
        it = it.args[0]
    return it


def optimizer_step(f: FileAnalysis, call: ast.Call) -> bool:
    """``optimizer.step()`` or ``scaler.step(optimizer)``."""
    if _category(f.kind(call.func.value)) == "optimizer":
        return True
    return bool(call.args) and _category(f.kind(call.args[0])) == "optimizer"


def looks_like_model(f: FileAnalysis, node: ast.AST) -> bool:
    k = f.kind(node)
    if k is not None:
        return f.is_module_kind(k)
    # a model passed in, or a name that says so
    return _is_parameter(f, node) or (isinstance(node, ast.Name) and "model" in node.id.lower())


def enclosing_function(f: FileAnalysis, node: ast.AST) -> ast.AST | None:
    for anc in f.ancestors(node):
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return anc
    return None


def ancestors_until(f: FileAnalysis, node: ast.AST, stop: ast.AST) -> Iterator[ast.AST]:
    for anc in f.ancestors(node):
        if anc is stop:
            return
        yield anc


def _calls_model(f: FileAnalysis, call: ast.Call) -> bool:
    """``call`` calls a module or a loss, or a callable passed in as a parameter."""
    k = f.kind(call.func)
    return _category(k) == "lossfn" or f.is_module_kind(k) or _is_parameter(f, call.func)


def _is_parameter(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` is a name that reads a parameter of its function."""
    b = f.lookup(node) if isinstance(node, ast.Name) else None
    return b is not None and b[1] == "param"
