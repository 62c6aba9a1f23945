"""Where NaN/Inf first appears (TT210): in the batch, in a module's forward, in the loss, or in the
backward of a module whose forward was finite. A NaN spreads to everything after it, so only the
first place it appears says what to fix; the recorded calls (:mod:`.recorder`) tell which one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import NON_FINITE
from torch_tricks.doctor.runtime.recorder import _Call, _innermost_last, _Recorder
from torch_tricks.doctor.runtime.util import _count, _describe_module, _display, _finding, _finite, _short, _tensors


def _first_nonfinite_finding(inputs: Any, rec: "_Recorder", loss: torch.Tensor | None) -> Finding | None:
    """TT210 for the first place NaN/Inf appears in the forward: the batch, a module, or the loss."""
    if not all(_finite(t) for t in _tensors(inputs)):
        return _finding(NON_FINITE, "(input)", "the input batch already contains NaN/Inf: "
                        "check the data pipeline (division by a zero std, corrupt samples)")
    if rec.first_nonfinite is not None:
        c = rec.first_nonfinite
        return _finding(
            NON_FINITE, _display(c.name),
            f"'{_display(c.name)}' ({_describe_module(c.module)}) turns finite inputs into NaN/Inf "
            "in the forward pass",
            stage="forward",
        )
    if loss is not None and not _finite(loss):
        return _finding(
            NON_FINITE, "(loss)",
            f"the loss is {float(loss.detach()):g} while the model's outputs are finite: loss_fn produces it "
            "(log of 0, division by 0?)", stage="loss",
        )
    return None


def _nonfinite_grad_findings(rec: _Recorder, model: nn.Module,
                             trainable: list[tuple[str, nn.Parameter]]) -> list[Finding]:
    """TT210 for the first place the backward of a finite forward turns gradients non-finite (none
    when every gradient of ``trainable`` is finite)."""
    bad = _nonfinite_grads(trainable)
    if not bad:
        return []
    path, how = _nonfinite_grad_source(rec, model, bad)
    return [_finding(
        NON_FINITE, path,
        f"gradients become NaN/Inf {how} although the forward pass is finite: "
        f"{_count(bad, 'parameter gradient')} non-finite ({_short(bad)})",
        stage="backward", params=bad,
    )]


def _nonfinite_grads(named: list[tuple[str, nn.Parameter]]) -> list[str]:
    """The names of the parameters whose gradient holds NaN/Inf."""
    return [n for n, p in named if p.grad is not None and not _finite(p.grad)]


def _nonfinite_grad_source(rec: _Recorder, model: nn.Module, bad: list[str]) -> tuple[str, str]:
    """(path, phrase) of the innermost module whose backward turned finite gradients non-finite."""
    calls = rec.calls
    if _loss_grad_nonfinite(calls):
        return "(loss)", "in the backward of loss_fn"
    c = _innermost_last(_gradient_breakers(calls, bad))
    if c is not None:
        return _display(c.name), f"in the backward of '{_display(c.name)}' ({_describe_module(c.module)})"
    c = _last_reached(calls)
    if c is None:
        return bad[0], "in backward"
    return _display(c.name), f"in the code that uses the output of '{_display(c.name)}'"


def _loss_grad_nonfinite(calls: list[_Call]) -> bool:
    """NaN/Inf gradients reached the model's outputs (its own call completes last): the loss made them."""
    return bool(calls) and calls[-1].name == "" and calls[-1].out_grad_finite is False


def _last_reached(calls: list[_Call]) -> _Call | None:
    """The last call to complete whose outputs NaN/Inf gradients reached."""
    reached = [c for c in calls if c.out_grad_finite is False]
    return max(reached, key=lambda c: c.index) if reached else None


def _gradient_breakers(calls: list[_Call], bad: list[str]) -> list[_Call]:
    """The calls whose output gradients are finite but whose backward hands non-finite ones on:
    to the calls that made their inputs, or to their own parameters (named in ``bad``)."""
    own_bad = {n.rpartition(".")[0] for n in bad}
    return [c for c in calls
            if c.out_grad_finite is not False and (_feeds_nonfinite_grad(c, calls) or c.name in own_bad)]


def _feeds_nonfinite_grad(call: _Call, calls: list[_Call]) -> bool:
    """NaN/Inf gradients reached the outputs of a call that made an input of ``call``."""
    return any(calls[p].out_grad_finite is False for p in call.producers)
