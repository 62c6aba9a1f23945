"""One run of :func:`torch_tricks.doctor.runtime.check_model`: the orchestration of the checks.

The checks of the caller's objects as they are come first (registration, modes, weight decay, the
optimizer's groups); then, on copies, the instrumented first training step (its forward, loss and
backward findings), the plain steps of the memory-growth check, two eval-mode forwards and the
inplace analysis. Each family of checks lives in its own module; this one runs them in order,
gathers their findings and the report's facts, and turns a forward or loss that fails into a
:class:`UserError` that names the module and shapes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from torch_tricks.device import module_device
from torch_tricks.doctor.registry import Finding, severity_rank
from torch_tricks.doctor.rules.runtime import MIN_BN_BATCH, UNREGISTERED
from torch_tricks.doctor.runtime.arguments import (
    _check_model_and_steps, _check_optimizer, _prepare_inputs, _resolve_device, _split_loss,
)
from torch_tricks.doctor.runtime.decay import _coupled_l2, _decay_on_no_decay
from torch_tricks.doctor.runtime.frozen import frozen_in_train, params_twice
from torch_tricks.doctor.runtime.isolation import _forked_rng, _parked_grads
from torch_tricks.doctor.runtime.layers import _dim_findings, _inplace_candidates, _small_batch_findings
from torch_tricks.doctor.runtime.loss import _loss_name, _StepLoss
from torch_tricks.doctor.runtime.memory import _growable_sizes, _growth_findings, _grown
from torch_tricks.doctor.runtime.modes import _mode_mismatches, _random_in_eval
from torch_tricks.doctor.runtime.nonfinite import _first_nonfinite_finding, _nonfinite_grad_findings
from torch_tricks.doctor.runtime.pairing import _LossAbort, _LossWatch, _pairing_findings
from torch_tricks.doctor.runtime.recorder import _Recorder
from torch_tricks.doctor.runtime.registration import _unregistered_modules
from torch_tricks.doctor.runtime.report import RuntimeReport
from torch_tricks.doctor.runtime.untrained import _not_optimized, _unused_findings, _without_grad
from torch_tricks.doctor.runtime.util import _describe_module, _display, _tensors
from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.inputs import call_model, describe_inputs
from torch_tricks.inspect.memory import leak_check


class _Checker:
    """One run of :func:`check_model`: validated arguments, working copies, findings."""

    def __init__(self, model, batch, loss_fn, optimizer, target, steps, device) -> None:
        _check_model_and_steps(model, steps)
        kind, loss_fn = _split_loss(loss_fn)  # kind: a LOSS_KINDS name, resolved on the first output
        if optimizer is not None:
            _check_optimizer(optimizer, model)
        self.model = model
        self.loss_fn = loss_fn  # the caller's: copied with the model, self.loss calls the copy
        self.optimizer = optimizer
        self.steps = steps
        self.device = _resolve_device(device, model)
        self.inputs = _prepare_inputs(batch, self.device)
        self.findings: list[Finding] = []  # shared with self.loss (TT214): extended in place, never rebound
        self.report = RuntimeReport(device=str(self.device), inputs=describe_inputs(self.inputs),
                                    loss_fn=kind or _loss_name(loss_fn))
        self.loss = _StepLoss(kind, target, self.device, self.inputs, self.report, self.findings)
        self.called: set[str] = set()  # modules that ran in the first step
        self.unused: set[str] = set()  # parameters without gradient in the first step
        self.opt_can_step = True  # False once step() asked for a closure

    def run(self) -> RuntimeReport:
        """The checks of the caller's objects, then those of the steps on copies; the report with its
        findings sorted by severity, rule and path."""
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
            self.findings += _random_in_eval(self.work, self._fresh_inputs, self.report.skipped)
            self.findings += _inplace_candidates(self.work, self.called, self.report.skipped)
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
            self.work, self.work_opt, self.loss.fn = copy.deepcopy((self.model, self.optimizer, self.loss_fn))
        except Exception:
            try:
                self.work, self.work_opt = copy.deepcopy((self.model, self.optimizer))
            except Exception as exc:
                raise UserError(
                    f"cannot deep-copy the model or optimizer ({type(exc).__name__}: {one_line(exc)}): "
                    "check_model trains a copy so your weights stay untouched; remove the un-copyable attribute"
                ) from None
            self.loss.fn = self.loss_fn
            self.report.notes.append("loss_fn could not be deep-copied: the check called the original")

    def _move_copies(self) -> None:
        if module_device(self.work) != self.device:
            self.work.to(self.device)
            if self.work_opt is not None:  # optimizer state follows its parameters' device
                self.work_opt.load_state_dict(self.work_opt.state_dict())
        if isinstance(self.loss.fn, nn.Module):
            self.loss.fn.to(self.device)

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
                loss = self.loss.of(out, first=True)
        except _LossAbort as abort:
            self._aborted(abort, rec, watch)
            return False
        self._completed_first_step(out, loss, rec)
        forward_finite = self._forward_findings(rec, out, loss)
        self.findings += _pairing_findings(watch, rec)

        trainable = [(n, p) for n, p in work.named_parameters() if p.requires_grad]
        _backward(loss)
        self._gradient_findings(rec, trainable, forward_finite)
        self._optimizer_step()
        del rec, watch, out, loss
        return True

    def _forward(self, inputs: tuple[Any, ...] | dict[str, Any], rec: _Recorder) -> Any:
        """The working copy's output; a UserError naming the failing module if the forward raises."""
        try:
            return call_model(self.work, inputs)
        except _LossAbort:
            raise
        except Exception as exc:
            raise self._forward_error(exc, rec) from None

    def _completed_first_step(self, out: Any, loss: torch.Tensor, rec: _Recorder) -> None:
        """Record what the first step's forward and loss gave."""
        self.report.steps_run = 1
        self.report.outputs = describe_inputs(_tensors(out))
        self.report.loss = float(loss.detach().float())
        self.report.target = self.loss.target_note or ("none: loss_fn takes the output only" if self.loss.fn else
                                                       "none: no loss_fn, the loss is the mean of the outputs")
        self.called = {c.name for c in rec.calls}

    def _aborted(self, abort: _LossAbort, rec: _Recorder, watch: _LossWatch) -> None:
        """Record a first step that stopped in the loss, and what its forward showed."""
        self.report.completed = False
        self.report.error = str(abort)
        self.report.target = self.loss.target_note
        self._forward_findings(rec, None, None)
        self.findings += _pairing_findings(watch, rec)
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
        loss = self.loss.of(out, first=False)
        if loss.requires_grad:
            loss.backward()
        self._optimizer_step()

    def _forward_error(self, exc: Exception, rec: _Recorder) -> UserError:
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

    def _forward_findings(self, rec: _Recorder, out: Any, loss: torch.Tensor | None) -> bool:
        """BatchNorm batches, layer dims, non-finite forward values; True if all finite."""
        self.report.batchnorm_batch = dict(rec.bn_batch)
        self.findings += _small_batch_findings(rec.bn_batch)
        self.findings += _dim_findings(rec, out)
        nonfinite = _first_nonfinite_finding(self.inputs, rec, loss)
        if nonfinite is None:
            return True
        self.findings.append(nonfinite)
        return False

    def _gradient_findings(
        self, rec: _Recorder, trainable: list[tuple[str, nn.Parameter]], forward_finite: bool
    ) -> None:
        """Parameters without gradient (TT201) and the first non-finite gradient (TT210)."""
        unused = _without_grad(trainable)
        self.report.parameters_without_grad = [n for n, _ in unused]
        self.unused = set(self.report.parameters_without_grad)
        self.findings += _unused_findings(trainable, unused, self.work, self.model, self.optimizer)
        if forward_finite:
            self.findings += _nonfinite_grad_findings(rec, self.work, trainable)

    # -- later checks ------------------------------------------------------------------------

    def _memory_growth(self) -> None:
        """TT211: the leak check's plain steps, and what grew over them when memory did."""
        before = _growable_sizes(self.work, self.loss.fn)
        rep = self._leak_check()
        if rep is None or not rep.leaking:
            return
        grown = _grown(before, _growable_sizes(self.work, self.loss.fn))
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


def _failing_module(rec: _Recorder) -> tuple[str, str]:
    """(where, fix) for a forward that raised: the innermost module running, and what to change."""
    where, fix = "", "pass a batch of the shape the model expects, batch dimension first"
    if rec.stack:
        c = rec.stack[-1]
        given = ", ".join(str(s) for s in c.in_shapes) or "no tensor"
        where = f" in '{_display(c.name)}' ({_describe_module(c.module)}, given {given})"
        if isinstance(c.module, nn.modules.batchnorm._BatchNorm) and c.module.training:
            fix = f"BatchNorm in training needs a batch of 2 or more ({MIN_BN_BATCH}+ for stable statistics)"
    return where, fix


def _backward(loss: torch.Tensor) -> None:
    if not loss.requires_grad:
        return
    try:
        loss.backward()
    except Exception as exc:
        raise UserError(f"backward of the training step failed: {one_line(exc)}") from None
