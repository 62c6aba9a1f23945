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
``int8-dynamic``   int8 Linear/LSTM/GRU weights, activations quantized per call
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

import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
import time
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from torch_tricks._io import atomic_path
from torch_tricks.deploy.step_report import Agreement, agreement, compare_latency, model_size_bytes, param_count
from torch_tricks._optional import install_hint, require
from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.inputs import as_input_tuple

__all__ = [
    "OptimizeResult",
    "SaveInfo",
    "StepResult",
    "Tolerance",
    "list_steps",
    "load_optimized",
    "optimize",
]

_META_NAME = "torch_tricks.json"


# -- the steps ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """How far a step's outputs may move from the model before it (None = not checked).

    ``max_rel_diff`` is ``max|a - b| / max|b|``; ``max_abs_diff`` passes on its own (an
    ``or``); ``min_top1`` applies to 2-D outputs of at least ``_TOP1_MIN_ROWS`` rows.
    """

    max_rel_diff: float | None = None
    max_abs_diff: float | None = None
    min_top1: float | None = None

    def describe(self) -> str:
        parts = []
        if self.max_abs_diff is not None and self.max_rel_diff is not None:
            parts.append(f"max abs diff <= {self.max_abs_diff:g} or max rel diff <= {self.max_rel_diff:g}")
        elif self.max_rel_diff is not None:
            parts.append(f"max rel diff <= {self.max_rel_diff:g}")
        elif self.max_abs_diff is not None:
            parts.append(f"max abs diff <= {self.max_abs_diff:g}")
        if self.min_top1 is not None:
            parts.append(f"top-1 agreement >= {self.min_top1:.0%}")
        return " and ".join(parts)

    def holds(self, a: Agreement) -> bool:
        ok = True
        if self.max_rel_diff is not None or self.max_abs_diff is not None:
            ok = (self.max_rel_diff is not None and a.max_rel_diff <= self.max_rel_diff) or (
                self.max_abs_diff is not None and a.max_abs_diff <= self.max_abs_diff
            )
        if self.min_top1 is not None and a.top1_agreement is not None:
            ok = ok and a.top1_agreement >= self.min_top1
        return bool(ok)


_TOP1_MIN_ROWS = 10  # top-1 agreement on fewer rows is too coarse to hold a step to

_EXACT = Tolerance(max_rel_diff=1e-4)
# int8 moves outputs by a few % of their range (more on random weights, whose margins are
# thin); this catches a broken calibration (ranges from the wrong data: rel diff ~1, top-1
# near chance), not rounding.
_INT8 = Tolerance(max_rel_diff=0.3, min_top1=0.9)


@dataclass(frozen=True)
class _StepDef:
    summary: str
    args: tuple[str, ...] = ()  # allowed argument forms, for the messages ("" = none)
    final: bool = False
    cpu_only: bool = False
    tolerance: Tolerance | None = None
    targets: bool = False  # takes :vnni / :no-vnni (the int8 setting) after its argument


_STEPS: dict[str, _StepDef] = {
    "fuse": _StepDef("fold each Conv+BN / Linear+BN pair into one layer (same outputs, one op less)",
                     tolerance=_EXACT),
    "reparam": _StepDef("fold multi-branch blocks (RepVGG, ACNet) into one conv each (same outputs)",
                        tolerance=_EXACT),
    "prune": _StepDef("remove conv channels: prune = prune:macs=0.5 (keep ~half the MACs), "
                      "prune:0.3 removes 30% of each layer's channels (accuracy drops until fine-tuned)",
                      args=("F", "macs=F")),
    "int8": _StepDef("static int8 weights and activations, calibrated; int8:pt2e / int8:fx picks the "
                     "backend (default auto: PT2E, else FX); :vnni / :no-vnni forces the int8 setting "
                     "(default: chosen for this CPU)", args=("auto", "pt2e", "fx"),
                     final=True, cpu_only=True, tolerance=_INT8, targets=True),
    "int8-dynamic": _StepDef("int8 Linear/LSTM/GRU weights, activations quantized per call "
                             "(transformers, RNNs)", final=True, cpu_only=True,
                             tolerance=Tolerance(max_rel_diff=0.1, min_top1=0.9)),
    "fp16": _StepDef("float16 weights and inputs (GPU; refused on CPU, where it is slower than fp32)",
                     final=True, tolerance=Tolerance(max_rel_diff=1e-2)),
    "bf16": _StepDef("bfloat16 weights and inputs (GPU, or a CPU with AVX512-BF16/AMX)",
                     final=True, tolerance=Tolerance(max_rel_diff=5e-2)),
    "onnx": _StepDef("export to ONNX and run the file in ONNX Runtime (CPU)", final=True, cpu_only=True,
                     tolerance=Tolerance(max_abs_diff=1e-4, max_rel_diff=1e-5)),
    "onnx-int8": _StepDef("export to ONNX, then ONNX Runtime int8: onnx-int8:static (calibrated, "
                          "default) or onnx-int8:dynamic; :vnni / :no-vnni forces the int8 setting "
                          "(default: chosen for this CPU)", args=("static", "dynamic"),
                          final=True, cpu_only=True, tolerance=_INT8, targets=True),
}

# reparam must come before these (its folds need the BNs / channel counts they change)
_AFTER_REPARAM = {"fuse": "fusing removes the BatchNorms that re-parameterization folds",
                  "prune": "pruning changes the channel counts the multi-branch blocks fold with"}


def list_steps() -> dict[str, str]:
    """Step name -> one-line description, in the order they usually chain."""
    return {name: d.summary for name, d in _STEPS.items()}


_TARGETS = ("vnni", "no-vnni")


@dataclass(frozen=True)
class _Planned:
    text: str  # as given, e.g. "prune:0.3"
    name: str
    arg: str
    mode: str = ""  # int8 / onnx-int8: the backend or mode part of arg, lower case
    int8_for: str = "auto"  # int8 / onnx-int8: auto | vnni | no-vnni


def _plan(steps: Sequence[str] | str) -> list[_Planned]:
    """Parse and check the chain (names, arguments, duplicates, order) before any work."""
    if isinstance(steps, str):
        items = [s.strip() for s in steps.split(",")]
    elif isinstance(steps, (list, tuple)) and all(isinstance(s, str) for s in steps):
        items = [s.strip() for s in steps]
    else:
        raise UserError(f"steps must be a list of step names or a comma-separated string, got {type(steps).__name__}")
    items = [s for s in items if s]
    choices = ", ".join(_STEPS)
    if not items:
        raise UserError(f"no steps given: choose from {choices}")
    plan: list[_Planned] = []
    for text in items:
        name, _, arg = text.partition(":")
        name, arg = name.strip().lower(), arg.strip()
        if name not in _STEPS:
            raise UserError(f"unknown step {name!r}: choose from {choices}")
        mode, int8_for = _check_arg(name, arg)
        plan.append(_Planned(text, name, arg, mode, int8_for))
    seen: dict[str, int] = {}
    for i, p in enumerate(plan):
        if p.name in seen:
            raise UserError(f"step {p.name!r} is given twice: give each step once")
        seen[p.name] = i
    finals = [p for p in plan if _STEPS[p.name].final]
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
    if "reparam" in seen:
        for other, why in _AFTER_REPARAM.items():
            if other in seen and seen[other] < seen["reparam"]:
                raise UserError(f"step 'reparam' cannot follow {other!r}: {why}; put reparam before {other}")
    return plan


def _check_arg(name: str, arg: str) -> tuple[str, str]:
    """Check a step's argument; return (mode, int8 target) for the int8 steps."""
    d = _STEPS[name]
    if d.targets:
        return _int8_arg(name, arg)
    if not arg:
        return "", "auto"
    if not d.args:
        raise UserError(f"step {name!r} takes no argument, got {name}:{arg}")
    if name == "prune":
        value = arg.removeprefix("macs=")
        try:
            f = float(value)
        except ValueError:
            f = math.nan
        ok = (0.0 < f <= 1.0) if arg.startswith("macs=") else (0.0 < f < 1.0)
        if not ok:
            raise UserError(
                f"bad prune argument {arg!r}: prune:F removes the share F in (0, 1) of each layer's channels "
                "(e.g. prune:0.3), prune:macs=F keeps the share F in (0, 1] of the MACs (e.g. prune:macs=0.5)"
            )
        return "", "auto"
    if arg.lower() not in d.args:
        raise UserError(f"bad argument for {name}: {arg!r}; choose {name}:" + f" or {name}:".join(d.args))
    return arg.lower(), "auto"


def _int8_arg(name: str, arg: str) -> tuple[str, str]:
    """``int8:pt2e:no-vnni``, ``onnx-int8:vnni`` ...: at most one mode and one target, any order."""
    d = _STEPS[name]
    tokens = [t.strip().lower() for t in arg.split(":")] if arg else []
    modes = [t for t in tokens if t in d.args]
    targets = [t for t in tokens if t in _TARGETS]
    if len(modes) > 1 or len(targets) > 1 or len(modes) + len(targets) != len(tokens):
        raise UserError(f"bad argument for {name}: {arg!r}; choose {name}:" + f" or {name}:".join(d.args)
                        + ", optionally followed by :vnni or :no-vnni (the int8 setting for kernels with or "
                        "without VNNI; default: chosen for this CPU)")
    return (modes[0] if modes else d.args[0]), (targets[0] if targets else "auto")


# -- results -----------------------------------------------------------------------------------


@dataclass
class StepResult:
    """One model of the chain (``"original"`` or a step) measured against the original.

    ``agreement`` compares with the original model, ``step_agreement`` with the model
    just before this step (what ``tolerance`` is about: a pruned-then-fused model differs
    from the original because of the pruning, not the fusion). ``backend`` says which
    implementation ran (``fx``/``eager`` fusion, ``pt2e``/``fx`` int8, ...); ``details`` is
    the step's own report (:class:`~torch_tricks.deploy.quantize.QuantReport` etc.) as a
    dict. ``size_bytes`` is ``torch.save(state_dict)`` bytes for modules and the file size
    for ONNX; ``latency_s``/``speedup`` map a batch size to the median seconds and to
    original / this (``None`` where the model cannot run that batch, or not measured).
    ``int8_setting`` (int8 steps): the int8 range and types the kernels got and why
    (:meth:`~torch_tricks.deploy.cpu_int8.Int8Setting.to_dict`).
    """

    step: str
    name: str
    backend: str = ""
    changed: bool = True
    seconds: float = 0.0
    agreement: Agreement | None = None
    step_agreement: Agreement | None = None
    tolerance: str | None = None
    within_tolerance: bool | None = None
    params: int = 0
    size_bytes: int = 0
    size_method: str = "torch.save(state_dict()) bytes"
    latency_s: dict[int, float | None] = field(default_factory=dict)
    latency_iqr_s: dict[int, float | None] = field(default_factory=dict)
    speedup: dict[int, float | None] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    int8_setting: dict[str, Any] | None = None
    model: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(_shallow_without_model(self)).items() if k != "model"}
        return _json_safe(d)


def _shallow_without_model(r: StepResult) -> StepResult:
    c = copy.copy(r)
    c.model = None
    return c


@dataclass
class SaveInfo:
    """What :meth:`OptimizeResult.save` wrote.

    ``format``: ``onnx``, ``torch.export`` (a ``.pt2`` program), ``torchscript`` or
    ``pickle`` (whole-model ``torch.save``); ``why`` says why that one; ``load`` how to
    read it back; ``verify_max_abs_diff`` the largest output difference between the file
    (loaded back) and the in-memory model on the example inputs (None if not verified).
    """

    path: str
    format: str
    size_bytes: int
    why: str
    load: str
    verify_max_abs_diff: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))


@dataclass
class OptimizeResult:
    """The final model of a chain, with one :class:`StepResult` per step (plus the original).

    ``model`` is the final model: an ``nn.Module``, a
    :class:`~torch_tricks.deploy.quantize.PT2EInt8Model`, or an
    :class:`~torch_tricks.deploy.export.OrtModule` for the ONNX steps (its file lives in
    a temporary folder until the result is garbage-collected or :meth:`close` d; use
    :meth:`save` to keep it). ``calibration`` says what the int8 ranges were calibrated on
    (None without a calibrated step); ``threads`` the ``torch.get_num_threads()`` the chain
    ran (and the int8 PT2E model was compiled) with.
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
    _workdir: Any = field(default=None, repr=False)

    # -- what the CLI prints --------------------------------------------------------------

    @property
    def final(self) -> StepResult:
        return self.steps[-1] if self.steps else self.original

    @property
    def ok(self) -> bool:
        """Every step within its stated tolerance (steps without one count as ok)."""
        return all(s.within_tolerance is not False for s in self.steps)

    def models(self) -> dict[str, Any]:
        """``{"original": model, step: model, ...}``: every model of the chain."""
        return {r.step: r.model for r in [self.original, *self.steps]}

    def as_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready data (for ``--json``)."""
        return _json_safe({
            "device": self.device,
            "threads": self.threads,
            "batches": list(self.batches),
            "measured": self.measured,
            "example_inputs": _describe_inputs(self.example_inputs),
            "calibration": self.calibration,
            "int8_setting": next((s.int8_setting for s in self.steps if s.int8_setting), None),
            "ok": self.ok,
            "save_format": self.save_format,
            "original": self.original.to_dict(),
            "steps": [s.to_dict() for s in self.steps],
            "saved": self.saved.to_dict() if self.saved else None,
        })

    def table_rows(self) -> tuple[list[str], list[list[str]]]:
        """``(headers, rows)`` of strings: one row for the original and one per step."""
        from torch_tricks._format import human_bytes, si

        headers = ["step", "backend", "max abs diff", "top-1", "params", "size"]
        for b in self.batches if self.measured else ():
            headers += [f"bs{b} ms", f"bs{b} x"]
        headers.append("tolerance")
        rows = []
        for r in [self.original, *self.steps]:
            a = r.agreement
            row = [
                r.step + ("" if r.changed or r is self.original else " (no-op)"),
                r.backend or "-",
                f"{a.max_abs_diff:.2e}" if a else "-",
                f"{a.top1_agreement:.1%}" if a and a.top1_agreement is not None else "-",
                si(r.params) if r.params else "-",
                human_bytes(r.size_bytes) if r.size_bytes else "-",
            ]
            for b in self.batches if self.measured else ():
                t, s = r.latency_s.get(b), r.speedup.get(b)
                row += [f"{t * 1e3:.2f}" if t is not None else "-", f"{s:.2f}" if s is not None else "-"]
            row.append("-" if r.within_tolerance is None else ("ok" if r.within_tolerance else "EXCEEDED"))
            rows.append(row)
        return headers, rows

    def format_table(self) -> str:
        """:meth:`table_rows` as a fixed-width text table."""
        from torch_tricks._format import table

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

    # -- saving ---------------------------------------------------------------------------

    @property
    def save_format(self) -> str:
        """The format :meth:`save` will write (``torch.export`` may still fall back to ``pickle``)."""
        fmt = _save_format(self.model)[0]
        return "torch.export" if fmt == "pt2e" else fmt

    @property
    def suggested_suffix(self) -> str:
        """The usual file suffix for :attr:`save_format`: ``.onnx``, ``.pt2`` (torch.export) or ``.pt``."""
        return {"onnx": ".onnx", "torch.export": ".pt2", "pt2e": ".pt2"}.get(_save_format(self.model)[0], ".pt")

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
        target = Path(path)
        fmt, why = _save_format(self.model)
        if target.suffix.lower() == ".onnx" and fmt != "onnx":
            raise UserError(
                f"{target.name}: the final model is not ONNX (it saves as {fmt}): name it .pt2/.pt, "
                "or end the steps with onnx"
            )
        example = self.example_inputs
        notes: list[str] = []
        meta = {"format": fmt, "steps": [s.step for s in self.steps], "inputs": _describe_inputs(example),
                "threads": self.threads}
        if fmt == "onnx":
            _save_onnx(self.model.path, target, notes)
            load = "torch_tricks.deploy.pipeline.load_optimized(path) or onnxruntime.InferenceSession(path)"
        elif fmt == "pt2e":
            fmt = meta["format"] = "torch.export"
            meta["kind"] = "pt2e-int8"
            meta.update(_pt2e_meta(self.model))
            ep = _export_program(self.model.quantized, example, self.model.dynamic_batch, eval_mode=False)
            _write_program(ep, target, meta)
            load = ("torch_tricks.deploy.pipeline.load_optimized(path) (compiled int8 kernels); "
                    "torch.export.load(path).module() runs the reference int8 graph uncompiled (slow)")
        elif fmt == "torchscript":
            with _quiet_torch(), torch.no_grad():
                traced = torch.jit.trace(self.model, example, check_trace=False, _store_inputs=False)
            with atomic_path(target, suffix=".pt") as tmp:
                torch.jit.save(traced, str(tmp), _extra_files={_META_NAME: json.dumps(meta)})
            load = "torch_tricks.deploy.pipeline.load_optimized(path) or torch.jit.load(path)"
        else:
            ep = None
            if fmt == "torch.export":
                try:
                    ep = _export_program(self.model, example, dynamic_batch=True)
                except Exception as exc:
                    fmt, why = "pickle", f"torch.export failed ({_one_line(exc)}), so the whole model is pickled"
            if ep is not None:
                _write_program(ep, target, meta)
                load = "torch_tricks.deploy.pipeline.load_optimized(path) or torch.export.load(path).module()"
            else:
                with atomic_path(target, suffix=".pt") as tmp, _quiet_torch():
                    torch.save(self.model, tmp)
                load = ("torch_tricks.deploy.pipeline.load_optimized(path) or torch.load(path, weights_only=False) "
                        "(trusted files only; the model's class must be importable)")
        info = SaveInfo(path=str(target), format=fmt, size_bytes=_file_bytes(target), why=why, load=load, notes=notes)
        if verify:
            info.verify_max_abs_diff = _verify(target, self.model, example)
        self.saved = info
        return info

    def close(self) -> None:
        """Delete the temporary folder holding the ONNX files (the ONNX model still runs)."""
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


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
    ``_TOP1_MIN_ROWS`` (10) rows for top-1 agreement to be held to a tolerance.
    ``measure=False`` skips the latency (agreement, params and size are always measured).
    ``progress`` is called with a short message before each phase (the library never prints).
    ``int8_for`` (``auto``, ``vnni`` or ``no-vnni``) forces the int8 setting of the chain's
    ``int8`` / ``onnx-int8`` step, like ``:vnni`` / ``:no-vnni`` on the step; ``auto``
    chooses it for this CPU (the saturation-free one where the int8 kernels have no VNNI).

    Returns an :class:`OptimizeResult`; the input model is never changed (its weights,
    buffers and train/eval mode), also when a step raises.
    """
    plan = _plan(steps)
    plan = _with_int8_for(plan, int8_for)
    dev = _device(device)
    batches = _batches(batches, measure)
    if not isinstance(model, nn.Module):
        raise UserError(f"optimize needs an nn.Module, got {type(model).__name__}")
    for p in plan:
        _check_device(p, dev)
    for p in plan:
        _check_dependencies(p)
    report = progress or (lambda _msg: None)

    try:
        reference = copy.deepcopy(model)
    except Exception as exc:
        raise UserError(
            f"optimize works on a copy of the model and {type(model).__name__} cannot be deep-copied "
            f"({_one_line(exc)}): make its attributes copyable"
        ) from None
    reference.eval().to(dev)
    example = _to_device(as_input_tuple(example_inputs), dev)
    check = _to_device(as_input_tuple(check_inputs), dev) if check_inputs is not None else example
    _check_inputs_match(example, check)
    try:
        with torch.inference_mode():
            reference(*example)
    except Exception as exc:
        raise UserError(f"the model does not run on the example inputs ({_one_line(exc)}): check their shape") from None

    needs_calib = any(p.name == "int8" or (p.name == "onnx-int8" and p.mode != "dynamic") for p in plan)
    calib_batches, calib_text = (_calibration(calib, example, dev) if needs_calib else (None, None))

    workdir = tempfile.TemporaryDirectory(prefix="torch_tricks_optimize_") if any(
        p.name.startswith("onnx") for p in plan) else None
    original = StepResult(step="original", name="original", backend="eager", changed=False, model=reference)
    _measure_static(original, reference, reference, check)
    results: list[StepResult] = []
    current: Any = reference
    for i, p in enumerate(plan, 1):
        report(f"[{i}/{len(plan)}] {p.text}")
        ctx = _Ctx(example=example, calib=calib_batches, device=dev, workdir=workdir, index=i,
                   for_vnni={"auto": None, "vnni": True, "no-vnni": False}[p.int8_for])
        t0 = time.perf_counter()
        try:
            new, res = _apply(p, current, ctx)
        except UserError as exc:
            why = _CANNOT_APPLY.sub("", _one_line(exc, with_type=False))  # said once is enough
            raise UserError(f"step {p.text!r} cannot apply: {why}") from None
        res.seconds = time.perf_counter() - t0
        res.model = new
        _measure_static(res, reference, new, check, previous=current)
        if _STEPS[p.name].final:  # a conversion keeps the weights: count them in the model before it
            res.params = results[-1].params if results else original.params
        tol = _STEPS[p.name].tolerance
        if tol is not None and res.step_agreement is not None:
            rows = _rows(check)
            if rows is not None and rows < _TOP1_MIN_ROWS and tol.min_top1 is not None:
                tol = Tolerance(tol.max_rel_diff, tol.max_abs_diff, None)
            res.tolerance = tol.describe()
            res.within_tolerance = tol.holds(res.step_agreement)
        results.append(res)
        current = new

    if measure:
        _measure_latency([original, *results], example, batches, warmup, repeats, report)
    return OptimizeResult(
        model=current, original=original, steps=results, device=str(dev), batches=tuple(batches),
        threads=torch.get_num_threads(), measured=measure, example_inputs=example,
        calibration=calib_text, _workdir=workdir,
    )


@dataclass
class _Ctx:
    example: tuple[Any, ...]
    calib: list[tuple[Any, ...]] | None
    device: torch.device
    workdir: Any
    index: int
    for_vnni: bool | None = None  # the int8 setting for kernels with / without VNNI; None = this CPU's


def _with_int8_for(plan: list[_Planned], int8_for: Any) -> list[_Planned]:
    """Apply ``optimize(int8_for=...)`` to the chain's int8 step (checked before any work)."""
    if not isinstance(int8_for, str) or int8_for.strip().lower() not in ("auto", *_TARGETS):
        raise UserError(f"the int8 target (int8_for, --int8-for) must be auto, vnni or no-vnni, not {int8_for!r}")
    want = int8_for.strip().lower()
    if want == "auto":
        return plan
    int8 = [p for p in plan if p.name in ("int8", "onnx-int8", "int8-dynamic")]
    if not int8:
        raise UserError(f"int8 target {want!r} given, but the chain has no int8 or onnx-int8 step")
    p = int8[0]
    if p.name == "int8-dynamic":
        if want == "vnni":
            raise UserError("int8-dynamic has one setting: torch.ao's dynamic kernels always quantize activations "
                            "to 7 bits (exact with or without VNNI); use onnx-int8:dynamic:vnni")
        return plan
    if p.int8_for not in ("auto", want):
        raise UserError(f"int8 target given twice: step {p.text!r} says {p.int8_for}, int8_for says {want}")
    return [dataclasses.replace(q, int8_for=want) if q is p else q for q in plan]


def _apply(p: _Planned, model: Any, ctx: _Ctx) -> tuple[Any, StepResult]:
    """Run one step on ``model`` (never changed: every step function works on a copy)."""
    res = StepResult(step=p.text, name=p.name)
    if p.name == "fuse":
        from torch_tricks.deploy.fuse import fuse_with_report

        new, rep = fuse_with_report(model, example_inputs=ctx.example)
        res.backend = rep.method
        res.changed = bool(rep.fused)
        res.details = {"fused": len(rep.fused), "batchnorm_before": rep.batchnorm_before,
                       "batchnorm_after": rep.batchnorm_after, "kept_batchnorm": rep.kept_batchnorm}
        done = "nothing folded: the step is a no-op"
        if rep.fused:
            done = (f"folded {len(rep.fused)} Conv/Linear+BN pairs: BatchNorm layers "
                    f"{rep.batchnorm_before} -> {rep.batchnorm_after}")
        res.notes = [done, *rep.notes]
    elif p.name == "reparam":
        from torch_tricks.deploy.reparam import reparameterize_with_report

        new, rep = reparameterize_with_report(model)
        res.backend = "reparameterize()"
        res.changed = bool(rep.folded)
        res.details = {"folded": len(rep.folded), "block_types": sorted(set(rep.folded.values())),
                       "already_folded": len(rep.already_folded)}
        res.notes = list(rep.notes)
    elif p.name == "prune":
        from torch_tricks.deploy.prune import prune_channels_with_report

        if p.arg and not p.arg.startswith("macs="):
            amount, target = float(p.arg), None
        else:
            amount, target = None, float(p.arg.removeprefix("macs=") or 0.5)
        new, rep = prune_channels_with_report(model, ctx.example, amount, target_macs=target)
        new.eval()
        res.backend = "torch.fx channel pruning"
        res.details = {"amount": rep.amount, "target_macs": rep.target_macs, "macs_before": rep.macs_before,
                       "macs_after": rep.macs_after, "mac_ratio": rep.mac_ratio,
                       "params_before": rep.params_before, "params_after": rep.params_after,
                       "groups_pruned": len(rep.groups), "layers_skipped": len(rep.skipped)}
        res.notes = [f"removed {rep.amount:.0%} of the channels of {len(rep.groups)} layer groups: "
                     f"{rep.mac_ratio:.0%} of the MACs kept", *rep.notes]
    elif p.name == "int8":
        from torch_tricks.deploy.quantize import quantize_static_int8

        new, rep = quantize_static_int8(model, ctx.calib, ctx.example, backend=p.mode or "auto",
                                        reduce_range=None if ctx.for_vnni is None else not ctx.for_vnni)
        res.backend = rep.backend
        res.size_method = rep.size_method
        res.details = _quant_details(rep)
        res.notes = list(rep.notes)
        res.int8_setting = rep.int8_setting
    elif p.name == "int8-dynamic":
        from torch_tricks.deploy.quantize import quantize_dynamic_int8

        new, rep = quantize_dynamic_int8(model)
        res.backend = rep.backend
        res.details = _quant_details(rep)
        res.notes = list(rep.notes)
        res.int8_setting = rep.int8_setting
    elif p.name in ("fp16", "bf16"):
        from torch_tricks.deploy.quantize import cast_half

        new, rep = cast_half(model, torch.float16 if p.name == "fp16" else torch.bfloat16, ctx.device)
        res.backend = rep.backend
        res.details = _quant_details(rep)
        res.notes = list(rep.notes)
    elif p.name in ("onnx", "onnx-int8"):
        new = _onnx_step(p, model, ctx, res)
    else:  # pragma: no cover - _plan only lets known names through
        raise AssertionError(p.name)
    return new, res


def _onnx_step(p: _Planned, model: nn.Module, ctx: _Ctx, res: StepResult) -> Any:
    from torch_tricks.deploy.export import OrtModule, export_onnx_checked, onnx_size_bytes, ort_int8_setting, \
        ort_quantize_dynamic, ort_quantize_static

    path = Path(ctx.workdir.name) / f"step{ctx.index}.onnx"
    try:
        with _quiet_torch():  # a failed capture prints its partial graph and log lines
            exp = export_onnx_checked(model, ctx.example, path)
    except UserError:
        raise
    except Exception as exc:
        # the exporter wraps the real reason ("step 1/3 of exporting ... Next steps: ...")
        raise UserError(f"torch.onnx.export failed: {_one_line(exc.__cause__ or exc)}") from None
    res.details = {"export": {k: v for k, v in exp.to_dict().items() if k != "path"}}
    res.notes = list(exp.notes)
    if p.name == "onnx":
        ort = OrtModule(path)
        res.backend = "onnxruntime " + ",".join(ort.providers)
    else:
        qpath = path.with_name(f"step{ctx.index}.int8.onnx")
        mode = p.mode or "static"
        setting = ort_int8_setting(mode, None if ctx.for_vnni is None else "int8" if ctx.for_vnni else "uint8")
        try:
            if mode == "static":
                ort_quantize_static(path, qpath, ctx.calib, weight_type=setting.weight_type)
            else:
                ort_quantize_dynamic(path, qpath, weight_type=setting.weight_type)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"ONNX Runtime int8 quantization failed: {_one_line(exc)}") from None
        ort = OrtModule(qpath)
        res.backend = f"onnxruntime {mode} int8" + (" (QDQ, per-channel)" if mode == "static" else "")
        res.details["fp32_size_bytes"] = onnx_size_bytes(path)
        res.int8_setting = setting.to_dict()
        res.notes.append(f"int8 setting: {setting.describe()}")
    res.size_method = "ONNX file bytes (with external data)"
    res.details["threads"] = torch.get_num_threads()
    res.notes.append(f"ONNX Runtime runs with {torch.get_num_threads()} intra-op threads (torch.get_num_threads())")
    return ort


def _quant_details(rep: Any) -> dict[str, Any]:
    d = rep.to_dict()
    d.pop("agreement", None)  # measured by optimize itself, against the original
    d.pop("notes", None)
    d.pop("int8_setting", None)  # a field of the step itself
    return d


# -- measuring ----------------------------------------------------------------------------------


def _measure_static(res: StepResult, reference: nn.Module, model: Any, check: tuple[Any, ...],
                    previous: Any | None = None) -> None:
    from torch_tricks.deploy.export import OrtModule

    if previous is not None:
        try:
            with _quiet_torch():
                res.agreement = agreement(reference, model, check)
                res.step_agreement = res.agreement if previous is reference else agreement(previous, model, check)
        except UserError as exc:  # e.g. a fixed-batch PT2E model given check_inputs of another batch size
            res.notes.append(f"outputs not compared: {_one_line(exc, with_type=False)}")
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
        runnable: dict[str, Any] = {}
        for r in results:
            try:
                with torch.inference_mode(), _quiet_torch():
                    r.model(*inputs)  # also compiles a PT2E model for this batch size
                runnable[r.step] = r.model
            except Exception as exc:
                r.latency_s[b] = r.latency_iqr_s[b] = r.speedup[b] = None
                r.notes.append(f"not timed at batch {b}: {_one_line(exc, with_type=False)}")
        with _quiet_torch():
            timings = compare_latency(runnable, inputs, warmup=warmup, repeats=repeats)
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
    n = _rows(example)
    if n is None:
        return example
    out = []
    for a in example:
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n:
            if batch > n:
                a = a.repeat(math.ceil(batch / n), *([1] * (a.dim() - 1)))
            a = a[:batch].contiguous()
        out.append(a)
    return tuple(out)


def _rows(args: tuple[Any, ...]) -> int | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
    return None


# -- calibration --------------------------------------------------------------------------------

_RANDOM_CALIB_BATCHES = 8


def _calibration(calib: Iterable[Any] | None, example: tuple[Any, ...],
                 dev: torch.device) -> tuple[list[tuple[Any, ...]], str]:
    if calib is not None:
        if isinstance(calib, torch.Tensor):
            raise UserError("calib must be an iterable of batches (a list of tensors, a DataLoader), not one tensor: "
                            "wrap it as [tensor]")
        batches = []
        for b in calib:
            args = as_input_tuple(b)
            if len(example) == 1 and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args):
                args = args[:1]  # (inputs, target) pairs from a DataLoader
            if len(args) != len(example):
                raise UserError(f"a calib batch has {len(args)} inputs, the example inputs {len(example)}: "
                                "give batches shaped like example_inputs")
            batches.append(_to_device(args, dev))
        if not batches:
            raise UserError("calib is empty: give a few batches of real inputs")
        rows = sum(_rows(b) or 1 for b in batches)
        return batches, f"{len(batches)} batches ({rows} samples) given in calib"
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
        x = a.float()
        dims = [d for d in range(x.dim()) if d != 1] if x.dim() >= 2 else list(range(x.dim()))
        mean = x.mean(dim=dims, keepdim=True) if dims else x
        std = x.std(dim=dims, keepdim=True).nan_to_num(0.0) if dims and x.numel() > 1 else torch.zeros_like(mean)
        noise = torch.randn(a.shape, generator=gen).to(a.device)
        return (noise * std + mean).to(a.dtype)
    if a.dtype == torch.bool:
        return torch.randint(0, 2, a.shape, generator=gen).bool().to(a.device)
    lo, hi = int(a.min()), int(a.max())
    return torch.randint(lo, hi + 1, a.shape, generator=gen).to(a.dtype).to(a.device)


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


def _check_device(p: _Planned, dev: torch.device) -> None:
    from torch_tricks.deploy.quantize import _cpu_flag

    if _STEPS[p.name].cpu_only and dev.type != "cpu":
        raise UserError(f"step {p.name!r} runs on CPU kernels (int8 / ONNX Runtime CPU): use device='cpu', "
                        "or fp16/bf16 on the GPU")
    if p.name == "fp16" and dev.type == "cpu" and not _cpu_flag("_is_amx_fp16_supported"):
        raise UserError("fp16 on CPU is slower than fp32 (no native fp16 kernels without AMX-FP16): "
                        "use bf16 or int8, or run on cuda")
    if p.name == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("this GPU has no native bf16 (needs compute capability >= 8.0): use fp16")


def _check_dependencies(p: _Planned) -> None:
    if p.name.startswith("onnx"):
        for mod in ("onnx", "onnxscript", "onnxruntime"):
            require(mod, "onnx", f"step {p.name!r}")
    if p.name == "int8" and p.mode == "pt2e":
        from torch_tricks.deploy.quantize import _import_torchao_pt2e

        if _import_torchao_pt2e() is None:
            raise UserError(f"step 'int8:pt2e' needs torchao: {install_hint('deploy')}, or use int8:fx")


def _check_inputs_match(example: tuple[Any, ...], check: tuple[Any, ...]) -> None:
    def spec(args: tuple[Any, ...]) -> list[Any]:
        return [(a.dtype, tuple(a.shape[1:])) if isinstance(a, torch.Tensor) and a.dim() else type(a) for a in args]

    if spec(example) != spec(check):
        raise UserError(f"check_inputs ({_describe_inputs(check)}) must match example_inputs "
                        f"({_describe_inputs(example)}) except for the batch size")


def _to_device(args: tuple[Any, ...], dev: torch.device) -> tuple[Any, ...]:
    return tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)


# -- saving and loading -------------------------------------------------------------------------


def _save_format(model: Any) -> tuple[str, str]:
    """(format, why) for the final model; ``pt2e`` is written as ``torch.export``."""
    from torch_tricks.deploy.export import OrtModule
    from torch_tricks.deploy.quantize import PT2EInt8Model

    if isinstance(model, OrtModule):
        return "onnx", "the final step runs in ONNX Runtime: the .onnx file it ran is the model"
    if isinstance(model, PT2EInt8Model):
        return "pt2e", ("the PT2E int8 graph is a torch.export program: saved with torch.export.save "
                        "(load_optimized compiles it again with inductor)")
    kinds = {type(m).__module__ for m in model.modules()}
    if any(k.startswith("torch.ao.nn.quantized.dynamic") for k in kinds):
        return "pickle", ("torch.export cannot serialize torch.ao's packed int8 weights and a trace would "
                          "freeze the model's Python control flow: the whole model is pickled")
    if any(k.startswith(("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")) for k in kinds):
        return "torchscript", ("torch.export cannot serialize torch.ao's packed int8 weights and the FX int8 "
                               "GraphModule does not pickle; a TorchScript trace of the FX graph is exact")
    return "torch.export", "a self-contained program (no Python class needed to load it), dynamic batch"


def _export_program(model: nn.Module, example: tuple[Any, ...], dynamic_batch: bool, *, eval_mode: bool = True) -> Any:
    """``torch.export`` of ``model`` (eval mode, MHA fast path off), batch dim dynamic if possible.

    ``eval_mode=False`` for an already exported graph (PT2E), which refuses ``.eval()``.
    """
    from torch_tricks.inspect.graph import in_eval_mode

    last: Exception | None = None
    for dynamic in ((True, False) if dynamic_batch else (False,)):
        args, shapes = example, None
        if dynamic:
            args, shapes = _dynamic_batch(example)
        try:
            with (in_eval_mode(model) if eval_mode else contextlib.nullcontext()), _quiet_torch():
                return torch.export.export(model, args, dynamic_shapes=shapes)
        except Exception as exc:
            last = exc
    assert last is not None
    raise last


def _write_program(ep: Any, target: Path, meta: dict[str, Any]) -> None:
    """``torch.export.save`` without the example inputs (they would be stored in the file:
    9.6 MB for 16 images at 224x224), atomically, with ``meta`` as an extra file."""
    ep.example_inputs = None
    with atomic_path(target, suffix=".pt2") as tmp, open(tmp, "wb") as fh:
        torch.export.save(ep, fh, extra_files={_META_NAME: json.dumps(meta)})


def _dynamic_batch(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
    n = _rows(args)
    if n is None:
        return args, None
    dim = torch.export.Dim("batch", min=1, max=1 << 16)
    new, shapes = [], []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == n:
            new.append(torch.cat([a, a]) if n == 1 else a)  # a size-1 dim would be specialised
            shapes.append({0: dim})
        else:
            new.append(a)
            shapes.append(None)
    return tuple(new), tuple(shapes)


def _pt2e_meta(model: Any) -> dict[str, Any]:
    return {"dynamic_batch": bool(model.dynamic_batch), "cpp_wrapper": bool(model.cpp_wrapper),
            "example": [{"shape": [model._batch or 1, *s[1]], "dtype": s[0]} if isinstance(s, tuple) else None
                        for s in model._spec]}


def _save_onnx(src: Path, target: Path, notes: list[str]) -> None:
    import onnx

    if not src.is_file():
        raise UserError("the ONNX file is gone (OptimizeResult.close() deletes it): save before closing")

    m = onnx.load(str(src), load_external_data=False)
    side = sorted({e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"})
    for s in side:  # external data is referenced by its file name: keep the name, beside the model
        with atomic_path(target.parent / s) as tmp:
            shutil.copyfile(src.parent / s, tmp)
        notes.append(f"external weights written to {s} beside the model (keep them together)")
    with atomic_path(target, suffix=".onnx") as tmp:
        shutil.copyfile(src, tmp)


def _file_bytes(path: Path) -> int:
    from torch_tricks.deploy.export import onnx_size_bytes

    try:
        return onnx_size_bytes(path) if not zipfile.is_zipfile(path) else path.stat().st_size
    except Exception:
        return path.stat().st_size


def _verify(path: Path, model: Any, example: tuple[Any, ...]) -> float:
    from torch_tricks.deploy.export import OrtModule
    from torch_tricks.deploy.quantize import PT2EInt8Model

    loaded = load_optimized(path, compile=False)
    reference = model.quantized if isinstance(model, PT2EInt8Model) else model
    try:
        with torch.inference_mode(), _quiet_torch():
            a = loaded(*example)
            b = reference(*example)
    except Exception as exc:
        raise UserError(f"{path.name} was written but does not run when loaded back: {_one_line(exc)}") from None
    if isinstance(model, OrtModule):
        return 0.0 if torch.equal(_first(a), _first(b)) else float((_first(a).float() - _first(b).float()).abs().max())
    return float((_first(a).float() - _first(b).float()).abs().max())


def load_optimized(path: str | os.PathLike[str], *, compile: bool = True) -> Any:
    """Read back a file written by :meth:`OptimizeResult.save` (any of its formats).

    Returns a callable model: an :class:`~torch_tricks.deploy.export.OrtModule` for ONNX,
    the ``torch.export`` program's module (a PT2E int8 program is wrapped in
    :class:`~torch_tricks.deploy.quantize.PT2EInt8Model` again, which compiles it on the
    first call, unless ``compile=False``), the TorchScript module, or the unpickled model
    (``weights_only=False``: load only files you trust).
    """
    from torch_tricks.deploy.export import OrtModule

    p = Path(path)
    if not p.is_file():
        raise UserError(f"no saved model at {str(p)!r}")
    if not zipfile.is_zipfile(p):
        return OrtModule(p)
    with zipfile.ZipFile(p) as z:
        names = z.namelist()
    if any(n.endswith("/archive_format") for n in names):
        extra = {_META_NAME: ""}
        with _quiet_torch():
            ep = torch.export.load(str(p), extra_files=extra)
        meta = json.loads(extra[_META_NAME] or "{}")
        module = ep.module()
        if meta.get("kind") == "pt2e-int8" and compile:
            from torch_tricks.deploy.quantize import PT2EInt8Model

            example = tuple(torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in meta["example"])
            return PT2EInt8Model(module, example, meta.get("dynamic_batch", True),
                                 cpp_wrapper=meta.get("cpp_wrapper", True))
        return module
    if any(n.endswith("/constants.pkl") for n in names):
        with _quiet_torch():
            return torch.jit.load(str(p))
    try:
        with _quiet_torch():
            return torch.load(str(p), weights_only=False)
    except Exception as exc:
        raise UserError(f"cannot load {p.name} ({_one_line(exc)}): is the model's class importable?") from None


# -- helpers ------------------------------------------------------------------------------------


def _onnx_params(path: Path) -> int:
    try:
        import onnx

        m = onnx.load(str(path), load_external_data=False)
        return sum(math.prod(t.dims) for t in m.graph.initializer)
    except Exception:
        return 0


def _first(out: Any) -> torch.Tensor:
    from torch_tricks.deploy.step_report import _first_tensor

    return _first_tensor(out)


def _describe_inputs(args: tuple[Any, ...]) -> str:
    from torch_tricks.inspect.inputs import describe_inputs

    return describe_inputs(args)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CANNOT_APPLY = re.compile(r"^[\w ()-]{0,40}? cannot apply: ")


def _one_line(exc: BaseException, with_type: bool = True) -> str:
    """:func:`one_line` without the colour codes torch puts in some messages for terminals."""
    return _ANSI.sub("", one_line(exc, 300, with_type=with_type))


@contextlib.contextmanager
def _quiet_torch() -> Any:
    """Warnings and torch log lines off around calls into torch's export / ao / jit code."""
    from torch_tricks.deploy.quantize import _quiet

    with _quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    return str(obj)
