"""Export to ONNX and check the file in ONNX Runtime (catalogue I7).

An exported file is only useful if another engine computes the same thing with it, so
:func:`export_onnx_checked` does not stop at writing the file: it runs it in ONNX Runtime
and compares the outputs with eager PyTorch, at the example batch and (with a dynamic
batch) at batch 1. The export itself is :func:`torch_tricks.inspect.graph.export_onnx`
(``torch.onnx.export``, dynamo exporter). :class:`OrtModule` wraps an ONNX Runtime session
as a callable that takes and returns torch tensors, so
:func:`torch_tricks.deploy.step_report.report` times and compares it like any model;
:func:`ort_quantize_dynamic` and :func:`ort_quantize_static` make ONNX Runtime's own int8
versions (to compare with PyTorch's int8), with u8 weights where ORT's int8 kernels have no
VNNI and s8 weights would saturate (:func:`ort_int8_setting`).

ONNX Runtime is imported lazily: without it these functions raise a :class:`UserError`
saying how to install it, and the rest of the package works.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from torch_tricks._io import atomic_path
from torch_tricks._optional import available, require
from torch_tricks.deploy.cpu_int8 import Int8Setting, int8_setting
from torch_tricks.errors import UserError
from torch_tricks.inspect.inputs import as_input_tuple
from torch_tricks.deploy.steps import INT8, StepContext, StepResult, Tolerance, deploy_step, plain_line, quiet_torch
from torch_tricks.inspect.graph import export_onnx

__all__ = [
    "ExportReport",
    "OrtModule",
    "export_onnx_checked",
    "onnx_size_bytes",
    "ort_int8_setting",
    "ort_quantize_dynamic",
    "ort_quantize_static",
]


@dataclass
class ExportReport:
    """The exported file and how closely ONNX Runtime reproduces eager PyTorch on it.

    ``ok`` is ``max_abs_diff <= atol``; ``checked_batches`` the batch sizes compared
    (the example batch, and 1 when the batch dim is dynamic).
    """

    path: str
    ok: bool
    atol: float
    max_abs_diff: float
    max_rel_diff: float
    checked_batches: list[int]
    size_bytes: int
    dynamic_batch: bool
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    providers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_onnx_checked(
    model: nn.Module,
    inputs: Any,
    path: str | os.PathLike[str],
    *,
    atol: float = 1e-4,
    opset: int | None = None,
    dynamic_batch: bool = True,
) -> ExportReport:
    """Export ``model`` to ``path`` as ONNX, run the file in ONNX Runtime (CPU), compare with eager.

    The comparison uses the model in eval mode (each module's mode is restored after) on
    ``inputs``, and on their first row too when ``dynamic_batch`` and the batch is larger
    than 1, which checks that the batch dim really is dynamic. Every output tensor is
    compared. A mismatch does not raise: check ``report.ok`` (a model with a large dynamic
    range may need a looser ``atol``).
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"onnx export needs an nn.Module, got {type(model).__name__}")
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or atol < 0:
        raise UserError(f"atol must be a non-negative number, got {atol!r}")
    _ort()  # fail before spending time on the export
    args = as_input_tuple(inputs)
    target = export_onnx(model, args, path, opset=opset, dynamic_batch=dynamic_batch)
    ort_model = OrtModule(target)

    max_abs, max_rel, checked = _compare_with_eager(model, ort_model, _batches_to_check(args, dynamic_batch))
    rep = ExportReport(
        path=str(target), ok=max_abs <= atol, atol=float(atol), max_abs_diff=max_abs, max_rel_diff=max_rel,
        checked_batches=checked, size_bytes=onnx_size_bytes(target), dynamic_batch=dynamic_batch,
        input_names=list(ort_model.input_names), output_names=list(ort_model.output_names),
        providers=list(ort_model.providers),
    )
    if not rep.ok:
        rep.notes.append(f"max abs diff {max_abs:.3g} exceeds atol {atol:g}")
    return rep


class OrtModule:
    """An ONNX Runtime session that is called like a model: torch tensors in, torch tensors out.

    One output comes back as a tensor, several as a tuple. ``threads`` (intra-op) defaults
    to ``torch.get_num_threads()``, so timings against eager PyTorch use the same cores
    (ONNX Runtime would otherwise take all of them). Graph optimisations are on (ORT's
    default level, which includes its own Conv+BN/activation fusions).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        threads: int | None = None,
    ) -> None:
        ort = _ort()
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"no ONNX file at {str(self.path)!r}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(threads or torch.get_num_threads())
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3  # errors only: ORT's warnings go to stderr, and the library never prints
        try:
            self.session = ort.InferenceSession(str(self.path), opts, providers=list(providers))
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"ONNX Runtime cannot load {self.path.name}: {first[:300]}") from None
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.providers = self.session.get_providers()

    @property
    def size_bytes(self) -> int:
        """Bytes of the file and its external-data side files."""
        return onnx_size_bytes(self.path)

    def __call__(self, *args: Any) -> Any:
        tensors = [a for a in args if a is not None]
        if len(tensors) != len(self.input_names):
            raise UserError(
                f"{self.path.name} takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                f"got {len(tensors)}"
            )
        feeds = {n: _numpy(a) for n, a in zip(self.input_names, tensors)}
        outs = [torch.from_numpy(o) for o in self.session.run(None, feeds)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __repr__(self) -> str:
        return f"OrtModule({str(self.path)!r}, providers={self.providers})"


def onnx_size_bytes(path: str | os.PathLike[str]) -> int:
    """Size of an ONNX file plus the external-data files it references (what it costs on disk)."""
    p = Path(path)
    total = p.stat().st_size
    if available("onnx"):
        total += _external_data_bytes(p)
    return total


def _external_data_bytes(p: Path) -> int:
    """Bytes of the external-data files the ONNX file ``p`` references (those that exist)."""
    import onnx

    m = onnx.load(str(p), load_external_data=False)
    side = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    return sum((p.parent / s).stat().st_size for s in side if (p.parent / s).is_file())


def ort_int8_setting(mode: str, weight_type: str | None = None) -> Int8Setting:
    """The int8 setting :func:`ort_quantize_dynamic` (``mode="dynamic"``) or
    :func:`ort_quantize_static` (``"static"``) uses on this CPU, or with ``weight_type``
    (``"int8"`` / ``"uint8"``) forced.

    Activations are u8 (dynamic: ``DynamicQuantizeLinear``; static: QDQ u8, see
    :func:`ort_quantize_static`). Weights: s8 where MLAS has VNNI/AMX (its fast U8S8
    kernels, exact there); u8 where it has not, because ORT's U8S8 kernels would add pairs
    of products in the saturating int16 of ``VPMADDUBSW`` while its U8U8 kernels widen both
    factors to 16 bits first (``VPMADDWD`` into int32): exact on every x86 CPU. Static int8
    takes u8 weights on every CPU (see :mod:`torch_tricks.deploy.cpu_int8`).
    """
    if mode not in ("dynamic", "static"):
        raise UserError(f"ONNX Runtime int8 mode must be dynamic or static, not {mode!r}")
    if weight_type not in (None, "int8", "uint8"):
        raise UserError(f"weight_type must be 'int8', 'uint8' or None (chosen for this CPU), not {weight_type!r}")
    runtime = "onnxruntime-static" if mode == "static" else "onnxruntime"
    return int8_setting(runtime, None if weight_type is None else weight_type == "int8")


def ort_quantize_dynamic(
    path_in: str | os.PathLike[str],
    path_out: str | os.PathLike[str],
    *,
    per_channel: bool = False,
    op_types: Sequence[str] | None = None,
    weight_type: str | None = None,
) -> Path:
    """ONNX Runtime's dynamic int8 quantization of an ONNX file: int8 weights, activations
    quantized on the fly (``onnxruntime.quantization.quantize_dynamic``).

    Best for matmul-heavy models (linear, LSTM, attention); on conv nets ORT's static
    quantization is the faster choice. ``op_types`` restricts the operators quantized
    (e.g. ``["MatMul", "Gemm"]``). ``weight_type``: None = chosen for this CPU by
    :func:`ort_int8_setting` (s8 where ORT's kernels have VNNI, u8 where they would
    saturate), ``"int8"`` / ``"uint8"`` force it. Written atomically to ``path_out``.
    """
    _ort()
    from onnxruntime.quantization import quantize_dynamic

    setting = ort_int8_setting("dynamic", weight_type)
    src = _existing(path_in)
    with _workdir(path_out) as d, atomic_path(path_out, suffix=".onnx") as tmp, _quiet_root_logger():
        quantize_dynamic(_without_value_info(src, d), tmp, per_channel=per_channel, weight_type=_qtype(setting),
                         op_types_to_quantize=list(op_types) if op_types else None)
    return Path(path_out)


def ort_quantize_static(
    path_in: str | os.PathLike[str],
    path_out: str | os.PathLike[str],
    calibration_inputs: Iterable[Any],
    *,
    per_channel: bool = True,
    preprocess: bool = True,
    weight_type: str | None = None,
) -> Path:
    """ONNX Runtime's static int8 quantization (QDQ format, u8 activations, u8 or s8 weights).

    ``calibration_inputs`` is an iterable of model inputs (a tensor, or a tuple for several
    inputs), each one batch. An activation's range is the mean over the batches of each
    batch's min and max (ORT's ``CalibMovingAverage``), not the extremes over all of
    them, so one outlier batch does not coarsen the int8 step of a tensor for every input.
    ``per_channel`` gives each conv output channel its own weight scale (the accurate
    choice for convs). ``preprocess`` first runs ORT's ``quant_pre_process`` (shape
    inference and graph optimisation, which folds BN into convs so each conv is quantized
    once), as ORT recommends. ``weight_type``: None = u8 (see :func:`ort_int8_setting`),
    ``"int8"`` forces s8 weights (ORT's U8S8 kernels: faster where VNNI exists, they
    saturate where it does not). Written atomically.

    The price of u8 weights is speed where VNNI exists: ORT has VNNI / AMX kernels for
    U8S8 only. Measured on this project's AMX machine, ResNet-18 at 224x224, batch 1, one
    thread: U8U8 23 ms, about ORT fp32's 21 ms; U8S8 8.7 ms, but 2.7 points less top-1
    agreement on the deploy benchmark (93.0% against 95.7%, below its 95% target).

    Activations are u8, not ORT's documented default s8: on x86 ORT 1.32 converts s8 QDQ
    pairs back to u8 only around some nodes, and measured on ResNet-18 that left 11 of 20
    convolutions and every residual add in fp32 between Q/DQ pairs (no faster than fp32),
    while u8 activations run all 20 as ``QLinearConv`` and the adds as ``QLinearAdd``.
    """
    _ort()
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    setting = ort_int8_setting("static", weight_type)
    src = _existing(path_in)
    batches = [as_input_tuple(b) for b in calibration_inputs]
    if not batches:
        raise UserError("ort_quantize_static needs at least one calibration batch")
    session = OrtModule(src)
    names = session.input_names
    for b in batches:
        if len(b) != len(names):
            raise UserError(f"calibration batches need {len(names)} inputs ({', '.join(names)}), got {len(b)}")

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(batches)

        def get_next(self) -> dict[str, Any] | None:
            b = next(self._it, None)
            return None if b is None else {n: _numpy(t) for n, t in zip(names, b)}

        def rewind(self) -> None:
            self._it = iter(batches)

    with _workdir(path_out) as d, _quiet_root_logger():
        model_in = _without_value_info(src, d)
        if preprocess:
            model_in = _preprocessed(model_in, d)
        with atomic_path(path_out, suffix=".onnx") as tmp:
            quantize_static(
                model_in, tmp, _Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                activation_type=QuantType.QUInt8, weight_type=_qtype(setting),
                extra_options={"CalibMovingAverage": True},
            )
    return Path(path_out)


# -- the deploy steps ---------------------------------------------------------------------------


@deploy_step(
    "onnx",
    summary="export to ONNX and run the file in ONNX Runtime (CPU)",
    final=True,
    cpu_only=True,
    tolerance=Tolerance(max_abs_diff=1e-4, max_rel_diff=1e-5),
    check_needs=lambda mode: _require_onnx("onnx"),
    needs_workdir=True,
    writes_onnx=True,
    order=80,
    ids=("I7",),
    earlier_name="onnx_export",
    fn=export_onnx_checked,
    trades="a file other engines run (ONNX Runtime, TensorRT, Netron) for an export step and a fixed graph",
    needs="the onnx, onnxscript and onnxruntime packages; a model torch.export can capture",
    measured_in="benchmarks/deploy.py",
)
def onnx_step(model: nn.Module, ctx: StepContext) -> tuple[OrtModule, StepResult]:
    """The ``onnx`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: the exported file, run by ONNX Runtime."""
    path, res = _export_for_step(model, ctx)
    ort = OrtModule(path)
    res.backend = "onnxruntime " + ",".join(ort.providers)
    return ort, _with_ort_notes(res)


_FORCED_WEIGHT_TYPE = {None: None, True: "int8", False: "uint8"}  # for_vnni -> ORT weight type (None: auto)


@deploy_step(
    "onnx-int8",
    summary="export to ONNX, then ONNX Runtime int8: onnx-int8:static (calibrated, default) or "
            "onnx-int8:dynamic; :vnni / :no-vnni forces the int8 setting (default: chosen for this CPU)",
    args=("static", "dynamic"),
    final=True,
    cpu_only=True,
    tolerance=INT8,
    targets=True,
    check_needs=lambda mode: _require_onnx("onnx-int8"),
    needs_calib=lambda mode: mode != "dynamic",
    needs_workdir=True,
    writes_onnx=True,
    order=90,
    ids=("I7", "I3"),
    fn=ort_quantize_static,
    trades="int8 weights and activations in ONNX Runtime (about 4x smaller, faster on x86 CPUs) for a calibration "
           "pass and a small accuracy loss",
    needs="onnx, onnxscript and onnxruntime ([onnx] extra); runs on the CPU",
    measured_in="benchmarks/deploy.py",
)
def onnx_int8_step(model: nn.Module, ctx: StepContext) -> tuple[OrtModule, StepResult]:
    """The ``onnx-int8`` step of :func:`~torch_tricks.deploy.pipeline.optimize`: ONNX Runtime's int8 of the export."""
    path, res = _export_for_step(model, ctx)
    qpath = path.with_name(f"step{ctx.index}.int8.onnx")
    mode = ctx.mode or "static"
    setting = ort_int8_setting(mode, _FORCED_WEIGHT_TYPE[ctx.for_vnni])
    _ort_quantize(mode, path, qpath, ctx.calib, setting.weight_type)
    ort = OrtModule(qpath)
    res.backend = f"onnxruntime {mode} int8" + (" (QDQ, per-channel)" if mode == "static" else "")
    res.details["fp32_size_bytes"] = onnx_size_bytes(path)
    res.int8_setting = setting.to_dict()
    res.notes.append(f"int8 setting: {setting.describe()}")
    return ort, _with_ort_notes(res)


def _ort_quantize(mode: str, path: Path, qpath: Path, calib: Any, weight_type: str) -> None:
    """ONNX Runtime's static (calibrated) or dynamic int8 of ``path`` into ``qpath``."""
    try:
        if mode == "static":
            ort_quantize_static(path, qpath, calib, weight_type=weight_type)
        else:
            ort_quantize_dynamic(path, qpath, weight_type=weight_type)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"ONNX Runtime int8 quantization failed: {plain_line(exc)}") from None


def _export_for_step(model: nn.Module, ctx: StepContext) -> tuple[Path, StepResult]:
    """Export ``model`` into the chain's work folder; the step's result with the export's report."""
    path = Path(ctx.workdir.name) / f"step{ctx.index}.onnx"
    try:
        with quiet_torch():  # a failed capture prints its partial graph and log lines
            exp = export_onnx_checked(model, ctx.example, path)
    except UserError:
        raise
    except Exception as exc:
        # the exporter wraps the real reason ("step 1/3 of exporting ... Next steps: ...")
        raise UserError(f"torch.onnx.export failed: {plain_line(exc.__cause__ or exc)}") from None
    res = ctx.result(details={"export": {k: v for k, v in exp.to_dict().items() if k != "path"}},
                     notes=list(exp.notes))
    return path, res


def _with_ort_notes(res: StepResult) -> StepResult:
    res.size_method = "ONNX file bytes (with external data)"
    res.details["threads"] = torch.get_num_threads()
    res.notes.append(f"ONNX Runtime runs with {torch.get_num_threads()} intra-op threads (torch.get_num_threads())")
    return res


def _require_onnx(step: str) -> None:
    for mod in ("onnx", "onnxscript", "onnxruntime"):
        require(mod, "onnx", f"step {step!r}")


# -- helpers ----------------------------------------------------------------------------------

def _batches_to_check(args: tuple[Any, ...], dynamic_batch: bool) -> list[tuple[Any, ...]]:
    """``args``, and their first row too when the batch dim is dynamic (to check that it is)."""
    batches = [args]
    n = _rows(args[0]) if args else None
    if dynamic_batch and n is not None and n > 1:
        batches.append(tuple(a[:1] if _rows(a) == n else a for a in args))
    return batches


def _rows(a: Any) -> int | None:
    """Dim 0 of a tensor that has dims (None for anything else)."""
    return int(a.shape[0]) if isinstance(a, torch.Tensor) and a.dim() > 0 else None


def _compare_with_eager(model: nn.Module, ort_model: OrtModule,
                        batches: list[tuple[Any, ...]]) -> tuple[float, float, list[int]]:
    """(max abs diff, max rel diff, batch sizes checked) of every output of ONNX Runtime against eager."""
    max_abs, max_rel, checked = 0.0, 0.0, []
    with _eval(model), torch.inference_mode():
        for b in batches:
            max_abs, max_rel = _max_diffs(_tensors(model(*b)), _tensors(ort_model(*b)), max_abs, max_rel)
            rows = _rows(b[0])
            checked.append(rows if rows is not None else 1)
    return max_abs, max_rel, checked


def _max_diffs(ref: list[torch.Tensor], got: list[torch.Tensor], max_abs: float,
               max_rel: float) -> tuple[float, float]:
    """The running max abs and rel diffs, updated with one batch's outputs (which must match in number and shape)."""
    if len(ref) != len(got):
        raise UserError(f"ONNX Runtime returned {len(got)} outputs, eager PyTorch {len(ref)}")
    for r, g in zip(ref, got):
        if tuple(r.shape) != tuple(g.shape):
            raise UserError(
                f"ONNX output shape {tuple(g.shape)} differs from eager {tuple(r.shape)}"
            )
        if r.numel() == 0:
            continue
        d = float((r.double() - g.double()).abs().max())
        max_abs = max(max_abs, d)
        max_rel = max(max_rel, d / max(float(r.double().abs().max()), 1e-12))
    return max_abs, max_rel


def _preprocessed(model_in: str, workdir: str) -> str:
    """ORT's ``quant_pre_process`` of ``model_in`` (shape inference, graph optimisation), or ``model_in`` where it fails."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = Path(workdir) / "pre.onnx"
    try:
        quant_pre_process(model_in, str(pre))
    except Exception:  # pre-processing is an optimisation; quantize the file as it is
        return model_in
    return str(pre)


def _qtype(setting: Int8Setting) -> Any:
    from onnxruntime.quantization import QuantType

    return QuantType.QUInt8 if setting.weight_type == "uint8" else QuantType.QInt8


def _ort() -> Any:
    return require("onnxruntime", "onnx", "running ONNX files")


def _existing(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no ONNX file at {str(p)!r}")
    return str(p)


@contextlib.contextmanager
def _quiet_root_logger() -> Iterator[None]:
    """ONNX Runtime's quantizer warns through the *root* logger (``logging.warning``), which
    on first use also installs a stderr handler for the whole process: a guard handler
    keeps that from happening and a raised level drops the warnings, both only for the call."""
    root = logging.getLogger()
    level, guard = root.level, logging.NullHandler()
    root.addHandler(guard)
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.removeHandler(guard)
        root.setLevel(level)


@contextlib.contextmanager
def _workdir(path_out: str | os.PathLike[str]) -> Iterator[str]:
    """A private temporary folder beside ``path_out`` (same file system, removed afterwards)."""
    parent = Path(path_out).parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=f".{Path(path_out).name}.") as d:
        yield d


def _without_value_info(src: str, workdir: str) -> str:
    """A copy of ``src`` without intermediate shape annotations (``value_info``).

    The dynamo exporter annotates initializers too; ORT's quantizer transposes Gemm
    weights and its shape inference then trips over the stale annotation
    ("Inferred shape and existing shape differ"). Shapes are inferred again anyway.
    """
    import onnx

    m = onnx.load(src)
    del m.graph.value_info[:]
    out = str(Path(workdir) / "clean.onnx")
    onnx.save(m, out)
    return out


def _numpy(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().contiguous().numpy()
    return t


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


class _eval:
    """Eval mode for the comparison, each module's own mode restored afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modes: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for m, mode in self.modes:
            m.training = mode
