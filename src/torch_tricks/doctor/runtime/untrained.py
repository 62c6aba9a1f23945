"""Parameters that never train: those that get no gradient in the first step (TT201: the loss does
not depend on them, an unused layer, a detached branch), said per submodule with whether weight decay
still shrinks them; and trainable ones the optimizer does not hold (TT213: they get gradients but
never change)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import NOT_OPTIMIZED, UNUSED_PARAMS
from torch_tricks.doctor.runtime.decay import _decay_by_name
from torch_tricks.doctor.runtime.util import _count, _finding, _join, _optimizer_params, _slashed


def _unused_findings(trainable: list[tuple[str, nn.Parameter]], unused: list[tuple[str, nn.Parameter]],
                     work: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Finding]:
    """TT201 for the parameters ``unused`` of ``trainable`` (the working copy ``work``'s) without
    gradient: one finding when none gets one, else one per group of them; the caller's ``model``
    and ``optimizer`` say which weight decay applies to them."""
    unused_ids = {id(p) for _, p in unused}
    if trainable and len(unused_ids) == len(trainable):
        return [_finding(
            UNUSED_PARAMS, "(model)",
            "no trainable parameter gets a gradient: the loss does not depend on them "
            "(an output computed under torch.no_grad(), .detach() or .data?)",
            params=len(trainable),
        )]
    if not unused_ids:
        return []
    decay = _decay_by_name(model, optimizer)
    return [_unused_group_finding(*group, decay, optimizer is not None) for group in _group_params(work, unused_ids)]


def _not_optimized(model: nn.Module, optimizer: torch.optim.Optimizer | None, exclude: set[str]) -> list[Finding]:
    """Trainable parameters the optimizer does not hold (TT213); those without gradient are TT201's."""
    if optimizer is None:
        return []
    return [_finding(
        NOT_OPTIMIZED, path,
        f"{_describe_group(path, module)}: {_count(names, 'trainable parameter')} ({numel:,} values) not in the "
        "optimizer get gradients but never change; "
        "add them to the optimizer, or set requires_grad=False to freeze them",
        params=names,
    ) for path, module, names, numel in _group_params(model, _not_held(model, optimizer, exclude))]


def _without_grad(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in named if p.grad is None]


def _unused_group_finding(path: str, module: nn.Module | None, names: list[str], numel: int,
                          decay: dict[str, float], has_optimizer: bool) -> Finding:
    """TT201 for one group of parameters without gradient, saying whether weight decay still
    shrinks them (a zero .grad instead of None) or the optimizer (if any) does not hold them."""
    wds = _decays(names, decay)
    msg = (f"{_describe_group(path, module)} gets no gradient: {_count(names, 'parameter')} ({numel:,} values) "
           "never trained")
    if wds:
        msg += _still_decayed(names, wds)
    elif has_optimizer and not any(n in decay for n in names):
        msg += f" (the optimizer does not hold {_them(names)})"
    return _finding(UNUSED_PARAMS, path, msg, params=names, weight_decay=wds[-1] if wds else 0.0)


def _decays(names: list[str], decay: dict[str, float]) -> list[float]:
    """The distinct positive weight decays the optimizer applies to the parameters ``names``, ascending."""
    return sorted({decay[n] for n in names if decay.get(n, 0) > 0})


def _still_decayed(names: list[str], wds: list[float]) -> str:
    """Why parameters without gradient that the optimizer decays (by ``wds``) still change."""
    return (f"; the optimizer still holds {_them(names)} with weight_decay="
            f"{_slashed(wds)}, which shrinks them towards zero whenever their "
            ".grad is a zero tensor instead of None")


def _not_held(model: nn.Module, optimizer: torch.optim.Optimizer, exclude: set[str]) -> set[int]:
    """The trainable parameters (ids) of ``model`` that ``optimizer`` does not hold, those named
    in ``exclude`` aside."""
    held = {id(p) for p in _optimizer_params(optimizer)}
    return {id(p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in held and n not in exclude}


def _group_params(model: nn.Module, ids: set[int]) -> list[tuple[str, nn.Module | None, list[str], int]]:
    """(path, module, parameter names, number of values): the largest submodules all of
    whose trainable parameters are in ``ids``, then the remaining single parameters."""
    out: list[tuple[str, nn.Module | None, list[str], int]] = []
    reported: set[int] = set()

    def visit(prefix: str, mod: nn.Module) -> None:
        own = [(n, p) for n, p in mod.named_parameters(prefix=prefix) if p.requires_grad]
        if prefix and own and all(id(p) in ids for _, p in own):
            if not all(id(p) in reported for _, p in own):
                reported.update(id(p) for _, p in own)
                out.append((prefix, mod, [n for n, _ in own], sum(p.numel() for _, p in own)))
            return
        for cname, child in mod.named_children():
            visit(_join(prefix, cname), child)
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) in ids and id(p) not in reported:
                reported.add(id(p))
                out.append((_join(prefix, pname), None, [_join(prefix, pname)], p.numel()))

    visit("", model)
    return out


def _describe_group(path: str, module: nn.Module | None) -> str:
    """A group of parameters of :func:`_group_params`: a submodule, or a single parameter."""
    return f"'{path}' ({type(module).__name__})" if module is not None else f"parameter '{path}'"


def _them(items: list[Any]) -> str:
    return "them" if len(items) > 1 else "it"
