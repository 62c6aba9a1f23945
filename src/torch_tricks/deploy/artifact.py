"""Save the final model of a deploy chain in the one format that holds it, and read it back.

:func:`save_artifact` is what :meth:`~torch_tricks.deploy.pipeline.OptimizeResult.save`
runs: it picks the format (:func:`save_format`: ONNX, ``torch.export``, TorchScript or
pickle), writes atomically, and loads the file back to compare its outputs;
:func:`load_optimized` reads any of these formats back into a callable model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from torch_tricks._format import human_bytes
from torch_tricks._io import atomic_path
from torch_tricks.deploy.export import OrtModule, onnx_size_bytes
from torch_tricks.deploy.quantize import PT2EInt8Model
from torch_tricks.deploy.step_report import _first_tensor
from torch_tricks.deploy.steps import batch_rows, json_safe, plain_line, quiet_torch
from torch_tricks.errors import UserError
from torch_tricks.inspect.graph import in_eval_mode
from torch_tricks.inspect.inputs import describe_inputs

__all__ = ["SaveInfo", "load_optimized", "save_artifact", "save_format"]

_META_NAME = "torch_tricks.json"


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
        return json_safe(asdict(self))

    def to_text(self) -> str:
        """What was written, in what format and why, and how to load it (the lines ``optimize`` prints)."""
        check = (f"; loaded back, max abs diff {self.verify_max_abs_diff:.2e}"
                 if self.verify_max_abs_diff is not None else "")
        return "\n".join([f"wrote {self.path}: {self.format}, {human_bytes(self.size_bytes)}{check}",
                          f"  {self.why}", f"  load: {self.load}", *(f"  {n}" for n in self.notes)])


def save_format(model: Any) -> tuple[str, str]:
    """(format, why) for the final model; ``pt2e`` is written as ``torch.export``."""
    if isinstance(model, OrtModule):
        return "onnx", "the final step runs in ONNX Runtime: the .onnx file it ran is the model"
    if isinstance(model, PT2EInt8Model):
        return "pt2e", ("the PT2E int8 graph is a torch.export program: saved with torch.export.save "
                        "(load_optimized compiles it again with inductor)")
    return _module_format(model)


def _module_format(model: nn.Module) -> tuple[str, str]:
    """(format, why) for an ``nn.Module``: by the torch.ao int8 layers it holds, if any."""
    kinds = {type(m).__module__ for m in model.modules()}
    if any(k.startswith("torch.ao.nn.quantized.dynamic") for k in kinds):
        return "pickle", ("torch.export cannot serialize torch.ao's packed int8 weights and a trace would "
                          "freeze the model's Python control flow: the whole model is pickled")
    if any(k.startswith(("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized")) for k in kinds):
        return "torchscript", ("torch.export cannot serialize torch.ao's packed int8 weights and the FX int8 "
                               "GraphModule does not pickle; a TorchScript trace of the FX graph is exact")
    return "torch.export", "a self-contained program (no Python class needed to load it), dynamic batch"


def save_artifact(model: Any, path: str | os.PathLike[str], example: tuple[Any, ...], *,
                  steps: Sequence[str] = (), threads: int = 1, verify: bool = True) -> SaveInfo:
    """Write ``model`` to ``path`` atomically in :func:`save_format`'s format (see :meth:`OptimizeResult.save`).

    ``steps`` and ``threads`` go into the file's metadata; ``verify`` loads the file back
    and compares its outputs with ``model``'s on ``example``.
    """
    target = Path(path)
    fmt, why = save_format(model)
    if target.suffix.lower() == ".onnx" and fmt != "onnx":
        raise UserError(
            f"{target.name}: the final model is not ONNX (it saves as {fmt}): name it .pt2/.pt, "
            "or end the steps with onnx"
        )
    notes: list[str] = []
    meta = {"format": fmt, "steps": list(steps), "inputs": describe_inputs(example), "threads": threads}
    fmt, why, load = _write(model, target, example, meta, fmt, why, notes)
    info = SaveInfo(path=str(target), format=fmt, size_bytes=_file_bytes(target), why=why, load=load, notes=notes)
    if verify:
        info.verify_max_abs_diff = _verify(target, model, example)
    return info


def _write(model: Any, target: Path, example: tuple[Any, ...], meta: dict[str, Any], fmt: str, why: str,
           notes: list[str]) -> tuple[str, str, str]:
    """Write ``model`` in ``fmt``; (the format written, why, how to load it)."""
    if fmt == "onnx":
        _save_onnx(model.path, target, notes)
        return fmt, why, "torch_tricks.deploy.pipeline.load_optimized(path) or onnxruntime.InferenceSession(path)"
    if fmt == "pt2e":
        fmt, load = _save_pt2e(model, target, example, meta)
        return fmt, why, load
    if fmt == "torchscript":
        return fmt, why, _save_torchscript(model, target, example, meta)
    return _save_program_or_pickle(model, target, example, meta, fmt, why)


def load_optimized(path: str | os.PathLike[str], *, compile: bool = True) -> Any:
    """Read back a file written by :meth:`OptimizeResult.save` (any of its formats).

    Returns a callable model: an :class:`~torch_tricks.deploy.export.OrtModule` for ONNX,
    the ``torch.export`` program's module (a PT2E int8 program is wrapped in
    :class:`~torch_tricks.deploy.quantize.PT2EInt8Model` again, which compiles it on the
    first call, unless ``compile=False``), the TorchScript module, or the unpickled model
    (``weights_only=False``: load only files you trust).
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no saved model at {str(p)!r}")
    if not zipfile.is_zipfile(p):
        return OrtModule(p)
    return _load_zip(p, compile)


def _load_zip(p: Path, compile: bool) -> Any:
    """A ``torch.export`` program, a TorchScript module or a pickled model, told apart by the zip's entries."""
    with zipfile.ZipFile(p) as z:
        names = z.namelist()
    if any(n.endswith("/archive_format") for n in names):
        return _load_program(p, compile)
    if any(n.endswith("/constants.pkl") for n in names):
        with quiet_torch():
            return torch.jit.load(str(p))
    try:
        with quiet_torch():
            return torch.load(str(p), weights_only=False)
    except Exception as exc:
        raise UserError(f"cannot load {p.name} ({plain_line(exc)}): is the model's class importable?") from None


# -- the formats --------------------------------------------------------------------------------


def _save_pt2e(model: Any, target: Path, example: tuple[Any, ...], meta: dict[str, Any]) -> tuple[str, str]:
    """The PT2E int8 model's quantized graph as a ``torch.export`` program; (format, how to load)."""
    meta["format"] = "torch.export"
    meta["kind"] = "pt2e-int8"
    meta.update(_pt2e_meta(model))
    ep = export_program(model.quantized, example, model.dynamic_batch, eval_mode=False)
    _write_program(ep, target, meta)
    return "torch.export", ("torch_tricks.deploy.pipeline.load_optimized(path) (compiled int8 kernels); "
                            "torch.export.load(path).module() runs the reference int8 graph uncompiled (slow)")


def _save_torchscript(model: Any, target: Path, example: tuple[Any, ...], meta: dict[str, Any]) -> str:
    """A TorchScript trace of the FX int8 model; how to load it."""
    with quiet_torch(), torch.no_grad():
        traced = torch.jit.trace(model, example, check_trace=False, _store_inputs=False)
    with atomic_path(target, suffix=".pt") as tmp:
        torch.jit.save(traced, str(tmp), _extra_files={_META_NAME: json.dumps(meta)})
    return "torch_tricks.deploy.pipeline.load_optimized(path) or torch.jit.load(path)"


def _save_program_or_pickle(model: Any, target: Path, example: tuple[Any, ...], meta: dict[str, Any],
                            fmt: str, why: str) -> tuple[str, str, str]:
    """``torch.export`` where it works, else the pickled model; (format, why, how to load)."""
    ep = None
    if fmt == "torch.export":
        try:
            ep = export_program(model, example, dynamic_batch=True)
        except Exception as exc:
            fmt, why = "pickle", f"torch.export failed ({plain_line(exc)}), so the whole model is pickled"
    if ep is not None:
        _write_program(ep, target, meta)
        return fmt, why, "torch_tricks.deploy.pipeline.load_optimized(path) or torch.export.load(path).module()"
    with atomic_path(target, suffix=".pt") as tmp, quiet_torch():
        torch.save(model, tmp)
    return fmt, why, ("torch_tricks.deploy.pipeline.load_optimized(path) or torch.load(path, weights_only=False) "
                      "(trusted files only; the model's class must be importable)")


def _load_program(p: Path, compile: bool) -> Any:
    """A ``torch.export`` file's module; a PT2E int8 one wrapped to compile on its first call."""
    extra = {_META_NAME: ""}
    with quiet_torch():
        ep = torch.export.load(str(p), extra_files=extra)
    meta = json.loads(extra[_META_NAME] or "{}")
    module = ep.module()
    if meta.get("kind") == "pt2e-int8" and compile:
        example = tuple(torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in meta["example"])
        return PT2EInt8Model(module, example, meta.get("dynamic_batch", True),
                             cpp_wrapper=meta.get("cpp_wrapper", True))
    return module


def export_program(model: nn.Module, example: tuple[Any, ...], dynamic_batch: bool, *, eval_mode: bool = True) -> Any:
    """``torch.export`` of ``model`` (eval mode, MHA fast path off), batch dim dynamic if possible.

    ``eval_mode=False`` for an already exported graph (PT2E), which refuses ``.eval()``.
    """
    last: Exception | None = None
    for dynamic in ((True, False) if dynamic_batch else (False,)):
        args, shapes = example, None
        if dynamic:
            args, shapes = _dynamic_batch(example)
        try:
            with (in_eval_mode(model) if eval_mode else contextlib.nullcontext()), quiet_torch():
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
    n = batch_rows(args)
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
    try:
        return onnx_size_bytes(path) if not zipfile.is_zipfile(path) else path.stat().st_size
    except Exception:
        return path.stat().st_size


def _verify(path: Path, model: Any, example: tuple[Any, ...]) -> float:
    loaded = load_optimized(path, compile=False)
    reference = model.quantized if isinstance(model, PT2EInt8Model) else model
    try:
        with torch.inference_mode(), quiet_torch():
            out, ref = loaded(*example), reference(*example)
    except Exception as exc:
        raise UserError(f"{path.name} was written but does not run when loaded back: {plain_line(exc)}") from None
    a, b = _first_tensor(out), _first_tensor(ref)
    if isinstance(model, OrtModule) and torch.equal(a, b):
        return 0.0
    return float((a.float() - b.float()).abs().max())
