"""Two runtime checks of what a model and its optimizer hold, apart from the step the runtime doctor runs:
parameters given to the optimizer twice (TT215), and a frozen submodule left in train mode (TT216).

Both read the objects as they are (no step needed): the optimizer's groups, and each submodule's parameters,
mode and layers. Kept apart from :mod:`.checker`, which runs the step.
"""

from __future__ import annotations

from collections import Counter
import torch
import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import FROZEN_IN_TRAIN, PARAMS_TWICE

__all__ = ["params_twice", "frozen_in_train"]

# BatchNorm only: its running statistics are state a frozen part should keep; Dropout in a frozen part while the
# rest trains (LoRA and adapter fine-tuning) is regularisation people choose
_STATEFUL = (nn.modules.batchnorm._BatchNorm,)


def params_twice(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[Finding]:
    """TT215: tensors the optimizer holds more than once (within a group or across groups), by name."""
    if optimizer is None:
        return []
    held = Counter(id(p) for g in optimizer.param_groups for p in g["params"])
    twice = {i for i, n in held.items() if n > 1}
    if not twice:
        return []
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in twice]
    shown = ", ".join(dict.fromkeys(names)) or f"{len(twice)} tensor(s) not in the model"
    return [Finding(PARAMS_TWICE.id, f"{len(twice)} parameter tensor(s) are in the optimizer more than once, so each "
                    f"step updates them twice: {shown}", path=names[0] if names else "",
                    severity=PARAMS_TWICE.severity, extra={"parameters": sorted(set(names))})]


def frozen_in_train(model: nn.Module) -> list[Finding]:
    """TT216: the largest submodules with parameters, none trainable, in train mode, with BatchNorm under them
    (tracking running statistics), while other parameters of the model train (a model frozen whole is an
    evaluation, not a fine-tune)."""
    if not model.training or not any(p.requires_grad for p in model.parameters()):
        return []
    out: list[Finding] = []
    reported: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(r + ".") for r in reported):
            continue
        layers = _drifting_norms(name, module)
        if layers:
            reported.append(name)
            out.append(_finding(name, layers))
    return out


def _drifting_norms(name: str, module: nn.Module) -> list[str]:
    """The BatchNorm layers under ``module`` whose running statistics move, if it is frozen and in train mode."""
    if not (module.training and _frozen(module)):
        return []
    return [n for n, m in module.named_modules(prefix=name)
            if isinstance(m, _STATEFUL) and m.training and m.track_running_stats]


def _frozen(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def _finding(name: str, layers: list[str]) -> Finding:
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    return Finding(FROZEN_IN_TRAIN.id, f"'{name}' is frozen (no parameter requires grad) but in train mode: its "
                   f"BatchNorm running statistics keep changing with every batch "
                   f"({shown}); call {name}.eval() after model.train()", path=name,
                   severity=FROZEN_IN_TRAIN.severity, extra={"layers": layers})
