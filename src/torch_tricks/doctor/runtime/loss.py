"""The loss of the check's training steps: the caller's ``loss_fn`` (called as ``loss_fn(output,
target)``, or ``loss_fn(output)``), a torch loss named in :data:`LOSS_KINDS` and chosen on the first
output (the model's own loss for ``auto`` when its output carries one), or the mean of the outputs;
with the target it is given or that :mod:`.targets` makes. The loss call's warning that a target
broadcasts against the prediction becomes a finding (TT214); a loss that fails says the shapes it
got."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from torch_tricks.batches import map_tensors
from torch_tricks.doctor.registry import Finding, Rule
from torch_tricks.doctor.rules.runtime import TARGET_BROADCAST
from torch_tricks.doctor.runtime.pairing import _LossAbort
from torch_tricks.doctor.runtime.report import RuntimeReport
from torch_tricks.doctor.runtime.targets import (
    _broadcast_shapes, _make_target, _next_tokens, _token_ids, _widens_prediction,
)
from torch_tricks.doctor.runtime.util import _finding, _tensors
from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.inputs import describe_inputs
from torch_tricks.inspect.step import default_loss
from torch_tricks.outputs import output_loss, primary_output

#: Loss names ``check_model`` takes for ``loss_fn`` (and ``doctor --loss``): the shared names of
#: :data:`torch_tricks.outputs.LOSSES` plus two aliases of the doctor's own (``cross-entropy``,
#: ``bce``), each a ``torch.nn`` loss class, whose calls the TT207 rule watches; ``none``: the
#: mean of the outputs. ``auto`` is the model's own ``.loss`` when its output carries one, else
#: cross-entropy.
LOSS_KINDS: dict[str, str | None] = {
    "auto": "CrossEntropyLoss", "ce": "CrossEntropyLoss", "cross-entropy": "CrossEntropyLoss", "nll": "NLLLoss",
    "bce-with-logits": "BCEWithLogitsLoss", "bce": "BCELoss", "mse": "MSELoss", "none": None,
}


#: The named losses over classes: on token logits they train next-token prediction.
_CLASS_LOSS_NAMES = ("CrossEntropyLoss", "NLLLoss")


class _StepLoss:
    """The loss of each training step of one check, and its target; TT214 goes to ``findings``, what
    the loss turned out to be to ``report``."""

    def __init__(self, kind: str | None, target: Any, device: torch.device, inputs: tuple[Any, ...] | dict[str, Any],
                 report: RuntimeReport, findings: list[Finding]) -> None:
        self.kind = kind  # a LOSS_KINDS name, resolved on the first output; None: fn
        self.fn: Callable[..., Any] | None = None  # what the steps call (the checker sets the copy of loss_fn)
        self.target = map_tensors(target, lambda t: t.detach().to(device))
        self.target_note = "given " + describe_inputs(tree_flatten(target)[0]) if target is not None else ""
        self.inputs = inputs
        self.report = report
        self.findings = findings

    def of(self, out: Any, first: bool) -> torch.Tensor:
        """The 0-d loss of the output ``out``; the first step's call (``first``) settles the named loss,
        makes the target when none was given and reports what it did."""
        if first and self.kind is not None:
            self.fn = self._named_loss(out)
        fn = self.fn
        loss = default_loss(out) if fn is None else self._call_loss(fn, out, first)
        return self._scalar_loss(loss, first)

    def _scalar_loss(self, loss: Any, first: bool) -> torch.Tensor:
        """``loss`` as a 0-d tensor (the mean of a non-scalar one, noted on the first step)."""
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise UserError(
                f"loss_fn returned {type(loss).__name__}, not a floating-point tensor: return the loss tensor"
            )
        if loss.numel() != 1:
            if first:
                self.report.notes.append(f"loss_fn returned shape {tuple(loss.shape)}: the check used its mean")
            loss = loss.mean()
        return loss.reshape(())

    def _call_loss(self, fn: Callable[..., Any], out: Any, first: bool) -> Any:
        """``fn(out, target)`` (or ``fn(out)``), making the target on the first step if none was given;
        its warnings become findings or go to the caller."""
        takes_target = _takes_target(fn)
        if takes_target and self.target is None and first:
            self.target, self.target_note = _make_target(fn, out)
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return fn(out, self.target) if takes_target else fn(out)
        except (_LossAbort, UserError):
            raise
        except Exception as exc:
            raise self._loss_error(exc, out) from None
        finally:
            self._loss_warnings(caught, first)

    def _loss_error(self, exc: Exception, out: Any) -> UserError:
        given = describe_inputs(_tensors(self.target)) if self.target is not None else "none"
        hint = "pass target=" if not self.target_note.startswith("given") else "check the target"
        return UserError(
            f"loss_fn failed on output {describe_inputs(_tensors(out))} and target {given} "
            f"({self.target_note or 'none'}): {one_line(exc)}; {hint}"
        )

    def _loss_warnings(self, caught: list[warnings.WarningMessage], first: bool) -> None:
        """Turn torch's "target size different to the input size" warning into a TT214 finding (the
        first step's, once); re-issue every other warning the loss call raised to the caller's filters."""
        for w in caught:
            shapes = _broadcast_shapes(str(w.message))
            reported = self._reported(TARGET_BROADCAST)
            if shapes is None or not (reported or (first and _widens_prediction(shapes))):
                # not ours, or a target repeated along the prediction's dims (or not broadcastable): torch's word
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            elif not reported:  # said once, as a finding
                self.findings.append(self._target_broadcast_finding(*shapes))

    def _reported(self, rule: Rule) -> bool:
        return any(f.rule == rule.id for f in self.findings)

    def _target_broadcast_finding(self, prediction: tuple[int, ...], target: tuple[int, ...],
                                  broadcast: tuple[int, ...]) -> Finding:
        return _finding(
            TARGET_BROADCAST, "(loss)",
            f"{self.report.loss_fn or 'the loss'} compares a prediction of shape {prediction} with a target of "
            f"shape {target}: they broadcast to {broadcast}, so each prediction is compared with every "
            f"target; make the shapes equal (output.squeeze(-1) or target.view_as(output))",
            prediction=list(prediction), target=list(target), broadcast=list(broadcast),
        )

    def _named_loss(self, out: Any) -> Callable[..., torch.Tensor] | None:
        """The torch loss of ``self.kind`` for this output (see :data:`LOSS_KINDS`); makes
        the target a structured or token output needs (a tensor output keeps today's rules)."""
        kind, cls = self.kind, LOSS_KINDS[self.kind]
        if cls is None:
            self.report.loss_fn = "none"
            return None
        if kind == "auto" and self._model_computes_loss(out):
            return _own_loss
        return self._torch_loss(kind, cls, out)

    def _torch_loss(self, kind: str, cls: str, out: Any) -> nn.Module:
        """The ``torch.nn`` loss ``cls`` (of the LOSS_KINDS name ``kind``) for this output."""
        self.report.loss_fn = "cross-entropy" if cls == "CrossEntropyLoss" else kind
        base = getattr(nn, cls)()
        ids = _token_ids(self.inputs, out) if cls in _CLASS_LOSS_NAMES else None
        if isinstance(out, torch.Tensor) and ids is None:
            return base  # a plain tensor: the loss as is, the target from _make_target
        if self.target is None:
            self._structured_target(base, out, ids)
        return _PredictionLoss(base)

    def _model_computes_loss(self, out: Any) -> bool:
        """For loss "auto": the output carries the model's own loss (use it, and say so)."""
        if output_loss(out) is None:  # a UserError when it is not a scalar
            primary_output(out)  # a UserError when the output has no floating-point tensor
            return False
        self.report.loss_fn = "the model's own loss"
        self.target_note = self.target_note or "none: the model computes its loss (labels among the inputs)"
        return True

    def _structured_target(self, base: nn.Module, out: Any, ids: torch.Tensor | None) -> None:
        """The target of a named loss on a structured or token output: next-token ids when the output
        holds token logits of the input ids, else one made from its prediction."""
        if ids is not None:
            self.target = _next_tokens(ids)
            self.target_note = f"generated next-token targets {tuple(ids.shape)} from the input ids"
        else:
            self.target, self.target_note = _make_target(base, primary_output(out))


class _PredictionLoss(nn.Module):
    """A torch loss on the prediction of any output (:func:`torch_tricks.outputs.primary_output`),
    token logits ``(B, T, V)`` flattened against ``(B, T)`` targets (``-100`` ignored)."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        pred = primary_output(out)
        if pred.dim() >= 3 and tuple(target.shape) == tuple(pred.shape[:-1]):
            return self.loss(pred.reshape(-1, pred.shape[-1]), target.reshape(-1))
        return self.loss(pred, target)


def _own_loss(out: Any) -> torch.Tensor:
    """The loss the model computed itself (``out.loss``: a transformers model given labels)."""
    return output_loss(out)


def _loss_name(fn: Any) -> str:
    if fn is None:
        return "none"
    return type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", type(fn).__name__)


def _takes_target(fn: Any) -> bool:
    """False only for a loss function that accepts exactly one positional argument."""
    params = _parameters(fn.forward if isinstance(fn, nn.Module) else fn)
    if params is None or any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2


def _parameters(fn: Any) -> list[inspect.Parameter] | None:
    """The parameters of ``fn``'s signature; None when it has none to read (a builtin)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
