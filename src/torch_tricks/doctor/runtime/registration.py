"""Modules and parameters held in plain ``list``, ``tuple`` or ``dict`` attributes (TT203): the model
does not register them, so ``model.parameters()``, ``state_dict()``, ``.to()`` and ``train()`` /
``eval()`` never reach them. Read from the caller's model as it is; a container of parameter-free,
mode-free modules (a list of activations) is harmless and not reported."""

from __future__ import annotations

from itertools import chain
from typing import Any, Iterable, Iterator

import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import UNREGISTERED
from torch_tricks.doctor.runtime.modes import _mode_dependent
from torch_tricks.doctor.runtime.util import _MODULE_INTERNALS, _count, _finding, _join


def _unregistered_modules(model: nn.Module) -> list[Finding]:
    """Modules / parameters held in plain list, tuple or dict attributes (TT203)."""
    registered = {id(m) for m in model.modules()}
    registered_params = {id(p) for p in model.parameters()}
    out = []
    for path, value in _plain_containers(model):
        finding = _plain_container_finding(path, value, registered, registered_params)
        if finding is not None:
            out.append(finding)
    return out


def _plain_containers(model: nn.Module) -> Iterator[tuple[str, list | tuple | dict]]:
    """(path, value) of the list, tuple and dict attributes of every module of ``model``."""
    for mod_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr not in _MODULE_INTERNALS and isinstance(value, (list, tuple, dict)):
                yield _join(mod_name, attr), value


def _plain_container_finding(path: str, value: list | tuple | dict, registered: set[int],
                             registered_params: set[int]) -> Finding | None:
    """TT203 for the plain container ``value`` at ``path`` if it holds modules or parameters the
    model does not register and that matter (parameters, buffers, or a train/eval behaviour)."""
    mods, params = _unregistered_items(value, registered, registered_params)
    lost = _lost_parameters(mods, params, registered_params)
    moded = _mode_dependent_modules(mods)
    if not lost and not _hold_buffers(mods) and not moded:
        return None  # e.g. a list of parameter-free activations: harmless
    msg = _unregistered_message(path, value, mods, params, lost, moded)
    fix = _registering_container(value, only_parameters=bool(params and not mods))
    return _finding(UNREGISTERED, path, msg + f"; wrap it in {fix}",
                    modules=len(mods), parameters=sum(p.numel() for p in lost))


def _hold_buffers(mods: list[nn.Module]) -> bool:
    return any(True for m in mods for _ in m.buffers())


def _mode_dependent_modules(mods: list[nn.Module]) -> list[nn.Module]:
    """The modules in or under ``mods`` whose forward depends on train/eval mode."""
    return [s for m in mods for s in m.modules() if _mode_dependent(s)]


def _lost_parameters(mods: list[nn.Module], params: list[nn.Parameter],
                     registered_params: set[int]) -> list[nn.Parameter]:
    """The parameters of the unregistered ``mods`` that the model does not hold, and the unregistered
    ``params``, each once."""
    lost = [p for p in chain.from_iterable(m.parameters() for m in mods) if id(p) not in registered_params]
    lost += params
    return list({id(p): p for p in lost}.values())


def _unregistered_message(path: str, value: Any, mods: list[nn.Module], params: list[nn.Parameter],
                          lost: list[nn.Parameter], moded: list[nn.Module]) -> str:
    """What the plain container at ``path`` holds and what the model loses by not registering it."""
    msg = (f"'{path}' is a plain {type(value).__name__} holding {_held(mods, params)} that "
           "model.parameters(), state_dict() and .to() never see")
    if lost:
        msg += f": {sum(p.numel() for p in lost):,} parameter values are never trained or saved"
    if moded:
        msg += "; train()/eval() does not reach its Dropout/BatchNorm"
    return msg


def _held(mods: list[nn.Module], params: list[nn.Parameter]) -> str:
    """What a plain container holds, for a message: ``2 modules (Linear, ReLU) and 1 parameter``."""
    held = []
    if mods:
        held.append(f"{_count(mods, 'module')} ({', '.join(sorted({type(m).__name__ for m in mods}))})")
    if params:
        held.append(_count(params, "parameter"))
    return " and ".join(held)


def _unregistered_items(value: Any, registered: set[int],
                        registered_params: set[int]) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """The modules and parameters found in the container ``value`` that the model does not register."""
    mods, params = [], []
    for item in _walk(value):
        if isinstance(item, nn.Parameter):
            if id(item) not in registered_params:
                params.append(item)
        elif isinstance(item, nn.Module) and id(item) not in registered:
            mods.append(item)
    return mods, params


def _registering_container(value: Any, only_parameters: bool) -> str:
    """The nn container that registers what the plain list / tuple / dict ``value`` holds."""
    if only_parameters:
        return "nn.ParameterDict" if isinstance(value, dict) else "nn.ParameterList"
    return "nn.ModuleDict" if isinstance(value, dict) else "nn.ModuleList"


def _walk(value: Any, depth: int = 3, limit: int = 10_000) -> Iterator[Any]:
    """Items of nested lists / tuples / dicts (dict values), a bounded number of them."""
    items: Iterable[Any] = value.values() if isinstance(value, dict) else value
    for i, item in enumerate(items):
        if i >= limit:
            return
        if isinstance(item, (list, tuple, dict)) and depth > 1:
            yield from _walk(item, depth - 1, limit)
        else:
            yield item
