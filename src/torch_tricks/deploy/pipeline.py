"""Chain deploy steps by name and check every step: ``optimize(model, "fuse,int8", x)``.

:func:`optimize` applies the steps in order to a deep copy of the model (the model you
pass is never changed, even when a step fails) and, after each step, measures what it
did against the *original* eager model: output agreement (max abs / rel diff, top-1
agreement), parameters, size, and latency at each batch size in ``batches`` (medians,
all models of the chain timed interleaved by
:func:`torch_tricks.deploy.step_report.compare_latency`, so machine drift hits them alike).
Each step also states a tolerance on its *own* change (its output against the model
before it) and says whether it held. The whole chain is checked before any work starts
(step names, arguments, order, device), so a mistake costs no time; a step that cannot
apply raises a one-line :class:`~torch_tricks.errors.UserError` saying why.

Each step is a :class:`~torch_tricks.deploy.steps.DeployStep`, registered with its trick by
:func:`~torch_tricks.deploy.steps.deploy_step` in the module that holds its code; this module
plans the chain, applies the steps, holds each to its tolerance and measures. A step's older
trick name (``fuse_conv_bn``, ``int8_static`` ...) is accepted as an alias of its name.
Saving and loading live in :mod:`torch_tricks.deploy.artifact`.

Steps (:func:`list_steps` gives the same list as data):

=================  ==========================================================================
``fuse``           fold Conv+BN / Linear+BN pairs (:mod:`~torch_tricks.deploy.fuse`)
``reparam``        fold multi-branch blocks, RepVGG / ACNet (:mod:`~torch_tricks.deploy.reparam`)
``prune[:A]``      remove conv channels (:func:`~torch_tricks.deploy.prune.prune_channels`):
                   ``prune`` = ``prune:macs=0.5`` keeps about half the MACs; ``prune:0.3``
                   removes 30% of the channels of every prunable layer
``int8[:B][:T]``   static int8, calibrated (:func:`~torch_tricks.deploy.quantize.quantize_static_int8`);
                   ``B`` = ``auto`` (PT2E, falling back to FX), ``pt2e`` or ``fx``; ``T`` = ``vnni``
                   or ``no-vnni`` forces the int8 setting (default: chosen for this CPU)
``int8-dynamic``   int8 Linear/LSTM/GRU weights, activations quantized per call; transformers'
                   ``Conv1D`` (GPT-2) becomes ``nn.Linear`` first; a head tied to the embedding stays fp32
``fp16``/``bf16``  half-precision weights (fp16 is refused on CPU: slower than fp32 there)
``onnx``           export to ONNX and run the file in ONNX Runtime (CPU)
``onnx-int8[:M]``  ONNX, then ONNX Runtime's int8: ``static`` (calibrated, default) or ``dynamic``;
                   a further ``:vnni`` / ``:no-vnni`` forces the int8 setting, as for ``int8``
=================  ==========================================================================

Order: ``reparam`` goes before ``fuse`` and ``prune`` (its folds need the BatchNorms and
channel counts those change); at most one of the *final* steps (``int8``,
``int8-dynamic``, ``fp16``, ``bf16``, ``onnx``, ``onnx-int8``) and it comes last, because
each turns the model into something the other steps cannot take (quantized kernels, a
compiled graph, an ONNX Runtime session).

What each step changed: the steps that target layers (``int8``, ``int8-dynamic``, ``fp16``/``bf16``,
``prune``, ``fuse``) count the layers they changed of those they target
(:class:`~torch_tricks.deploy.steps.Coverage`: "quantized 8 of 9 matmul layers; lm_head left
fp32: ..."), in the table's ``changed`` column and the step's first note. A step's
:attr:`~torch_tricks.deploy.steps.StepResult.status` is ``ok`` only if it changed the model
within its tolerance; ``no change`` and ``partial`` (layers it targets left as they were,
against its purpose) are said in the verdict line.

Calibration (``int8``, ``onnx-int8``): the batches in ``calib`` (tensors, tuples, or
``(inputs, target)`` pairs from a DataLoader), or, without them, ``example_inputs`` plus
random batches with its per-channel mean and std; :attr:`OptimizeResult.calibration`
says which. Int8 activation ranges come from these batches, so pass real data.

:meth:`OptimizeResult.save` writes the final model atomically in the one format that
holds it (see its docstring); :func:`load_optimized` reads any of them back.

Int8 setting (``int8``, ``onnx-int8``): on x86 CPUs without VNNI the u8*s8 int8 kernels
add pairs of products in a saturating int16, so there PT2E quantizes activations to 7 bits
and ONNX Runtime uses u8 weights (its U8U8 kernels cannot saturate);
:func:`torch_tricks.deploy.cpu_int8.int8_setting` chooses per runtime, ``:vnni`` /
``:no-vnni`` on the step or ``optimize(int8_for=...)`` force the setting made for
kernels with / without VNNI (e.g. to build for another machine), and the step's
:attr:`StepResult.int8_setting` and notes say which ran and why.
"""


from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from torch_tricks._format import human_bytes, si, table
from torch_tricks.batches import map_tensors
from torch_tricks.deploy import export, fuse, prune, quantize, reparam  # noqa: F401  (they register the steps)
from torch_tricks.deploy.artifact import SaveInfo, load_optimized, save_artifact, save_format
from torch_tricks.deploy.export import OrtModule
from torch_tricks.deploy.step_report import agreement, compare_latency, model_size_bytes, param_count
from torch_tricks.deploy.steps import (INT8_TARGETS, TOP1_MIN_ROWS, DeployStep, StepContext, StepResult, Tolerance,
                                       batch_rows, get_step, json_safe, list_steps, plain_line, quiet_torch)
from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError
from torch_tricks.inspect.inputs import as_input_tuple, describe_inputs

__all__ = [
    "OptimizeResult",
    "SaveInfo",
    "StepResult",
    "Tolerance",
    "list_steps",
    "load_optimized",
    "optimize",
]

_CANNOT_APPLY = re.compile(r"^[\w ()-]{0,40}? cannot apply: ")


# -- planning -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Planned:
    text: str  # as given, e.g. "prune:0.3"
    step: DeployStep
    arg: str
    mode: str = ""  # the step's mode (int8 backend, onnx-int8 mode ...), lower case
    int8_for: str = "auto"  # int8 / onnx-int8: auto | vnni | no-vnni

    @property
    def name(self) -> str:
        return self.step.name


def _plan(steps: Sequence[str] | str) -> list[_Planned]:
    """Parse and check the chain (names, arguments, duplicates, order) before any work."""
    items = _split_steps(steps)
    if not items:
        raise UserError(f"no steps given: choose from {', '.join(list_steps())}")
    plan: list[_Planned] = []
    for text in items:
        name, _, arg = text.partition(":")
        step = get_step(name)
        mode, int8_for = step.parse(arg.strip())
        plan.append(_Planned(text, step, arg.strip(), mode, int8_for))
    seen: dict[str, int] = {}
    for i, p in enumerate(plan):
        if p.name in seen:
            raise UserError(f"step {p.name!r} is given twice: give each step once")
        seen[p.name] = i
    _check_finals(plan)
    _check_order(plan, seen)
    return plan


def _split_steps(steps: Sequence[str] | str) -> list[str]:
    """``"fuse, int8"`` or ``["fuse", "int8"]`` -> ``["fuse", "int8"]`` (blanks dropped)."""
    if isinstance(steps, str):
        steps = steps.split(",")
    elif not (isinstance(steps, (list, tuple)) and all(isinstance(s, str) for s in steps)):
        raise UserError(f"steps must be a list of step names or a comma-separated string, got {type(steps).__name__}")
    return [s.strip() for s in steps if s.strip()]


def _check_finals(plan: list[_Planned]) -> None:
    """At most one final step (int8, onnx ...), and it comes last."""
    finals = [p for p in plan if p.step.final]
    if len(finals) > 1:
        raise UserError(
            f"steps {finals[0].name!r} and {finals[1].name!r} cannot be chained: each turns the model into a form "
            f"the other cannot take; keep one of them, last"
        )
    if finals and plan[-1] is not finals[0]:
        after = plan[plan.index(finals[0]) + 1]
        raise UserError(
            f"step {after.name!r} cannot follow {finals[0].name!r}: {finals[0].name} must be the last step "
            f"(put {after.name} before it)"
        )


def _check_order(plan: list[_Planned], seen: dict[str, int]) -> None:
    """A step with ``before`` (reparam) must come before the steps it names."""
    for p in plan:
        for other, why in p.step.before.items():
            if other in seen and seen[other] < seen[p.name]:
                raise UserError(f"step {p.name!r} cannot follow {other!r}: {why}; put {p.name} before {other}")


def _with_int8_for(plan: list[_Planned], int8_for: Any) -> list[_Planned]:
    """Apply ``optimize(int8_for=...)`` to the chain's int8 step (checked before any work)."""
    want = _int8_target(int8_for)
    if want == "auto":
        return plan
    p = _int8_planned(plan, want)
    if p.step.one_int8_setting:
        if want == "vnni":
            raise UserError(p.step.one_int8_setting)
        return plan
    if p.int8_for not in ("auto", want):
        raise UserError(f"int8 target given twice: step {p.text!r} says {p.int8_for}, int8_for says {want}")
    return [dataclasses.replace(q, int8_for=want) if q is p else q for q in plan]


def _int8_target(int8_for: Any) -> str:
    """``int8_for`` checked and normalised: auto, vnni or no-vnni."""
    if not isinstance(int8_for, str) or int8_for.strip().lower() not in ("auto", *INT8_TARGETS):
        raise UserError(f"the int8 target (int8_for, --int8-for) must be auto, vnni or no-vnni, not {int8_for!r}")
    return int8_for.strip().lower()


def _int8_planned(plan: list[_Planned], want: str) -> _Planned:
    """The chain's first int8 / onnx-int8 step, which ``int8_for`` applies to."""
    int8 = [p for p in plan if p.step.targets or p.step.one_int8_setting]
    if not int8:
        raise UserError(f"int8 target {want!r} given, but the chain has no int8 or onnx-int8 step")
    return int8[0]


# -- results -----------------------------------------------------------------------------------


@dataclass
class OptimizeResult:
    """The final model of a chain, with one :class:`StepResult` per step (plus the original).

    ``model`` is the final model: an ``nn.Module``, a
    :class:`~torch_tricks.deploy.quantize.PT2EInt8Model`, or an
    :class:`~torch_tricks.deploy.export.OrtModule` for the ONNX steps (its file lives in
    a temporary folder until the result is garbage-collected or :meth:`close` d; use
    :meth:`save` to keep it). ``calibration`` says what the int8 ranges were calibrated on
    (None without a calibrated step); ``threads`` the ``torch.get_num_threads()`` the chain
    ran (and the int8 PT2E model was compiled) with. :meth:`to_text` is the report
    ``torch-tricks optimize`` prints.
    """

    model: Any = field(repr=False)
    original: StepResult
    steps: list[StepResult]
    device: str
    batches: tuple[int, ...]
    threads: int
    measured: bool
    example_inputs: tuple[Any, ...] = field(repr=False, default=())
    calibration: str | None = None
    saved: SaveInfo | None = None
    warmup: int = 3  # the latency's warm-up calls and timed calls (optimize's arguments)
    repeats: int = 10
    compared_on: str = ""  # the inputs the outputs were compared on, described (check_inputs or example_inputs)
    _workdir: Any = field(default=None, repr=False)

    # -- what the CLI prints --------------------------------------------------------------

    @property
    def final(self) -> StepResult:
        return self.steps[-1] if self.steps else self.original

    @property
    def ok(self) -> bool:
        """Every step within its stated tolerance (steps without one count as ok): what the CLI's exit
        status and its save guard go by. A step that changed nothing, or only some of the layers it
        targets, is not "ok" in its own :attr:`StepResult.status` ("no change", "partial"), and the
        verdict line names it, but the chain's model is still verified and may be saved."""
        return all(s.within_tolerance is not False for s in self.steps)

    def models(self) -> dict[str, Any]:
        """``{"original": model, step: model, ...}``: every model of the chain."""
        return {r.step: r.model for r in [self.original, *self.steps]}

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready data (for ``--json``)."""
        return json_safe({
            "device": self.device,
            "threads": self.threads,
            "batches": list(self.batches),
            "measured": self.measured,
            "example_inputs": describe_inputs(self.example_inputs),
            "calibration": self.calibration,
            "int8_setting": next((s.int8_setting for s in self.steps if s.int8_setting), None),
            "ok": self.ok,
            "save_format": self.save_format,
            "original": self.original.to_dict(),
            "steps": [s.to_dict() for s in self.steps],
            "saved": self.saved.to_dict() if self.saved else None,
        })

    as_dict = to_dict  # the earlier name; every result type of the package says to_dict

    def table_rows(self) -> tuple[list[str], list[list[str]]]:
        """``(headers, rows)`` of strings: one row for the original and one per step. ``changed``: the
        layers a step changed of those it targets (its notes say which kind); ``status``: see
        :attr:`StepResult.status`."""
        headers = ["step", "backend", "max abs diff", "top-1", "params", "size", "changed"]
        for b in self._timed_batches():
            headers += [f"bs{b} ms", f"bs{b} x"]
        headers.append("status")
        return headers, [self._row(r) for r in [self.original, *self.steps]]

    def _timed_batches(self) -> tuple[int, ...]:
        return self.batches if self.measured else ()

    def _row(self, r: StepResult) -> list[str]:
        row = [
            r.step + ("" if r.changed or r is self.original else " (no-op)"),
            r.backend or "-",
            *_agreement_cells(r.agreement),
            si(r.params) if r.params else "-",
            human_bytes(r.size_bytes) if r.size_bytes else "-",
            f"{r.coverage.changed}/{r.coverage.total}" if r.coverage is not None else "-",
        ]
        for b in self._timed_batches():
            row += _latency_cells(r.latency_s.get(b), r.speedup.get(b))
        row.append("-" if r is self.original else r.status)
        return row

    def format_table(self) -> str:
        """:meth:`table_rows` as a fixed-width text table."""
        headers, rows = self.table_rows()
        return table(headers, rows, "ll" + "r" * (len(headers) - 3) + "l")

    def notes(self) -> list[str]:
        """``"step: note"`` lines: what each step did not do, fell back to, or warns about."""
        out = [f"calibration: {self.calibration}"] if self.calibration else []
        for r in self.steps:
            if r.within_tolerance is False:
                out.append(f"{r.step}: outputs moved more than its tolerance ({r.tolerance})")
            out.extend(f"{r.step}: {n}" for n in r.notes)
        return out

    def to_text(self, *, model_name: str = "model", steps: Sequence[str] | None = None,
                data_name: str | None = None, save_asked: bool = False) -> str:
        """The report ``torch-tricks optimize`` prints: what ran where, :meth:`format_table`,
        :meth:`notes`, whether every step held its tolerance, and what :meth:`save` wrote.

        The result does not know what the command line adds: ``model_name`` and ``steps``
        (as asked; default the steps' names) head the report; ``data_name`` is the data set
        the compared inputs came from (None: random inputs, as the CLI makes without
        ``--data``); ``save_asked`` says a save was asked for, so that a save held back by a
        step outside its tolerance is reported as such.
        """
        steps = [s.step for s in self.steps] if steps is None else steps
        lines = [*self._heading(model_name, steps, data_name), self.format_table(), ""]
        lines += [f"  {n}" for n in self.notes()]
        exceeded = [s for s in self.steps if s.within_tolerance is False]
        lines.append(_verdict(exceeded, self.steps))
        lines += self._unchecked()
        lines += self._saved_lines(save_asked and bool(exceeded))
        return "\n".join(lines)

    def _heading(self, model_name: str, steps: Sequence[str], data_name: str | None) -> list[str]:
        """What ran where, and on which inputs the outputs were compared."""
        compared = self.compared_on or describe_inputs(self.example_inputs)
        lines = [f"{model_name}: {','.join(steps)} on {self.device}, {self.threads} thread(s); outputs compared on "
                 f"{compared}" + (f" from {data_name} (validation)" if data_name else " (random)")]
        if self.measured:
            lines.append(f"latency: median ms of {self.repeats} calls after {self.warmup} warm-up, "
                         "bsN x = speed-up over the original")
        return lines

    def _unchecked(self) -> list[str]:
        """A line naming the steps that were not held to a tolerance, if any."""
        unchecked = [s.step for s in self.steps if s.within_tolerance is None]
        if not unchecked:
            return []
        return [f"  not held to a tolerance: {', '.join(unchecked)} (changes the outputs by design, "
                "or they could not be compared: see the notes)"]

    def _saved_lines(self, held_back: bool) -> list[str]:
        """What :meth:`save` wrote, or that a save asked for was held back by a step outside its tolerance."""
        if self.saved is not None:
            return [self.saved.to_text()]
        if held_back:
            return ["nothing written: a step exceeded its tolerance (--force writes it anyway)"]
        return []

    # -- saving ---------------------------------------------------------------------------

    @property
    def save_format(self) -> str:
        """The format :meth:`save` will write (``torch.export`` may still fall back to ``pickle``)."""
        fmt = save_format(self.model)[0]
        return "torch.export" if fmt == "pt2e" else fmt

    @property
    def suggested_suffix(self) -> str:
        """The usual file suffix for :attr:`save_format`: ``.onnx``, ``.pt2`` (torch.export) or ``.pt``."""
        return {"onnx": ".onnx", "torch.export": ".pt2", "pt2e": ".pt2"}.get(save_format(self.model)[0], ".pt")

    def save(self, path: str | os.PathLike[str], *, verify: bool = True) -> SaveInfo:
        """Write the final model to ``path`` atomically (a temporary file beside it, renamed).

        The format is the one that can hold the final model, in this order of preference:

        * **onnx** after the ``onnx`` / ``onnx-int8`` steps: the ``.onnx`` file ONNX
          Runtime ran (and its external-data file beside it, if any).
        * **torch.export** (``.pt2``, :func:`torch.export.save`, batch dimension dynamic)
          for plain / fused / re-parameterized / pruned / half-precision modules and the
          PT2E int8 model (its quantized graph; :func:`load_optimized` compiles it again).
          A self-contained program: loading needs neither the model's Python class nor
          torch-tricks (``torch.export.load(path).module()``), and it is what AOTInductor
          and ExecuTorch take.
        * **torchscript** (``torch.jit.trace``) for the FX int8 model: ``torch.export``
          cannot serialize ``torch.ao``'s packed int8 weights and an FX-quantized
          ``GraphModule`` does not pickle on torch 2.13; a trace of an FX graph is exact
          (no Python control flow left to freeze). TorchScript is deprecated, but it is the
          format ``torch.ao`` int8 models have.
        * **pickle** (``torch.save(model)``) for dynamic int8 (``torch.export`` cannot hold
          its packed weights, and a trace would freeze the model's Python control flow,
          e.g. the sequence length) and for any model ``torch.export`` fails on. Loading
          (``torch.load(path, weights_only=False)``) runs pickle code, needs the model's
          class importable, and must only be done on trusted files.

        ``verify`` loads the file back and compares its outputs on the example inputs
        (``SaveInfo.verify_max_abs_diff``). A name ending in ``.onnx`` for a non-ONNX
        result is refused.
        """
        info = save_artifact(self.model, path, self.example_inputs, steps=[s.step for s in self.steps],
                             threads=self.threads, verify=verify)
        self.saved = info
        return info

    def close(self) -> None:
        """Delete the temporary folder holding the ONNX files (the ONNX model still runs)."""
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


def _agreement_cells(a: Any) -> list[str]:
    """The max abs diff and top-1 agreement cells ("-" where not measured)."""
    if not a:
        return ["-", "-"]
    return [f"{a.max_abs_diff:.2e}", f"{a.top1_agreement:.1%}" if a.top1_agreement is not None else "-"]


def _latency_cells(t: float | None, s: float | None) -> list[str]:
    return [f"{t * 1e3:.2f}" if t is not None else "-", f"{s:.2f}" if s is not None else "-"]


def _verdict(exceeded: list[StepResult], steps: list[StepResult]) -> str:
    """The report's last word: verified or not, and the steps that changed nothing or only part of their layers."""
    if exceeded:
        text = "NOT verified: " + "; ".join(f"{s.step} exceeds {s.tolerance}" for s in exceeded)
    else:
        text = "verified: every step within its tolerance against the model before it"
    for status, words in (("no change", "changed nothing"), ("partial", "changed only some of its layers")):
        named = [s.step for s in steps if s.status == status]
        if named:
            text += f"; {', '.join(named)} {words} (see the notes)"
    return text


# -- optimize -----------------------------------------------------------------------------------


def optimize(
    model: nn.Module,
    steps: Sequence[str] | str,
    example_inputs: Any,
    *,
    calib: Iterable[Any] | None = None,
    device: str | torch.device = "cpu",
    batches: Sequence[int] = (1, 16),
    measure: bool = True,
    progress: Callable[[str], None] | None = None,
    check_inputs: Any | None = None,
    warmup: int = 3,
    repeats: int = 10,
    int8_for: str = "auto",
) -> OptimizeResult:
    """Apply ``steps`` in order to a copy of ``model`` and measure each against the original.

    ``steps``: names from :func:`list_steps`, as a list or a comma-separated string
    (``"fuse,int8"``). ``example_inputs``: a tensor or a tuple of positional inputs, used
    to trace, export, calibrate (without ``calib``) and to build the latency inputs of
    each batch size in ``batches`` (rows repeated or cut along dim 0). ``check_inputs``
    (default ``example_inputs``) feed the output comparisons: give at least
    ``TOP1_MIN_ROWS`` (10) rows for top-1 agreement to be held to a tolerance.
    ``measure=False`` skips the latency (agreement, params and size are always measured).
    ``progress`` is called with a short message before each phase (the library never prints).
    ``int8_for`` (``auto``, ``vnni`` or ``no-vnni``) forces the int8 setting of the chain's
    ``int8`` / ``onnx-int8`` step, like ``:vnni`` / ``:no-vnni`` on the step; ``auto``
    chooses it for this CPU (the saturation-free one where the int8 kernels have no VNNI).

    Returns an :class:`OptimizeResult`; the input model is never changed (its weights,
    buffers and train/eval mode), also when a step raises.
    """
    plan = _with_int8_for(_plan(steps), int8_for)
    _check_counts(warmup, repeats)
    dev = _device(device)
    batches = _batches(batches, measure)
    if not isinstance(model, nn.Module):
        raise UserError(f"optimize needs an nn.Module, got {type(model).__name__}")
    _check_plan_can_run(plan, dev)
    report = progress or (lambda _msg: None)
    reference = _reference_copy(model, dev)
    example = _inputs_on(example_inputs, dev)
    check = _inputs_on(check_inputs, dev) if check_inputs is not None else example
    _check_inputs_match(example, check)
    _check_runs(reference, example)

    needs_calib = any(p.step.calibrates(p.mode) for p in plan)
    calib_batches, calib_text = (_calibration(calib, example, dev) if needs_calib else (None, None))
    workdir = _workdir(plan)
    original = StepResult(step="original", name="original", backend="eager", changed=False, model=reference)
    _measure_static(original, reference, reference, check)
    base = StepContext(example=example, calib=calib_batches, device=dev, workdir=workdir)
    results = _run_chain(plan, reference, original, check, base, report)

    if measure:
        _measure_latency([original, *results], example, batches, warmup, repeats, report)
    return OptimizeResult(
        model=results[-1].model, original=original, steps=results, device=str(dev), batches=tuple(batches),
        threads=torch.get_num_threads(), measured=measure, example_inputs=example,
        calibration=calib_text, warmup=warmup, repeats=repeats, compared_on=describe_inputs(check),
        _workdir=workdir,
    )


def _inputs_on(inputs: Any, dev: torch.device) -> tuple[Any, ...]:
    return map_tensors(as_input_tuple(inputs), lambda t: t.to(dev))


def _workdir(plan: list[_Planned]) -> tempfile.TemporaryDirectory[str] | None:
    """A temporary folder for the steps that write files (ONNX), None if no step does."""
    if any(p.step.needs_workdir for p in plan):
        return tempfile.TemporaryDirectory(prefix="torch_tricks_optimize_")
    return None


_FOR_VNNI = {"auto": None, "vnni": True, "no-vnni": False}


def _run_chain(plan: list[_Planned], reference: nn.Module, original: StepResult, check: tuple[Any, ...],
               base: StepContext, report: Callable[[str], None]) -> list[StepResult]:
    """Apply the steps in turn, each measured against the original and held to its own tolerance."""
    results: list[StepResult] = []
    current: Any = reference
    for i, p in enumerate(plan, 1):
        report(f"[{i}/{len(plan)}] {p.text}")
        ctx = dataclasses.replace(base, index=i, text=p.text, name=p.name, arg=p.arg, mode=p.mode,
                                  for_vnni=_FOR_VNNI[p.int8_for])
        res = _apply(p, current, ctx)
        _measure_static(res, reference, res.model, check, previous=current)
        if p.step.final:  # a conversion keeps the weights: count them in the model before it
            res.params = (results[-1] if results else original).params
        _hold_to_tolerance(res, p.step.tolerance, check)
        results.append(res)
        current = res.model
    return results


def _apply(p: _Planned, model: Any, ctx: StepContext) -> StepResult:
    """Run one step on ``model`` (never changed: every step works on a copy); its result holds the new model."""
    t0 = time.perf_counter()
    try:
        new, res = p.step.apply(model, ctx)
    except UserError as exc:
        why = _CANNOT_APPLY.sub("", plain_line(exc, with_type=False))  # said once is enough
        raise UserError(f"step {p.text!r} cannot apply: {why}") from None
    res.seconds = time.perf_counter() - t0
    res.model = new
    return res


def _hold_to_tolerance(res: StepResult, tol: Tolerance | None, check: tuple[Any, ...]) -> None:
    """Say whether the step's own change (against the model before it) held its tolerance."""
    if tol is None or res.step_agreement is None:
        return
    rows = batch_rows(check)
    if rows is not None and rows < TOP1_MIN_ROWS and tol.min_top1 is not None:
        tol = Tolerance(tol.max_rel_diff, tol.max_abs_diff, None)
    res.tolerance = tol.describe()
    res.within_tolerance = tol.holds(res.step_agreement)


def _reference_copy(model: nn.Module, dev: torch.device) -> nn.Module:
    """The eval-mode copy every step starts from and is compared with (the model itself is never changed)."""
    try:
        reference = copy.deepcopy(model)
    except Exception as exc:
        raise UserError(
            f"optimize works on a copy of the model and {type(model).__name__} cannot be deep-copied "
            f"({plain_line(exc)}): make its attributes copyable"
        ) from None
    return reference.eval().to(dev)


def _check_runs(reference: nn.Module, example: tuple[Any, ...]) -> None:
    try:
        with torch.inference_mode():
            reference(*example)
    except Exception as exc:
        raise UserError(f"the model does not run on the example inputs ({plain_line(exc)}): check their shape") from None


# -- measuring ----------------------------------------------------------------------------------


def _measure_static(res: StepResult, reference: nn.Module, model: Any, check: tuple[Any, ...],
                    previous: Any | None = None) -> None:
    if previous is not None:
        try:
            with quiet_torch():
                res.agreement = agreement(reference, model, check)
                res.step_agreement = res.agreement if previous is reference else agreement(previous, model, check)
        except UserError as exc:  # e.g. a fixed-batch PT2E model given check_inputs of another batch size
            res.notes.append(f"outputs not compared: {plain_line(exc, with_type=False)}")
    if isinstance(model, OrtModule):
        res.size_bytes = model.size_bytes
        res.params = _onnx_params(model.path)
    else:
        res.size_bytes = model_size_bytes(model)
        res.params = param_count(model)


def _measure_latency(results: list[StepResult], example: tuple[Any, ...], batches: Sequence[int],
                     warmup: int, repeats: int, report: Callable[[str], None]) -> None:
    for b in batches:
        report(f"timing batch {b}")
        inputs = _at_batch(example, b)
        runnable = _runnable(results, inputs, b)
        with quiet_torch():
            timings = compare_latency(runnable, inputs, warmup=warmup, repeats=repeats)
        _record_timings(results, timings, b)


def _runnable(results: list[StepResult], inputs: tuple[Any, ...], b: int) -> dict[str, Any]:
    """The models that run at batch ``b`` (a failure is noted in the step's result and leaves it untimed)."""
    runnable: dict[str, Any] = {}
    for r in results:
        try:
            with torch.inference_mode(), quiet_torch():
                r.model(*inputs)  # also compiles a PT2E model for this batch size
            runnable[r.step] = r.model
        except Exception as exc:
            r.latency_s[b] = r.latency_iqr_s[b] = r.speedup[b] = None
            r.notes.append(f"not timed at batch {b}: {plain_line(exc, with_type=False)}")
    return runnable


def _record_timings(results: list[StepResult], timings: dict[str, Any], b: int) -> None:
    """Each timed step's median, spread and speed-up over the original at batch ``b``."""
    base = timings.get("original")
    for r in results:
        t = timings.get(r.step)
        if t is None:
            continue
        r.latency_s[b] = t.median_s
        r.latency_iqr_s[b] = t.iqr_s
        r.speedup[b] = base.median_s / t.median_s if base is not None and t.median_s > 0 else None


def _at_batch(example: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    """``example`` with ``batch`` rows: its rows cut, or repeated, along dim 0."""
    n = batch_rows(example)
    if n is None:
        return example
    return tuple(_rows(a, n, batch) for a in example)


def _rows(a: Any, n: int, batch: int) -> Any:
    """A batched input of ``n`` rows cut, or repeated, to ``batch`` rows (anything else as it is)."""
    if not (isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n):
        return a
    if batch > n:
        a = a.repeat(math.ceil(batch / n), *([1] * (a.dim() - 1)))
    return a[:batch].contiguous()


# -- calibration --------------------------------------------------------------------------------

_RANDOM_CALIB_BATCHES = 8


def _calibration(calib: Iterable[Any] | None, example: tuple[Any, ...],
                 dev: torch.device) -> tuple[list[tuple[Any, ...]], str]:
    if calib is None:
        return _random_calibration(example)
    if isinstance(calib, torch.Tensor):
        raise UserError("calib must be an iterable of batches (a list of tensors, a DataLoader), not one tensor: "
                        "wrap it as [tensor]")
    batches = [map_tensors(_calib_args(b, example), lambda t: t.to(dev)) for b in calib]
    if not batches:
        raise UserError("calib is empty: give a few batches of real inputs")
    rows = sum(batch_rows(b) or 1 for b in batches)
    return batches, f"{len(batches)} batches ({rows} samples) given in calib"


def _calib_args(batch: Any, example: tuple[Any, ...]) -> tuple[Any, ...]:
    """One calib batch as positional inputs like ``example``'s (the inputs of an ``(inputs, target)`` pair)."""
    args = as_input_tuple(batch)
    if len(example) == 1 and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args):
        args = args[:1]  # (inputs, target) pairs from a DataLoader
    if len(args) != len(example):
        raise UserError(f"a calib batch has {len(args)} inputs, the example inputs {len(example)}: "
                        "give batches shaped like example_inputs")
    return args


def _random_calibration(example: tuple[Any, ...]) -> tuple[list[tuple[Any, ...]], str]:
    gen = torch.Generator().manual_seed(0)
    batches = [example] + [tuple(_like(a, gen) for a in example) for _ in range(_RANDOM_CALIB_BATCHES - 1)]
    return batches, (
        f"example_inputs plus {_RANDOM_CALIB_BATCHES - 1} random batches with its per-channel mean and std "
        "(no calib given): int8 ranges come from these, so pass real batches (calib=, or --data on the "
        "command line) for accurate int8"
    )


def _like(a: Any, gen: torch.Generator) -> Any:
    """A random tensor with ``a``'s shape and dtype, and its per-channel (dim 1) mean and std."""
    if not isinstance(a, torch.Tensor):
        return a
    if a.is_floating_point():
        return _like_float(a, gen)
    if a.dtype == torch.bool:
        return torch.randint(0, 2, a.shape, generator=gen).bool().to(a.device)
    lo, hi = int(a.min()), int(a.max())
    return torch.randint(lo, hi + 1, a.shape, generator=gen).to(a.dtype).to(a.device)


def _like_float(a: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    x = a.float()
    dims = [d for d in range(x.dim()) if d != 1] if x.dim() >= 2 else list(range(x.dim()))
    mean = x.mean(dim=dims, keepdim=True) if dims else x
    std = x.std(dim=dims, keepdim=True).nan_to_num(0.0) if dims and x.numel() > 1 else torch.zeros_like(mean)
    noise = torch.randn(a.shape, generator=gen).to(a.device)
    return (noise * std + mean).to(a.dtype)


# -- checks -------------------------------------------------------------------------------------


def _device(device: str | torch.device) -> torch.device:
    dev = resolve_device(device)
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"optimize runs on cpu or cuda, not {dev.type}")
    return dev


def _batches(batches: Sequence[int], measure: bool) -> tuple[int, ...]:
    if isinstance(batches, int):
        batches = (batches,)
    try:
        out = tuple(int(b) for b in batches)
    except (TypeError, ValueError):
        raise UserError(f"batches must be positive batch sizes such as (1, 16), got {batches!r}") from None
    if any(b < 1 for b in out) or (measure and not out):
        raise UserError(f"batches must be positive batch sizes such as (1, 16), got {batches!r}")
    return tuple(dict.fromkeys(out))


def _check_counts(warmup: Any, repeats: Any) -> None:
    """The latency's counts, checked before any work (also with ``measure=False``: a bad count is a mistake)."""
    if not _is_count(warmup, 0):
        raise UserError(f"warmup must be an integer >= 0, got {warmup!r}")
    if not _is_count(repeats, 1):
        raise UserError(f"repeats must be an integer >= 1, got {repeats!r}")


def _is_count(n: Any, least: int) -> bool:
    """An int (not a bool) of at least ``least``."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= least


def _check_plan_can_run(plan: list[_Planned], dev: torch.device) -> None:
    """Every step's device, then every step's dependencies (before any work)."""
    for p in plan:
        _check_device_for(p, dev)
    for p in plan:
        if p.step.check_needs is not None:
            p.step.check_needs(p.mode)


def _check_device_for(p: _Planned, dev: torch.device) -> None:
    if p.step.cpu_only and dev.type != "cpu":
        raise UserError(f"step {p.name!r} runs on CPU kernels (int8 / ONNX Runtime CPU): use device='cpu', "
                        "or fp16/bf16 on the GPU")
    if p.step.check_device is not None:
        p.step.check_device(dev)


def _check_inputs_match(example: tuple[Any, ...], check: tuple[Any, ...]) -> None:
    def spec(args: tuple[Any, ...]) -> list[Any]:
        return [(a.dtype, tuple(a.shape[1:])) if isinstance(a, torch.Tensor) and a.dim() else type(a) for a in args]

    if spec(example) != spec(check):
        raise UserError(f"check_inputs ({describe_inputs(check)}) must match example_inputs "
                        f"({describe_inputs(example)}) except for the batch size")


def _onnx_params(path: os.PathLike[str]) -> int:
    try:
        import onnx

        m = onnx.load(str(path), load_external_data=False)
        return sum(math.prod(t.dims) for t in m.graph.initializer)
    except Exception:
        return 0
