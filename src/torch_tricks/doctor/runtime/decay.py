"""Weight decay in the wrong place: param groups that decay biases and norm parameters (TT202, judged
as :func:`torch_tricks.train.optim.param_groups` splits them), and Adam-family optimizers whose
``weight_decay`` is L2 added to the gradient, which Adam rescales (TT212). Both read the caller's
optimizer as it is; no step is needed."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import COUPLED_L2, DECAY_ON_NO_DECAY
from torch_tricks.doctor.runtime.util import _count, _finding, _short, _slashed
from torch_tricks.train.optim import param_groups


def _decay_on_no_decay(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Finding]:
    """Param groups that decay biases / norm parameters (TT202), judged as param_groups does."""
    if optimizer is None:
        return []
    names = _param_names(model)
    no_decay = _no_decay_ids(model)
    out = []
    for i, g in enumerate(optimizer.param_groups):
        wd = _weight_decay(g)
        hit = _names_among(g["params"], names, no_decay)
        if wd > 0 and hit:
            out.append(_decay_group_finding(i, g, wd, hit))
    return out


#: The optimizers whose weight_decay is L2 added to the gradient (unless decoupled_weight_decay).
_ADAM_L2 = (torch.optim.Adam, torch.optim.NAdam, torch.optim.RAdam)


def _coupled_l2(optimizer: torch.optim.Optimizer | None) -> list[Finding]:
    """Adam-family optimizers with coupled L2 instead of weight decay (TT212)."""
    if optimizer is None or type(optimizer) not in _ADAM_L2:
        return []
    wds = _coupled_decays(optimizer)
    if not wds:
        return []
    name = type(optimizer).__name__
    return [_finding(COUPLED_L2, "optimizer",
                     f"{name}(weight_decay={_slashed(wds)}) adds L2 to the gradient, which {name} "
                     "rescales: weights with large gradients are barely decayed; use AdamW",
                     optimizer=name, weight_decay=wds[-1])]


def _names_among(params: list[torch.Tensor], names: dict[int, str], ids: set[int]) -> list[str]:
    """The names of the ``params`` that are among ``ids`` (and have a name)."""
    return [names[id(p)] for p in params if id(p) in ids and id(p) in names]


def _no_decay_ids(model: nn.Module) -> set[int]:
    """The parameters (ids) that :func:`param_groups` keeps out of weight decay."""
    no_decay = set()
    for g in param_groups(model, 1.0):
        if g["name"] == "no_decay":
            no_decay = {id(p) for p in g["params"]}
    return no_decay


def _decay_group_finding(i: int, group: dict[str, Any], wd: float, hit: list[str]) -> Finding:
    """TT202 for the param group ``i`` that decays the bias / norm parameters ``hit`` by ``wd``."""
    label = f" ('{group['name']}')" if isinstance(group.get("name"), str) else ""
    return _finding(
        DECAY_ON_NO_DECAY, f"optimizer.param_groups[{i}]",
        f"param group {i}{label} applies weight_decay={wd:g} to {_count(hit, 'bias/norm parameter')} "
        f"({_short(hit)}); build the optimizer on param_groups(model, {wd:g})",
        params=hit, weight_decay=wd, group=i,
    )


def _coupled_decays(optimizer: torch.optim.Optimizer) -> list[float]:
    """The distinct non-zero weight decays of the param groups that do not decouple it, ascending."""
    return sorted({_weight_decay(g) for g in optimizer.param_groups if not g.get("decoupled_weight_decay", False)}
                  - {0.0})


# -- what the optimizer applies --------------------------------------------------------------

def _decay_by_name(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    if optimizer is None:
        return {}
    names = _param_names(model)
    return {names[id(p)]: _weight_decay(g) for g in optimizer.param_groups for p in g["params"] if id(p) in names}


def _weight_decay(group: dict[str, Any]) -> float:
    """A param group's weight decay (0 when absent or None)."""
    return float(group.get("weight_decay", 0.0) or 0.0)


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}
