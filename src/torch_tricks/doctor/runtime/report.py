"""The result of :func:`torch_tricks.doctor.runtime.check_model`: the findings, the measured facts behind
them (batch, output, target, loss, steps, BatchNorm batches, memory), the checks that did not run,
and the text ``torch-tricks doctor --model`` prints."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

from torch_tricks.doctor.registry import Finding, findings_count, severity_rank

__all__ = ["RuntimeReport"]


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
