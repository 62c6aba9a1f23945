"""Memory that grows step after step (TT211): the inspector's leak check runs the plain steps; when it
finds growth, the sizes of everything that can grow (container and tensor attributes and buffers of
every module, the loss function's attributes or closure cells), measured before and after, name
what keeps each step's tensors."""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any

import torch
import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import MEMORY_GROWTH
from torch_tricks.doctor.runtime.util import _MODULE_INTERNALS, _finding, _join


def _growth_findings(rep: Any, grown: dict[str, int], ran: int) -> list[Finding]:
    """TT211 for each attribute that grew over the ``ran`` steps, or for the step when none did."""
    why = "; ".join(rep.reasons)
    findings = []
    if not grown:
        findings.append(_finding(MEMORY_GROWTH, "(step)", f"memory grows across training steps: {why}",
                                 growth_per_step_bytes=rep.growth_per_step_bytes,
                                 graph_growth_per_step=rep.graph_growth_per_step))
    for path, added in grown.items():
        findings.append(_finding(
            MEMORY_GROWTH, path,
            f"'{path}' grows by {added} over {ran} steps while {why}: it keeps references to every "
            "step's tensors; store .item() / .detach() or clear it",
            growth_per_step_bytes=rep.growth_per_step_bytes, graph_growth_per_step=rep.graph_growth_per_step,
            grown_by=added, steps=ran,
        ))
    return findings


def _grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """By how much each size of :func:`_growable_sizes` grew from ``before`` to ``after``."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}


def _growable_sizes(model: nn.Module, loss_fn: Any) -> dict[str, int]:
    """Sizes of everything that can grow across steps: container and tensor attributes and
    buffers of every module, attributes (or closure cells) of the loss function."""
    sizes: dict[str, int] = {}
    for name, m in model.named_modules():
        sizes.update(_attribute_sizes(name, m))
        for bname, b in m.named_buffers(recurse=False):
            sizes[_join(name, bname)] = b.numel()
    sizes.update(_loss_fn_sizes(loss_fn))
    return sizes


def _loss_fn_sizes(loss_fn: Any) -> dict[str, int]:
    """Sizes of what can grow in the loss function: its modules' attributes, its closure cells,
    or the attributes of a callable object."""
    if isinstance(loss_fn, nn.Module):
        sizes: dict[str, int] = {}
        for name, m in loss_fn.named_modules(prefix="loss_fn"):
            sizes.update(_attribute_sizes(name, m))
        return sizes
    if inspect.isfunction(loss_fn) and loss_fn.__closure__:
        return _closure_sizes(loss_fn)
    if _is_callable_object(loss_fn):
        return _attribute_sizes("loss_fn", loss_fn)
    return {}


def _is_callable_object(fn: Any) -> bool:
    """An object with attributes of its own, not a function or method."""
    return fn is not None and hasattr(fn, "__dict__") and not inspect.isroutine(fn)


def _attribute_sizes(prefix: str, obj: Any) -> dict[str, int]:
    """Sizes of the container and tensor attributes of ``obj`` (not nn.Module's own bookkeeping)."""
    sizes: dict[str, int] = {}
    for attr, value in vars(obj).items():
        if isinstance(obj, nn.Module) and attr in _MODULE_INTERNALS:
            continue
        size = _size(value)
        if size is not None:
            sizes[_join(prefix, attr)] = size
    return sizes


def _closure_sizes(fn: Any) -> dict[str, int]:
    """Sizes of the containers and tensors the function ``fn`` closes over."""
    sizes: dict[str, int] = {}
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__):
        try:
            size = _size(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
        if size is not None:
            sizes[f"loss_fn.{var}"] = size
    return sizes


def _size(value: Any) -> int | None:
    if isinstance(value, (list, dict, set, deque)):
        return len(value)
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return value.numel()
    return None
