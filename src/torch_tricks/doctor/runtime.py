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
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
import warnings
from collections import deque
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from torch_tricks.batches import map_tensors
from torch_tricks.device import module_device
from torch_tricks.device import resolve as resolve_device
from torch_tricks.doctor.runtime_frozen import frozen_in_train, params_twice
from torch_tricks.doctor.registry import Finding, Rule, findings_count, severity_rank
from torch_tricks.doctor.rules.runtime import (  # noqa: F401  (declared apart: no torch needed to list them)
    MIN_BN_BATCH, UNUSED_PARAMS, DECAY_ON_NO_DECAY, UNREGISTERED, BN_SMALL_BATCH, INPLACE, DIMS, LOSS_PAIRING,
    MODE_MISMATCH, RANDOM_IN_EVAL, NON_FINITE, MEMORY_GROWTH, COUPLED_L2, NOT_OPTIMIZED, TARGET_BROADCAST, RULES,
)
from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.inputs import call_model, describe_inputs, input_tensors, normalize_inputs
from torch_tricks.inspect.memory import leak_check
from torch_tricks.inspect.step import default_loss
from torch_tricks.outputs import output_loss, primary_output
from torch_tricks.train.memory import INPLACE_ACTIVATIONS, inplace_activations
from torch_tricks.train.optim import param_groups

__all__ = ["RuntimeReport", "check_model", "RULES", "MIN_BN_BATCH", "LOSS_KINDS"]

#: Loss names ``check_model`` takes for ``loss_fn`` (and ``doctor --loss``): the shared names of
#: :data:`torch_tricks.outputs.LOSSES` plus two aliases of the doctor's own (``cross-entropy``,
#: ``bce``), each a ``torch.nn`` loss class, whose calls the TT207 rule watches; ``none``: the
#: mean of the outputs. ``auto`` is the model's own ``.loss`` when its output carries one, else
#: cross-entropy.
LOSS_KINDS: dict[str, str | None] = {
    "auto": "CrossEntropyLoss", "ce": "CrossEntropyLoss", "cross-entropy": "CrossEntropyLoss", "nll": "NLLLoss",
    "bce-with-logits": "BCEWithLogitsLoss", "bce": "BCELoss", "mse": "MSELoss", "none": None,
}


@dataclass
class RuntimeReport:
    """What :func:`check_model` found, and the measured facts behind it."""

    findings: list[Finding] = field(default_factory=list)
    device: str = "cpu"
    inputs: str = ""  # shapes and dtypes of the batch
    outputs: str = ""  # of the model's output tensors
    target: str = ""  # "given ...", "generated ...", or why there is none
    loss_fn: str = ""  # the loss the check used: a LOSS_KINDS name ("cross-entropy" for auto/ce), or the callable's
    loss: float | None = None  # of the first step
    steps_run: int = 0
    completed: bool = True  # False when the training step could not run to its end
    error: str = ""  # why not, when not completed
    trainable_parameters: int = 0  # tensors with requires_grad
    parameters_without_grad: list[str] = field(default_factory=list)
    batchnorm_batch: dict[str, int] = field(default_factory=dict)  # BN in training -> batch it saw
    memory: dict[str, Any] | None = None  # the leak check (LeakReport.to_dict())
    skipped: dict[str, str] = field(default_factory=dict)  # check -> why it did not run
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No warning and no error (info notes are allowed)."""
        return all(severity_rank(f.severity) == 0 for f in self.findings)

    def counts(self) -> dict[str, int]:
        """Number of findings per severity."""
        out = {"error": 0, "warning": 0, "info": 0}
        for f in self.findings:
            out[f.severity] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "findings"}
        d["findings"] = [f.to_dict() for f in self.findings]
        d["ok"] = self.ok
        d["counts"] = self.counts()
        return d

    as_dict = to_dict  # the earlier name; every result type of the package says to_dict

    def to_text(self, model_name: str = "model", optimizer: str | None = None,
                findings: Iterable[Finding] | None = None) -> str:
        """The report ``torch-tricks doctor --model`` prints: what ran, one line per finding, the
        count, and the checks that did not run.

        The report does not know what the command line adds: ``model_name`` heads it,
        ``optimizer`` names the optimizer the steps used (None: plain SGD steps), and
        ``findings`` replaces :attr:`findings` (e.g. after ``--select`` / ``--ignore`` and
        the config, :func:`torch_tricks.doctor.static.filter_findings`).
        """
        findings = self.findings if findings is None else list(findings)
        lines = self._header(model_name, optimizer)
        lines.append("")
        lines += [f"{f.rule} {f.severity:<7} {f.path or '-'}: {f.message}" for f in findings]
        lines.append(findings_count(findings))
        lines += [f"not checked: {check}: {why}" for check, why in self.skipped.items()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _header(self, model_name: str, optimizer: str | None) -> list[str]:
        """What ran: the batch, the loss, the steps, and whether they completed."""
        loss = f"{self.loss:.4g}" if self.loss is not None else "-"
        lines = [f"{model_name}: inputs {self.inputs}, outputs {self.outputs or '-'}, target {self.target or '-'}",
                 f"loss ({self.loss_fn}) {loss}, {self.steps_run} training step(s) on {self.device}, "
                 + (f"optimizer {optimizer}" if optimizer else "plain SGD steps")]
        if not self.completed:
            lines.append(f"the training step did not complete: {self.error}")
        return lines


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


# -- the checker ----------------------------------------------------------------------------

#: The named losses over classes: on token logits they train next-token prediction.
_CLASS_LOSS_NAMES = ("CrossEntropyLoss", "NLLLoss")


class _LossAbort(Exception):
    """Raised from inside a loss call whose input would crash it (logits fed to BCELoss)."""


class _Checker:
    """One run of :func:`check_model`: validated arguments, working copies, findings."""

    def __init__(self, model, batch, loss_fn, optimizer, target, steps, device) -> None:
        _check_model_and_steps(model, steps)
        self.loss_kind, loss_fn = _split_loss(loss_fn)  # loss_kind: a LOSS_KINDS name, resolved on the first output
        if optimizer is not None:
            _check_optimizer(optimizer, model)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.steps = steps
        self.device = _resolve_device(device, model)
        self.inputs = _prepare_inputs(batch, self.device)
        self.target = map_tensors(target, lambda t: t.detach().to(self.device))
        self.target_note = "given " + describe_inputs(tree_flatten(target)[0]) if target is not None else ""
        self.findings: list[Finding] = []
        self.report = RuntimeReport(device=str(self.device), inputs=describe_inputs(self.inputs),
                                    loss_fn=self.loss_kind or _loss_name(loss_fn))
        self.called: set[str] = set()  # modules that ran in the first step
        self.unused: set[str] = set()  # parameters without gradient in the first step
        self.opt_can_step = True  # False once step() asked for a closure

    def run(self) -> RuntimeReport:
        self.findings += _unregistered_modules(self.model)
        self.findings += _mode_mismatches(self.model)
        self.findings += _decay_on_no_decay(self.model, self.optimizer)
        self.findings += _coupled_l2(self.optimizer)
        self.findings += params_twice(self.model, self.optimizer) + frozen_in_train(self.model)
        with torch.inference_mode(False), torch.enable_grad(), _forked_rng(self.device), _parked_grads(self.model):
            self._make_copies()
            if self._first_step():
                if self.steps >= 2:
                    self._memory_growth()
                else:
                    self.report.skipped["memory-growth"] = "steps=1: at least 2 steps are needed to see a trend"
                self.findings += _not_optimized(self.model, self.optimizer, exclude=self.unused)
            else:
                for check in ("unused-parameters", "non-finite-gradients", "memory-growth",
                              "trainable-not-in-optimizer"):
                    self.report.skipped[check] = "the training step did not complete: " + self.report.error
            self._random_in_eval()
            self._inplace_candidates()
        self.report.findings = sorted(self.findings, key=lambda f: (-severity_rank(f.severity), f.rule, f.path))
        return self.report

    # -- working copies ------------------------------------------------------------------

    def _make_copies(self) -> None:
        """Deep copies of model, optimizer and loss function (one memo: the optimizer copy
        holds the model copy's parameters, a bound-method loss its model copy), on the device
        and in train mode."""
        self._deep_copies()
        self._move_copies()
        if not self.model.training:
            self.work.train()
            self.report.notes.append("the model was in eval mode: the check trained a copy in train mode")
        trainable = self._trainable()
        if self.work_opt is None:
            self.work_opt = torch.optim.SGD(trainable, lr=1e-3)

    def _trainable(self) -> list[nn.Parameter]:
        """The working copy's trainable parameters (counted in the report); a UserError when there are none."""
        trainable = [p for p in self.work.parameters() if p.requires_grad]
        self.report.trainable_parameters = len(trainable)
        if not trainable:
            raise UserError(
                "the model has no trainable parameters (all requires_grad=False): "
                "check_model runs a training step; unfreeze the layers to train"
            )
        return trainable

    def _deep_copies(self) -> None:
        try:
            self.work, self.work_opt, self.work_loss = copy.deepcopy((self.model, self.optimizer, self.loss_fn))
        except Exception:
            try:
                self.work, self.work_opt = copy.deepcopy((self.model, self.optimizer))
            except Exception as exc:
                raise UserError(
                    f"cannot deep-copy the model or optimizer ({type(exc).__name__}: {one_line(exc)}): "
                    "check_model trains a copy so your weights stay untouched; remove the un-copyable attribute"
                ) from None
            self.work_loss = self.loss_fn
            self.report.notes.append("loss_fn could not be deep-copied: the check called the original")

    def _move_copies(self) -> None:
        if module_device(self.work) != self.device:
            self.work.to(self.device)
            if self.work_opt is not None:  # optimizer state follows its parameters' device
                self.work_opt.load_state_dict(self.work_opt.state_dict())
        if isinstance(self.work_loss, nn.Module):
            self.work_loss.to(self.device)

    def _fresh_inputs(self) -> tuple[Any, ...] | dict[str, Any]:
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.inputs)

    # -- the instrumented first step -----------------------------------------------------

    def _first_step(self) -> bool:
        """Forward with hooks, loss, backward, optimizer step; False if it could not finish."""
        work, opt = self.work, self.work_opt
        inputs = self._fresh_inputs()
        opt.zero_grad(set_to_none=True)
        rec = _Recorder(work, inputs)
        watch = _LossWatch()
        try:
            with rec, watch:
                out = self._forward(inputs, rec)
                loss = self._loss(out, first=True)
        except _LossAbort as abort:
            self._aborted(abort, rec, watch)
            return False
        self._completed_first_step(out, loss, rec)
        forward_finite = self._forward_findings(rec, out, loss)
        self._pairing_findings(watch, rec)

        trainable = [(n, p) for n, p in work.named_parameters() if p.requires_grad]
        _backward(loss)
        self._gradient_findings(rec, trainable, forward_finite)
        self._optimizer_step()
        del rec, watch, out, loss
        return True

    def _forward(self, inputs: tuple[Any, ...] | dict[str, Any], rec: "_Recorder") -> Any:
        """The working copy's output; a UserError naming the failing module if the forward raises."""
        try:
            return call_model(self.work, inputs)
        except _LossAbort:
            raise
        except Exception as exc:
            raise self._forward_error(exc, rec) from None

    def _completed_first_step(self, out: Any, loss: torch.Tensor, rec: "_Recorder") -> None:
        """Record what the first step's forward and loss gave."""
        self.report.steps_run = 1
        self.report.outputs = describe_inputs(_tensors(out))
        self.report.loss = float(loss.detach().float())
        self.report.target = self.target_note or ("none: loss_fn takes the output only" if self.work_loss else
                                                  "none: no loss_fn, the loss is the mean of the outputs")
        self.called = {c.name for c in rec.calls}

    def _aborted(self, abort: _LossAbort, rec: "_Recorder", watch: "_LossWatch") -> None:
        """Record a first step that stopped in the loss, and what its forward showed."""
        self.report.completed = False
        self.report.error = str(abort)
        self.report.target = self.target_note
        self._forward_findings(rec, None, None)
        self._pairing_findings(watch, rec)
        self.called = {c.name for c in rec.calls}

    def _optimizer_step(self) -> None:
        if not self.opt_can_step:
            return
        try:
            self.work_opt.step()
        except TypeError as exc:  # LBFGS and friends want a closure
            self.opt_can_step = False
            self.report.notes.append(
                f"the optimizer's step() needs arguments ({one_line(exc)}): steps ran without it"
            )

    def _plain_step(self) -> None:
        """A training step without instrumentation (for the leak check): keeps nothing."""
        self.work_opt.zero_grad(set_to_none=True)
        out = call_model(self.work, self._fresh_inputs())
        loss = self._loss(out, first=False)
        if loss.requires_grad:
            loss.backward()
        self._optimizer_step()

    def _loss(self, out: Any, first: bool) -> torch.Tensor:
        if first and self.loss_kind is not None:
            self.work_loss = self._named_loss(out)
        fn = self.work_loss
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
        """The torch loss of ``self.loss_kind`` for this output (see :data:`LOSS_KINDS`); makes
        the target a structured or token output needs (a tensor output keeps today's rules)."""
        kind, cls = self.loss_kind, LOSS_KINDS[self.loss_kind]
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

    def _forward_error(self, exc: Exception, rec: "_Recorder") -> UserError:
        where, fix = _failing_module(rec)
        hint = ""
        unregistered = [f.path for f in self.findings if f.rule == UNREGISTERED.id]
        if unregistered and "device" in str(exc):
            hint = f" (note: the unregistered modules in {', '.join(unregistered)} are not moved by .to())"
        return UserError(
            f"the model fails on inputs {describe_inputs(self.inputs)}{where}: {one_line(exc)}; "
            f"{fix}{hint}"
        )

    # -- findings of the first step ----------------------------------------------------------

    def _forward_findings(self, rec: "_Recorder", out: Any, loss: torch.Tensor | None) -> bool:
        """BatchNorm batches, layer dims, non-finite forward values; True if all finite."""
        self.report.batchnorm_batch = dict(rec.bn_batch)
        self.findings += _small_batch_findings(rec.bn_batch)
        self.findings += _dim_findings(rec, out)
        nonfinite = _first_nonfinite_finding(self.inputs, rec, loss)
        if nonfinite is None:
            return True
        self.findings.append(nonfinite)
        return False

    def _pairing_findings(self, watch: "_LossWatch", rec: "_Recorder") -> None:
        seen: set[tuple[str, str, str]] = set()
        for loss_name, x, producer in watch.calls:
            verdict = _pairing_verdict(loss_name, x, producer)
            if verdict is None:
                continue
            kind, severity, advice = verdict
            where = _producer_path(x, rec)
            if (loss_name, kind, where) in seen:
                continue
            seen.add((loss_name, kind, where))
            self.findings.append(_finding(
                LOSS_PAIRING, where,
                f"{loss_name} gets {kind} from '{where}': {advice}",
                severity=severity, loss=loss_name, input_kind=kind,
            ))

    def _gradient_findings(
        self, rec: "_Recorder", trainable: list[tuple[str, nn.Parameter]], forward_finite: bool
    ) -> None:
        """Parameters without gradient (TT201) and the first non-finite gradient (TT210)."""
        self._unused_parameter_findings(trainable)
        bad = _nonfinite_grads(trainable)
        if not bad or not forward_finite:
            return
        path, how = _nonfinite_grad_source(rec, self.work, bad)
        self.findings.append(_finding(
            NON_FINITE, path,
            f"gradients become NaN/Inf {how} although the forward pass is finite: "
            f"{_count(bad, 'parameter gradient')} non-finite ({_short(bad)})",
            stage="backward", params=bad,
        ))

    def _unused_parameter_findings(self, trainable: list[tuple[str, nn.Parameter]]) -> None:
        """TT201: one finding when no parameter gets a gradient, else one per group of them."""
        unused = _without_grad(trainable)
        unused_ids = {id(p) for _, p in unused}
        self.report.parameters_without_grad = [n for n, _ in unused]
        self.unused = set(self.report.parameters_without_grad)
        if trainable and len(unused_ids) == len(trainable):
            self.findings.append(_finding(
                UNUSED_PARAMS, "(model)",
                "no trainable parameter gets a gradient: the loss does not depend on them "
                "(an output computed under torch.no_grad(), .detach() or .data?)",
                params=len(trainable),
            ))
        elif unused_ids:
            self._unused_group_findings(unused_ids)

    def _unused_group_findings(self, unused_ids: set[int]) -> None:
        """TT201 for each group of parameters (a submodule, else a single one) without gradient."""
        decay = _decay_by_name(self.model, self.optimizer)
        for path, module, names, numel in _group_params(self.work, unused_ids):
            self.findings.append(self._unused_group_finding(path, module, names, numel, decay))

    def _unused_group_finding(self, path: str, module: nn.Module | None, names: list[str], numel: int,
                              decay: dict[str, float]) -> Finding:
        """TT201 for one group of parameters without gradient, saying whether weight decay still
        shrinks them (a zero .grad instead of None) or the optimizer does not hold them."""
        wds = _decays(names, decay)
        msg = (f"{_describe_group(path, module)} gets no gradient: {_count(names, 'parameter')} ({numel:,} values) "
               "never trained")
        if wds:
            msg += _still_decayed(names, wds)
        elif self.optimizer is not None and not any(n in decay for n in names):
            msg += f" (the optimizer does not hold {_them(names)})"
        return _finding(UNUSED_PARAMS, path, msg, params=names, weight_decay=wds[-1] if wds else 0.0)

    # -- later checks ------------------------------------------------------------------------

    def _memory_growth(self) -> None:
        before = _growable_sizes(self.work, self.work_loss)
        rep = self._leak_check()
        if rep is None or not rep.leaking:
            return
        after = _growable_sizes(self.work, self.work_loss)
        grown = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
        self.findings += _growth_findings(rep, grown, self.steps + 1)

    def _leak_check(self) -> Any:
        """The leak check's report on ``steps`` plain steps after a warm-up; None if a step failed."""
        cuda = self.device.type == "cuda"
        try:
            rep = leak_check(self._plain_step, steps=self.steps, warmup=1, device=self.device if cuda else None)
        except UserError:
            raise
        except Exception as exc:
            self.report.skipped["memory-growth"] = f"a later training step failed: {one_line(exc)}"
            return None
        self.report.steps_run += self.steps + 1
        self.report.memory = rep.to_dict()
        return rep

    def _random_in_eval(self) -> None:
        """Two eval-mode forwards of the same batch must agree (TT209)."""
        runs = self._eval_twice()
        if runs is None:
            return
        first, second = runs
        if _same(first.output, second.output) and len(first.calls) == len(second.calls):
            return
        found = _first_random_call(first, second)
        where, module = found if found is not None else ("(model)", self.work)
        self.findings.append(_finding(
            RANDOM_IN_EVAL, where,
            f"two eval-mode forwards of the same batch differ, first in '{where}' ({_describe_module(module)}): "
            "something random ignores eval(), e.g. F.dropout(x, p) without training=self.training",
        ))

    def _eval_twice(self) -> tuple[_Fingerprints, _Fingerprints] | None:
        """Two no-grad eval-mode forwards of the same batch (the modes restored after); None if they fail."""
        work = self.work
        modes = [(m, m.training) for m in work.modules()]
        work.eval()
        try:
            with torch.no_grad():
                return _Fingerprints.run(work, self._fresh_inputs()), _Fingerprints.run(work, self._fresh_inputs())
        except Exception as exc:
            self.report.skipped["random-output-in-eval"] = f"the eval-mode forward failed: {one_line(exc)}"
            return None
        finally:
            for m, mode in modes:
                m.training = mode

    def _inplace_candidates(self) -> None:
        """Activations that ran and that the T9 trick would make inplace (judged safe)."""
        work = self.work
        not_inplace = _not_inplace(work)
        if not not_inplace:
            return
        ran = not_inplace & self.called
        try:
            inplace_activations(work)
        except Exception as exc:
            self.report.skipped["activation-could-be-inplace"] = f"the model could not be analysed: {one_line(exc)}"
            return
        for name, m in work.named_modules():
            if name in ran and m.inplace:
                self.findings.append(_finding(
                    INPLACE, name,
                    f"'{name}' ({type(m).__name__}) could run inplace: its input is a fresh tensor nothing else reads; "
                    "set inplace=True",
                ))


# -- arguments ------------------------------------------------------------------------------

def _check_model_and_steps(model: Any, steps: Any) -> None:
    if not isinstance(model, nn.Module):
        raise UserError(f"check_model needs an nn.Module, got {type(model).__name__}: pass the model")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UserError(f"steps must be an integer >= 1, got {steps!r}")


def _split_loss(loss_fn: Any) -> tuple[str | None, Callable[..., torch.Tensor] | None]:
    """(LOSS_KINDS name, None) for a loss given by name, (None, loss_fn) for a callable or None."""
    if isinstance(loss_fn, str):
        kind = loss_fn.lower().replace("_", "-")
        if kind not in LOSS_KINDS:
            raise UserError(f"unknown loss {loss_fn!r}: choose one of {', '.join(LOSS_KINDS)}")
        return kind, None
    if loss_fn is not None and not callable(loss_fn):
        raise UserError(f"loss_fn must be callable (e.g. nn.CrossEntropyLoss()), got {type(loss_fn).__name__}")
    return None, loss_fn


def _check_optimizer(optimizer: Any, model: nn.Module) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}: "
            "pass the optimizer instance"
        )
    model_ids = {id(p) for p in model.parameters()}
    if not any(id(p) in model_ids for p in _optimizer_params(optimizer)):
        raise UserError(
            "the optimizer holds none of the model's parameters: pass the optimizer built on this model"
        )


# -- findings and messages of the checker ---------------------------------------------------

def _failing_module(rec: "_Recorder") -> tuple[str, str]:
    """(where, fix) for a forward that raised: the innermost module running, and what to change."""
    where, fix = "", "pass a batch of the shape the model expects, batch dimension first"
    if rec.stack:
        c = rec.stack[-1]
        given = ", ".join(str(s) for s in c.in_shapes) or "no tensor"
        where = f" in '{_display(c.name)}' ({_describe_module(c.module)}, given {given})"
        if isinstance(c.module, nn.modules.batchnorm._BatchNorm) and c.module.training:
            fix = f"BatchNorm in training needs a batch of 2 or more ({MIN_BN_BATCH}+ for stable statistics)"
    return where, fix


def _small_batch_findings(bn_batch: dict[str, int]) -> list[Finding]:
    """TT204: one finding per batch size below MIN_BN_BATCH, naming the BatchNorm layers that saw it."""
    by_batch: dict[int, list[str]] = {}
    for name, n in bn_batch.items():
        if n < MIN_BN_BATCH:
            by_batch.setdefault(n, []).append(name)
    return [_finding(
        BN_SMALL_BATCH, names[0],
        f"{_count(names, 'BatchNorm layer')} {'normalise' if len(names) > 1 else 'normalises'} "
        f"over a per-device batch of {n} in training ({_short(names)}): statistics from fewer than "
        f"{MIN_BN_BATCH} samples are noisy; use a larger batch, SyncBatchNorm or GroupNorm",
        modules=names, batch=n,
    ) for n, names in sorted(by_batch.items())]


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


def _nonfinite_grads(named: list[tuple[str, nn.Parameter]]) -> list[str]:
    """The names of the parameters whose gradient holds NaN/Inf."""
    return [n for n, p in named if p.grad is not None and not _finite(p.grad)]


def _without_grad(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in named if p.grad is None]


def _decays(names: list[str], decay: dict[str, float]) -> list[float]:
    """The distinct positive weight decays the optimizer applies to the parameters ``names``, ascending."""
    return sorted({decay[n] for n in names if decay.get(n, 0) > 0})


def _still_decayed(names: list[str], wds: list[float]) -> str:
    """Why parameters without gradient that the optimizer decays (by ``wds``) still change."""
    return (f"; the optimizer still holds {_them(names)} with weight_decay="
            f"{_slashed(wds)}, which shrinks them towards zero whenever their "
            ".grad is a zero tensor instead of None")


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


def _first_random_call(first: "_Fingerprints", second: "_Fingerprints") -> tuple[str, nn.Module] | None:
    """(path, module) of the first module call that, given the same inputs in both runs, gave different
    outputs; None when the runs called different modules or none differs."""
    if len(first.calls) != len(second.calls):
        return None
    for (name, mod, fin, fout), (_, _, sin, sout) in zip(first.calls, second.calls):
        if _same(fin, sin) and not _same(fout, sout):
            return _display(name), mod
    return None


def _not_inplace(model: nn.Module) -> set[str]:
    """The activations of ``model`` that have an ``inplace`` switch, off."""
    return {n for n, m in model.named_modules()
            if isinstance(m, INPLACE_ACTIVATIONS) and hasattr(m, "inplace") and not m.inplace}


# -- checks on the caller's objects (read only) ---------------------------------------------

_MODULE_INTERNALS = frozenset(vars(nn.Module()))


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


def _coupled_decays(optimizer: torch.optim.Optimizer) -> list[float]:
    """The distinct non-zero weight decays of the param groups that do not decouple it, ascending."""
    return sorted({_weight_decay(g) for g in optimizer.param_groups if not g.get("decoupled_weight_decay", False)}
                  - {0.0})


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


def _not_held(model: nn.Module, optimizer: torch.optim.Optimizer, exclude: set[str]) -> set[int]:
    """The trainable parameters (ids) of ``model`` that ``optimizer`` does not hold, those named
    in ``exclude`` aside."""
    held = {id(p) for p in _optimizer_params(optimizer)}
    return {id(p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in held and n not in exclude}


def _describe_group(path: str, module: nn.Module | None) -> str:
    """A group of parameters of :func:`_group_params`: a submodule, or a single parameter."""
    return f"'{path}' ({type(module).__name__})" if module is not None else f"parameter '{path}'"


# -- instrumentation -------------------------------------------------------------------------

@dataclass(eq=False)
class _Call:
    """One module call in the instrumented forward."""

    name: str
    module: nn.Module
    in_shapes: list[tuple[int, ...]]
    producers: list[int]  # indices of the calls that returned this call's tensor inputs
    in_finite: bool
    takes_model_input: bool
    index: int = -1  # completion order
    outputs: list[torch.Tensor] = field(default_factory=list)
    out_finite: bool = True
    out_grad_finite: bool | None = None  # None: no gradient reached the outputs


class _Recorder:
    """Forward pre/post hooks on every module of the working copy, for the first step."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...]) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.inputs = _tensors(inputs)
        self.calls: list[_Call] = []
        self.stack: list[_Call] = []  # modules running now, innermost last
        self.produced: dict[int, int] = {}  # id(tensor) -> index of the call that returned it
        self.bn_batch: dict[str, int] = {}
        self.first_nonfinite: _Call | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "_Recorder":
        for m in self.model.modules():  # with kwargs: keyword inputs (attention masks ...) count too
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = _tensors((args, kwargs))
        call = self._new_call(module, tensors)
        n = _batchnorm_batch(module, tensors)
        if n is not None:
            self.bn_batch[call.name] = min(self.bn_batch.get(call.name, n), n)
        self.stack.append(call)

    def _new_call(self, module: nn.Module, tensors: list[torch.Tensor]) -> _Call:
        return _Call(
            name=self.names.get(id(module), "?"),
            module=module,
            in_shapes=[tuple(t.shape) for t in tensors],
            producers=[self.produced[id(t)] for t in tensors if id(t) in self.produced],
            in_finite=all(_finite(t) for t in tensors),
            takes_model_input=self._any_model_input(tensors),
        )

    def _any_model_input(self, tensors: list[torch.Tensor]) -> bool:
        """One of ``tensors`` is one of the model's input tensors itself."""
        return any(t is x for t in tensors for x in self.inputs)

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        call = self._finish(module)
        if call is None:
            return
        call.outputs = _tensors(output)
        call.out_finite = all(_finite(t) for t in call.outputs)
        if not call.out_finite and call.in_finite and self.first_nonfinite is None:
            self.first_nonfinite = call
        self._track_outputs(call)

    def _track_outputs(self, call: _Call) -> None:
        """Remember which call made each output, and watch the gradients that reach them."""
        for t in call.outputs:
            self.produced[id(t)] = call.index
            if t.requires_grad and t.grad_fn is not None and t.is_floating_point():
                t.register_hook(functools.partial(_note_grad, call))

    def _finish(self, module: nn.Module) -> _Call | None:
        """The running call of ``module``, taken off the stack and numbered in completion order."""
        while self.stack and self.stack[-1].module is not module:
            self.stack.pop()  # a call that raised and was caught inside forward
        if not self.stack:
            return None
        call = self.stack.pop()
        call.index = len(self.calls)
        self.calls.append(call)
        return call


def _batchnorm_batch(module: nn.Module, tensors: list[torch.Tensor]) -> int | None:
    """The per-device batch a BatchNorm in training normalises over (not a SyncBatchNorm's)."""
    if (isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
            and module.training and tensors and tensors[0].dim() >= 2):
        return int(tensors[0].shape[0])
    return None


def _note_grad(call: _Call, grad: torch.Tensor) -> None:
    ok = _finite(grad)
    call.out_grad_finite = ok if call.out_grad_finite is None else (call.out_grad_finite and ok)


_LOSS_FUNCTIONS = {
    F.cross_entropy: "CrossEntropyLoss",
    F.nll_loss: "NLLLoss",
    F.binary_cross_entropy: "BCELoss",
    F.binary_cross_entropy_with_logits: "BCEWithLogitsLoss",
}


class _LossWatch(TorchFunctionMode):
    """Sees the input of every cross-entropy / NLL / BCE call, however the loss is wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.Tensor, str | None]] = []  # loss, input, op that made it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _LOSS_FUNCTIONS.get(func)
        x = _loss_input(args, kwargs) if name is not None else None
        if x is not None:
            d = x.detach()
            self.calls.append((name, d, _producer_op(x)))
            if name == "BCELoss" and _outside_unit(d):
                # BCELoss would raise (a device-side assert on CUDA): stop before it.
                raise _LossAbort(
                    f"BCELoss got values in [{float(d.min()):.3g}, {float(d.max()):.3g}], outside [0, 1]"
                )
        return func(*args, **kwargs)


def _loss_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The input (prediction) tensor of a loss function's call."""
    x = args[0] if args else kwargs.get("input")
    return x if isinstance(x, torch.Tensor) else None


def _outside_unit(x: torch.Tensor) -> bool:
    """``x`` is finite, not empty, and has values outside [0, 1] (it cannot be probabilities)."""
    return bool(x.numel()) and _finite(x) and (bool(x.min() < 0) or bool(x.max() > 1))


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


# -- analysis helpers ------------------------------------------------------------------------

def _pairing_verdict(loss_name: str, x: torch.Tensor, producer: str | None) -> tuple[str, str, str] | None:
    """(what the input is, severity, advice) when it does not suit ``loss_name``; else None.
    ``producer`` is the autograd op that made ``x`` (None when unknown)."""
    if loss_name == "CrossEntropyLoss":
        return _cross_entropy_verdict(x)
    if loss_name == "NLLLoss":
        return _nll_verdict(x, producer)
    if loss_name == "BCEWithLogitsLoss":
        return _bce_with_logits_verdict(x, producer)
    if loss_name == "BCELoss":
        return _bce_verdict(x)
    return None


def _cross_entropy_verdict(x: torch.Tensor) -> tuple[str, str, str] | None:
    """CrossEntropyLoss wants raw logits: log-probabilities are redundant, probabilities squashed."""
    kind = _distribution(x, 1 if x.dim() >= 2 else 0)
    if kind == "log-probabilities":
        return (kind + " (log_softmax output)", "warning",
                "CrossEntropyLoss applies log_softmax itself, so the model's log_softmax is redundant; "
                "return raw logits, or keep log_softmax and use NLLLoss")
    if kind == "probabilities":
        return (kind + " (softmax output)", "error",
                "CrossEntropyLoss applies log_softmax on top, which squashes the loss and its gradients; "
                "return raw logits")
    return None


def _nll_verdict(x: torch.Tensor, producer: str | None) -> tuple[str, str, str] | None:
    """NLLLoss wants log-probabilities: not raw logits, not probabilities."""
    if producer and producer.startswith("LogSoftmax"):
        return None
    kind = _distribution(x, 1 if x.dim() >= 2 else 0)
    if kind == "logits":
        return ("raw logits", "error",
                "NLLLoss expects log-probabilities; add log_softmax, or use CrossEntropyLoss on the logits")
    if kind == "probabilities":
        return ("probabilities (softmax output)", "error",
                "NLLLoss expects log-probabilities; use log_softmax instead of softmax")
    return None


def _bce_with_logits_verdict(x: torch.Tensor, producer: str | None) -> tuple[str, str, str] | None:
    """BCEWithLogitsLoss wants logits: a sigmoid / softmax output (or values all in [0, 1]) is squashed twice."""
    squashed = producer is not None and (producer.startswith(("Sigmoid", "Softmax")))
    if squashed or _all_in_unit(x):
        return ("probabilities" + (f" ({producer.removesuffix('Backward0').lower()} output)" if squashed else ""),
                "error",
                "BCEWithLogitsLoss applies the sigmoid itself, so the output is squashed twice; drop the sigmoid")
    return None


def _all_in_unit(x: torch.Tensor) -> bool:
    """Enough values (32 or more) to judge, all finite and in [0, 1]: they look like probabilities."""
    return x.numel() >= 32 and _finite(x) and bool(x.min() >= 0) and bool(x.max() <= 1)


def _bce_verdict(x: torch.Tensor) -> tuple[str, str, str] | None:
    """BCELoss wants probabilities: values outside [0, 1] are logits."""
    if _outside_unit(x):
        return ("values outside [0, 1] (raw logits)", "error",
                "BCELoss expects probabilities; drop the BCELoss for BCEWithLogitsLoss on the logits "
                "(numerically stable), or apply sigmoid")
    return None


def _distribution(x: torch.Tensor, dim: int) -> str | None:
    """'log-probabilities', 'probabilities' or 'logits' along ``dim``; None if undecidable."""
    if not _judgeable(x, dim):
        return None
    x = x.detach().float()
    tol = 1e-3 if x.dtype in (torch.float32, torch.float64) else 3e-2
    if _log_probabilities(x, dim, tol):
        return "log-probabilities"
    if _probabilities(x, dim, tol):
        return "probabilities"
    return "logits"


def _judgeable(x: torch.Tensor, dim: int) -> bool:
    """A finite floating-point tensor with two or more entries along ``dim``."""
    return x.dim() > 0 and x.shape[dim] >= 2 and x.is_floating_point() and _finite(x)


def _log_probabilities(x: torch.Tensor, dim: int, tol: float) -> bool:
    """No positive value and a logsumexp of 0 along ``dim``, within ``tol``."""
    return float(x.max()) <= tol and bool((torch.logsumexp(x, dim).abs() <= tol).all())


def _probabilities(x: torch.Tensor, dim: int, tol: float) -> bool:
    """Values in [0, 1] that sum to 1 along ``dim``, within ``tol``."""
    return float(x.min()) >= -tol and float(x.max()) <= 1 + tol and bool(((x.sum(dim) - 1).abs() <= tol).all())


_VIEW_OPS = ("View", "UnsafeView", "Reshape", "Squeeze", "Unsqueeze", "Permute", "Transpose", "TBackward",
             "Clone", "Select", "Slice", "Expand", "Alias", "ToCopy", "AsStrided")


def _producer_op(t: torch.Tensor) -> str | None:
    """Name of the autograd node that made ``t``, looking through views and copies."""
    fn = t.grad_fn
    for _ in range(16):
        if fn is None:
            return None
        name = type(fn).__name__
        if not name.startswith(_VIEW_OPS):
            return name
        fn = _first_input_node(fn)
    return None


def _first_input_node(fn: Any) -> Any:
    """The autograd node of the first differentiable input of ``fn``, else None."""
    nxt = [f for f, _ in fn.next_functions if f is not None]
    return nxt[0] if nxt else None


def _producer_path(x: torch.Tensor, rec: _Recorder) -> str:
    """The innermost module whose output ``x`` is (a container returns its last child's
    tensor; an inplace activation returns its producer's, so the later call wins), else
    the loss function, which then made ``x`` itself."""
    try:
        ptr = x.untyped_storage().data_ptr()
    except Exception:
        return "(loss)"
    c = _innermost_last([call for call in rec.calls if _returns_storage(call, ptr)])
    return _display(c.name) if c is not None else "(loss)"


def _returns_storage(call: _Call, ptr: int) -> bool:
    """One of the outputs of ``call`` lives in the storage at ``ptr``."""
    try:
        return any(t.untyped_storage().data_ptr() == ptr for t in call.outputs)
    except Exception:
        return False


def _innermost_last(calls: list[_Call]) -> _Call | None:
    """The last to complete of the ``calls`` of modules that contain none of the others' modules."""
    names = {c.name for c in calls}
    inner = [c for c in calls if not any(_is_ancestor(c.name, o) for o in names)]
    return max(inner, key=lambda c: c.index) if inner else None


def _is_ancestor(name: str, other: str) -> bool:
    """``name`` is a strict ancestor of ``other`` in the module tree ("" is the root)."""
    return name != other and (name == "" or other.startswith(name + "."))


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


_MATMUL_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.RNNBase)


def _dim_findings(rec: _Recorder, out: Any) -> list[Finding]:
    """Linear / conv / RNN dims that are not multiples of 8 (TT206), data-fixed dims excepted."""
    layer_calls = [c for c in rec.calls if isinstance(c.module, _MATMUL_LAYERS)]
    if not layer_calls:
        return []
    first_layer, heads = _data_fixed_layers(layer_calls, out)
    findings = []
    for c in _first_call_of_each(layer_calls):
        bad = _not_multiples_of_8(_free_dims(_tensor_core_dims(c.module), c.name in first_layer, c.name in heads))
        if bad:
            findings.append(_dim_finding(c, bad))
    return findings


def _not_multiples_of_8(dims: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(k, v) for k, v in dims if v % 8]


def _first_call_of_each(calls: list[_Call]) -> list[_Call]:
    """The first call of each module (a module called several times is judged once)."""
    first: dict[str, _Call] = {}
    for c in calls:
        first.setdefault(c.name, c)
    return list(first.values())


def _dim_finding(c: _Call, bad: list[tuple[str, int]]) -> Finding:
    return _finding(
        DIMS, c.name,
        f"'{c.name}' ({type(c.module).__name__}): {', '.join(f'{k}={v}' for k, v in bad)} "
        f"{'is not a multiple' if len(bad) == 1 else 'are not multiples'} of 8 "
        "(tensor cores want multiples of 8 in fp16/bf16)",
        dims=dict(bad),
    )


def _data_fixed_layers(layer_calls: list, out: Any) -> tuple[set[str], set[str]]:
    """The names of the layers whose input the data fixes (fed the model's input) and of those
    whose output it fixes (the last layer, and any whose output the model returns)."""
    outs = {id(t) for t in _tensors(out)}
    heads = {layer_calls[-1].name} | {c.name for c in layer_calls if _returns_any(c, outs)}
    return {c.name for c in layer_calls if c.takes_model_input}, heads


def _returns_any(call: _Call, ids: set[int]) -> bool:
    """One of the outputs of ``call`` is among the tensors ``ids``."""
    return any(id(t) in ids for t in call.outputs)


def _free_dims(dims: list[tuple[str, int]], takes_input: bool, gives_output: bool) -> list[tuple[str, int]]:
    """The dims the model's author chose: not the input size of a layer fed the model's input, nor
    the output size of a head (the data fixes those)."""
    if takes_input:
        dims = [d for d in dims if not d[0].startswith(("in_", "input_"))]
    if gives_output:
        dims = [d for d in dims if not d[0].startswith("out_")]
    return dims


def _tensor_core_dims(m: nn.Module) -> list[tuple[str, int]]:
    """(name, size) of the dimensions of a layer's matrix multiply: none for a depthwise conv, and
    not a conv's image-like input channels (RGB, RGBA, grey)."""
    if isinstance(m, nn.Linear):
        return [("in_features", m.in_features), ("out_features", m.out_features)]
    if isinstance(m, nn.modules.conv._ConvNd):
        return _conv_dims(m)
    if isinstance(m, nn.RNNBase):
        return [("input_size", m.input_size), ("hidden_size", m.hidden_size)]
    return []


def _conv_dims(m: nn.modules.conv._ConvNd) -> list[tuple[str, int]]:
    if m.groups > 1 and m.groups == m.in_channels:
        return []  # depthwise: no matrix multiply to feed tensor cores
    per = " per group" if m.groups > 1 else ""
    dims = [(f"in_channels{per}", m.in_channels // m.groups),
            (f"out_channels{per}", m.out_channels // m.groups)]
    return dims[1:] if dims[0][1] <= 4 else dims  # image-like input channels (RGB, RGBA, grey)


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


# -- small helpers ---------------------------------------------------------------------------

def _finding(rule: Rule, path: str, message: str, *, severity: str = "", **extra: Any) -> Finding:
    # The severity is passed explicitly: Finding would otherwise look the rule up in the
    # full registry, which imports the static checker as well.
    return Finding(rule.id, message, path=path, severity=severity or rule.severity, extra=extra)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    return (p for g in optimizer.param_groups for p in g["params"])


def _backward(loss: torch.Tensor) -> None:
    if not loss.requires_grad:
        return
    try:
        loss.backward()
    except Exception as exc:
        raise UserError(f"backward of the training step failed: {one_line(exc)}") from None


def _resolve_device(device: torch.device | str | None, model: nn.Module) -> torch.device:
    if device is None:
        return module_device(model)
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _prepare_inputs(batch: Any, device: torch.device) -> tuple[Any, ...] | dict[str, Any]:
    """Positional (a tuple) or keyword (a dict) inputs, tensors possibly nested in lists/dicts,
    detached onto ``device``; they are cloned again for every step."""
    inputs = normalize_inputs(batch)
    _check_batch(inputs)
    return tree_map(lambda t: t.detach().to(device) if isinstance(t, torch.Tensor) else t, inputs)


def _check_batch(inputs: tuple[Any, ...] | dict[str, Any]) -> None:
    """The inputs hold a tensor, and every tensor has a batch dimension with a sample."""
    tensors = _tensors(inputs)
    if not tensors:
        raise UserError(f"the batch holds no tensor (got {describe_inputs(inputs) or 'nothing'}): "
                        "pass the input tensor, a tuple of the model's inputs, or a dict of keyword inputs")
    for t in tensors:
        if t.dim() == 0 or t.shape[0] == 0:
            raise UserError(f"the batch has shape {tuple(t.shape)}: give at least one sample, batch dimension first")


class _parked_grads:
    """Detach the caller's ``.grad`` tensors for the duration of the check and put the same
    objects back afterwards: a loss function or hook that closes over the caller's model
    (an L2 term on ``model.parameters()``) would otherwise accumulate into them."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads: list[torch.Tensor | None] = []

    def __enter__(self) -> None:
        self.grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def __exit__(self, *exc: Any) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g


class _forked_rng:
    """Fork the global RNG (CPU and this CUDA device) and seed it, so the check is
    reproducible and the caller's random stream continues as if nothing ran."""

    def __init__(self, device: torch.device) -> None:
        self.devices = [device.index] if device.type == "cuda" else []
        self._ctx = None

    def __enter__(self) -> None:
        self._ctx = torch.random.fork_rng(devices=self.devices)
        self._ctx.__enter__()
        torch.random.default_generator.manual_seed(0)
        for i in self.devices:
            torch.cuda.default_generators[i].manual_seed(0)

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


_CLASS_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss, nn.MultiMarginLoss, F.cross_entropy, F.nll_loss)
_BINARY_LOSSES = (nn.BCELoss, nn.BCEWithLogitsLoss, nn.MultiLabelSoftMarginLoss,
                  F.binary_cross_entropy, F.binary_cross_entropy_with_logits)


_SIZES = re.compile(r"target size \(torch\.Size\(\[([\d, ]*)\]\)\) that is different to the input size "
                    r"\(torch\.Size\(\[([\d, ]*)\]\)\)")


def _broadcast_shapes(message: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None] | None:
    """(prediction, target, broadcast shape or None) from torch's "Using a target size ... that is
    different to the input size ..." warning of the elementwise losses; None for any other message."""
    m = _SIZES.search(message)
    if m is None:
        return None
    target, prediction = (tuple(int(d) for d in g.split(",") if d.strip()) for g in m.groups())
    try:
        broadcast = tuple(torch.broadcast_shapes(prediction, target))
    except RuntimeError:
        broadcast = None  # not broadcastable: the loss raises, its error says so
    return prediction, target, broadcast


def _widens_prediction(shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]) -> bool:
    """The target of :func:`_broadcast_shapes` broadcasts the prediction to a larger shape."""
    return shapes[2] not in (None, shapes[0])


def _loss_kind(fn: Any) -> str | None:
    """'class' or 'binary' for those torch losses, 'regression' for the other torch losses
    (MSE, L1, Huber...: a target shaped like the output), None for the caller's own."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    for kind, known in (("class", _CLASS_LOSSES), ("binary", _BINARY_LOSSES)):
        if any(_is_or_instance(fn, k) for k in known):
            return kind
    return "regression" if _is_torch_loss(fn) else None


def _is_torch_loss(fn: Any) -> bool:
    return isinstance(fn, nn.modules.loss._Loss) or getattr(fn, "__module__", "") == "torch.nn.functional"


def _is_or_instance(fn: Any, known: Any) -> bool:
    """``fn`` is the function ``known``, or an instance of the class ``known``."""
    return fn is known or (isinstance(known, type) and isinstance(fn, known))


def _make_target(fn: Any, out: Any) -> tuple[torch.Tensor, str]:
    """A plausible target for ``fn`` from the output's shape, and how it was made."""
    t = _prediction_of(out)
    kind = _loss_kind(fn) or _shape_kind(t)
    gen = torch.Generator().manual_seed(0)
    if kind == "class" and t.dim() >= 1:
        target, how = _class_indices(t, gen)
    elif kind == "binary":
        target = torch.randint(0, 2, tuple(t.shape), generator=gen).to(t.dtype)
        how = f"generated 0/1 labels {tuple(t.shape)}"
    else:
        target = torch.randn(tuple(t.shape), generator=gen).to(t.dtype)
        how = f"generated random values {tuple(t.shape)}"
    return target.to(t.device), how


def _shape_kind(t: torch.Tensor) -> str:
    """For the caller's own loss: 2-D outputs of several columns are class logits, the rest regression."""
    return "class" if t.dim() == 2 and t.shape[1] > 1 else "regression"


def _prediction_of(out: Any) -> torch.Tensor:
    """The output tensor, or the first floating-point tensor of a structured output."""
    t = out if isinstance(out, torch.Tensor) else next((x for x in _tensors(out) if x.is_floating_point()), None)
    if t is None:
        raise UserError(f"cannot make a target for loss_fn from the output {type(out).__name__}: pass target=")
    return t


def _class_indices(t: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, str]:
    """Random class indices for the logits ``t`` (classes along dim 1, or dim 0 of a single sample)."""
    classes = t.shape[1] if t.dim() >= 2 else t.shape[0]
    shape = (t.shape[0], *t.shape[2:]) if t.dim() >= 2 else ()
    target = torch.randint(0, classes, shape, generator=gen)
    return target, f"generated class indices {tuple(shape)} in [0, {classes})"


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


def _token_ids(inputs: tuple[Any, ...] | dict[str, Any], out: Any) -> torch.Tensor | None:
    """The integer ids ``(B, T)`` behind token logits ``(B, T, V)``, else None."""
    pred = primary_output(out)
    ids = _ids_input(inputs)
    if ids is None or ids.is_floating_point() or ids.dim() != 2 or pred.dim() != 3:
        return None
    return ids if tuple(ids.shape) == tuple(pred.shape[:2]) else None


def _next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """Each position's next id (``-100``, ignored, at the last position)."""
    target = torch.full_like(ids, -100)
    target[:, :-1] = ids[:, 1:]
    return target


def _ids_input(inputs: tuple[Any, ...] | dict[str, Any]) -> torch.Tensor | None:
    """The ``input_ids`` keyword input, else the first input tensor."""
    tensors = input_tensors(inputs)
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    return ids if isinstance(ids, torch.Tensor) else (tensors[0] if tensors else None)


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


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm))


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


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t``. A sum is ~50x faster than isfinite().all() on CPU and is finite
    whenever every element is; only a non-finite sum (or an overflow) needs the full check."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    with torch.no_grad():
        total = complex(t.sum()) if t.is_complex() else float(t.sum())
    if math.isfinite(abs(total)):
        return True
    return bool(torch.isfinite(t).all())


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


def _describe_module(m: nn.Module) -> str:
    extra = m.extra_repr()
    if extra and "\n" not in extra and len(extra) <= 80:
        return f"{type(m).__name__}({extra})"
    return type(m).__name__


def _display(name: str) -> str:
    return name or "(model)"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _short(names: list[str], k: int = 3) -> str:
    shown = ", ".join(names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def _count(items: list[Any], noun: str) -> str:
    n = len(items)
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _slashed(values: list[float]) -> str:
    """Weight decays joined for a message: ``0.01/0.1``."""
    return "/".join(f"{v:g}" for v in values)


def _them(items: list[Any]) -> str:
    return "them" if len(items) > 1 else "it"

