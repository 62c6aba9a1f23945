"""The runtime half of ``torch-tricks doctor``: run real training steps of a live model and
report the pitfalls that only a run can show (rules ``TT2xx``).

Reading source cannot tell which parameters get no gradient, whether the tensor fed to
``CrossEntropyLoss`` is logits or already log-probabilities, what batch reaches each
BatchNorm, where the first NaN appears, or whether memory grows step after step. One
instrumented training step (forward hooks on every module, tensor hooks on their
outputs, a ``TorchFunctionMode`` that sees the loss functions' inputs) answers all of
these with measured tensors, and ``steps`` more steps feed the inspector's leak check.

The caller's objects are never touched: model, optimizer and loss function are copied
with one ``deepcopy`` (so the copied optimizer holds the copied parameters), the global
RNG is forked, the caller's ``.grad`` tensors are parked while the check runs (a loss
closing over the caller's model cannot accumulate into them), and the inputs are cloned
for every step so that an inplace op in the model cannot write into the caller's batch.
Weights, gradients, buffers, optimizer state, train/eval modes and the random stream are
exactly as before the check. What cannot be copied is a plain function's closure: a loss
function appending to a list it closes over will append the check's losses too.

Cost: ``steps + 2`` training steps (one warm-up for the leak check) and two no-grad
forwards on the copy, plus a garbage collection per leak-check step; ``steps=1`` runs a
single step and skips the memory-growth check.

Finding paths are qualified module or parameter names (``"layer4"``, ``"fc2.weight"``);
what is not a module has a parenthesised pseudo-name that no attribute can clash with:
``"(model)"`` (the model's own forward code), ``"(input)"``, ``"(loss)"``, ``"(step)"``,
plus ``"optimizer"``, ``"optimizer.param_groups[i]"`` and ``"loss_fn.<attr>"``.

Layout: this module is the entry (:func:`check_model`); :mod:`.checker` runs one check in order,
and each family of checks has its module: :mod:`.registration` (TT203), :mod:`.modes` (TT208,
TT209), :mod:`.frozen` (TT215, TT216), :mod:`.decay` (TT202, TT212), :mod:`.untrained` (TT201,
TT213), :mod:`.recorder` (the instrumented forward), :mod:`.pairing` (TT207), :mod:`.nonfinite`
(TT210), :mod:`.layers` (TT204, TT205, TT206), :mod:`.memory` (TT211), :mod:`.loss` and
:mod:`.targets` (the step's loss and target, TT214); :mod:`.arguments`, :mod:`.isolation`,
:mod:`.util` and :mod:`.report` (:class:`RuntimeReport`) serve them all.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from torch_tricks.doctor.rules.runtime import MIN_BN_BATCH, RULES  # declared apart: no torch needed to list them
from torch_tricks.doctor.runtime.checker import _Checker
from torch_tricks.doctor.runtime.loss import LOSS_KINDS
from torch_tricks.doctor.runtime.report import RuntimeReport

__all__ = ["RuntimeReport", "check_model", "RULES", "MIN_BN_BATCH", "LOSS_KINDS"]


def check_model(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    target: Any = None,
    steps: int = 3,
    device: torch.device | str | None = None,
) -> RuntimeReport:
    """Run a training step of ``model`` on ``batch`` and report the runtime pitfalls.

    ``batch``: the input tensor, a tuple/list of positional inputs, or a dict of keyword
    inputs (``model(**batch)``). ``loss_fn``: called as ``loss_fn(output, target)``
    (``loss_fn(output)`` if it takes one argument); or a name of :data:`LOSS_KINDS`, that
    torch loss applied to the output's prediction (:func:`torch_tricks.outputs.primary_output`:
    a ModelOutput's logits, token logits over their last dimension); without it the loss
    is the mean of the outputs. Without ``target`` a plausible one is made from the output
    (class indices for CrossEntropy/NLL-like losses and 2-D logits, next-token ids for token
    logits of integer ids, 0/1 labels for BCE, random values of the output's shape
    otherwise). ``optimizer``: the one used in training (its param groups are checked and
    a copy of it steps); without it plain SGD steps. ``steps`` more steps measure memory
    growth (at least 2 to see a trend; 1 skips that check). ``device``: where to run
    (default: the model's).

    Works on copies (see the module docstring): the caller's model, optimizer, loss
    function and batch are unchanged afterwards. A batch the model cannot take raises a
    :class:`UserError` naming the module and shapes.
    """
    return _Checker(model, batch, loss_fn, optimizer, target, steps, device).run()
