"""The train/eval switch: submodules left in the other mode than the model (TT208: Dropout off or
BatchNorm on stale statistics while the model trains, or the reverse in eval), and randomness that
``eval()`` does not switch off (TT209: two eval-mode forwards of the same batch differ, e.g.
``F.dropout(x, p)`` without ``training=self.training``)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import MODE_MISMATCH, RANDOM_IN_EVAL
from torch_tricks.doctor.runtime.util import _describe_module, _display, _finding, _short, _tensors
from torch_tricks.errors import one_line
from torch_tricks.inspect.inputs import call_model


def _mode_mismatches(model: nn.Module) -> list[Finding]:
    """Submodules whose train/eval mode differs from the model's (TT208)."""
    root = model.training
    out = []
    done: list[str] = []
    for name, module in model.named_modules():
        if not name or module.training == root or _under_any(name, done):
            continue
        done.append(name)  # the top of a subtree switched to the other mode
        finding = _mode_mismatch_finding(name, module, root)
        if finding is not None:
            out.append(finding)
    return out


def _random_in_eval(model: nn.Module, inputs: Callable[[], Any], skipped: dict[str, str]) -> list[Finding]:
    """TT209: two eval-mode forwards of the same batch (``inputs()`` gives a fresh copy) must agree;
    when they cannot run, ``skipped`` says why."""
    runs = _eval_twice(model, inputs, skipped)
    if runs is None:
        return []
    first, second = runs
    if _same(first.output, second.output) and len(first.calls) == len(second.calls):
        return []
    found = _first_random_call(first, second)
    where, module = found if found is not None else ("(model)", model)
    return [_finding(
        RANDOM_IN_EVAL, where,
        f"two eval-mode forwards of the same batch differ, first in '{where}' ({_describe_module(module)}): "
        "something random ignores eval(), e.g. F.dropout(x, p) without training=self.training",
    )]


_DROPOUT_TYPES = (nn.modules.dropout._DropoutNd,)


def _mode_dependent(m: nn.Module) -> bool:
    """Modules whose forward depends on ``training``."""
    if isinstance(m, _DROPOUT_TYPES):
        return m.p > 0
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return True
    if isinstance(m, nn.modules.instancenorm._InstanceNorm):
        return m.track_running_stats
    if isinstance(m, nn.RNNBase):
        return m.dropout > 0 and m.num_layers > 1
    if isinstance(m, nn.MultiheadAttention):
        return m.dropout > 0
    return False


# -- modes that differ (TT208) ---------------------------------------------------------------

def _under_any(name: str, tops: list[str]) -> bool:
    """``name`` is a module path inside one of the subtrees at ``tops``."""
    return any(name.startswith(d + ".") for d in tops)


def _mode_mismatch_finding(name: str, module: nn.Module, root: bool) -> Finding | None:
    """TT208 for the submodule ``name`` in the other mode than the model (``root``), if layers
    under it depend on the mode."""
    affected = _mode_affected(name, module)
    if not affected:
        return None
    if root and _fully_frozen(module):
        return None  # a frozen part kept in eval on purpose
    msg = _mode_mismatch_message(name, root, affected)
    return _finding(MODE_MISMATCH, name, msg, model_training=root, modules=[n for n, _ in affected])


def _mode_affected(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the mode-dependent layers under ``module`` (at ``name``) in its mode."""
    return [(n, m) for n, m in module.named_modules(prefix=name)
            if m.training == module.training and _mode_dependent(m)]


def _fully_frozen(module: nn.Module) -> bool:
    """``module`` has parameters and none of them requires grad."""
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


#: By the model's ``training``: the state of a submodule in the other mode, and what its Dropout
#: and BatchNorm layers then do wrong.
_MODE_EFFECTS = {
    True: ("is in eval mode while the model trains", "Dropout is off", "BatchNorm uses stale running statistics"),
    False: ("is in train mode while the model is in eval mode", "Dropout still drops",
            "BatchNorm uses batch statistics and overwrites its running ones"),
}


def _mode_mismatch_message(name: str, training: bool, affected: list[tuple[str, nn.Module]]) -> str:
    """What the submodule ``name`` in the other mode than the model (``training``) does wrong,
    through its mode-dependent layers ``affected`` (name, module)."""
    dropout, norms = _split_norms(affected)
    state, dropout_effect, norm_effect = _MODE_EFFECTS[training]
    effects = [f"{effect} ({_short(names)})" for effect, names in ((dropout_effect, dropout), (norm_effect, norms))
               if names]
    return f"'{name}' {state}: " + "; ".join(effects)


def _split_norms(affected: list[tuple[str, nn.Module]]) -> tuple[list[str], list[str]]:
    """The names of the Dropout-like layers and of the norm layers among ``affected``."""
    dropout = [n for n, m in affected if not _is_norm(m)]
    norms = [n for n, m in affected if _is_norm(m)]
    return dropout, norms


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm))


# -- random in eval (TT209) ------------------------------------------------------------------

def _eval_twice(model: nn.Module, inputs: Callable[[], Any],
                skipped: dict[str, str]) -> tuple[_Fingerprints, _Fingerprints] | None:
    """Two no-grad eval-mode forwards of the same batch (the modes restored after); None if they fail."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return _Fingerprints.run(model, inputs()), _Fingerprints.run(model, inputs())
    except Exception as exc:
        skipped["random-output-in-eval"] = f"the eval-mode forward failed: {one_line(exc)}"
        return None
    finally:
        for m, mode in modes:
            m.training = mode


class _Fingerprints:
    """Per module call (completion order): name, module, fingerprints of inputs and outputs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, nn.Module, list[float], list[float]]] = []
        self.output: list[float] = []
        self._inputs: list[list[float]] = []

    @classmethod
    def run(cls, model: nn.Module, inputs: tuple[Any, ...] | dict[str, Any]) -> "_Fingerprints":
        fp = cls()
        names = {id(m): n for n, m in model.named_modules()}
        handles = []
        for m in model.modules():
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs: fp._inputs.append(_fingerprint((args, kwargs))), with_kwargs=True))
            handles.append(m.register_forward_hook(
                lambda mod, args, out: fp.calls.append((names[id(mod)], mod, fp._inputs.pop(), _fingerprint(out)))
            ))
        try:
            fp.output = _fingerprint(call_model(model, inputs))
        finally:
            for h in handles:
                h.remove()
        return fp


def _first_random_call(first: "_Fingerprints", second: "_Fingerprints") -> tuple[str, nn.Module] | None:
    """(path, module) of the first module call that, given the same inputs in both runs, gave different
    outputs; None when the runs called different modules or none differs."""
    if len(first.calls) != len(second.calls):
        return None
    for (name, mod, fin, fout), (_, _, sin, sout) in zip(first.calls, second.calls):
        if _same(fin, sin) and not _same(fout, sout):
            return _display(name), mod
    return None


def _fingerprint(obj: Any) -> list[float]:
    """Two sums per floating-point tensor: equal tensors give equal fingerprints."""
    out: list[float] = []
    for t in _tensors(obj):
        if t.is_floating_point():
            d = t.detach().double()
            out += [float(d.sum()), float(d.abs().sum())]
    return out


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))


def _close(x: float, y: float) -> bool:
    """Equal within a relative 1e-5 (NaN equals NaN: the same non-finite output)."""
    if math.isnan(x) and math.isnan(y):
        return True
    return abs(x - y) <= 1e-5 * max(1.0, abs(x), abs(y))
