"""fp32 matmuls in a faster mode (T33): TF32 on CUDA tensor cores, bf16 through oneDNN on a CPU with bf16 units.

The weights, activations and accumulations stay fp32; only the products inside matmuls and convolutions are
computed in a shorter format (TF32: 10 mantissa bits, bf16: 7), so no code changes and no autocast lists
decide anything. PyTorch's own switches do the work (``torch.backends.cuda.matmul`` / ``cudnn.conv`` /
``mkldnn.matmul`` / ``mkldnn.conv`` ``.fp32_precision``); what this module adds is when each mode can run
(:func:`fp32_matmul_support`: a mode the hardware lacks is refused in one line rather than set and silently
ignored, e.g. oneDNN keeps fp32 on a CPU without AVX512-BF16 or AMX: measured here, the products were exact to
4e-7) and a context that puts the process's setting back (:func:`fp32_matmul`), which the tune needs to time
it beside steps that do not set it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from torch_tricks.device import no_cuda_message
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick
from torch_tricks.train.precision import cpu_has_bf16

__all__ = ["FP32_MATMUL_MODES", "fp32_matmul_support", "check_fp32_matmul", "set_fp32_matmul", "fp32_matmul",
           "fast_fp32_matmul_mode"]

FP32_MATMUL_MODES = ("ieee", "tf32", "bf16")  # TrainConfig.fp32_matmul, "" keeps the process's own
_BACKENDS = {"cuda": ("cuda.matmul", "cudnn.conv"), "cpu": ("mkldnn.matmul", "mkldnn.conv")}
# oneDNN ISAs (ONEDNN_MAX_CPU_ISA) under which it has no bf16 instructions to use
_NO_BF16_ISAS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def fp32_matmul_support(mode: str, device: torch.device | str) -> tuple[bool, str]:
    """(can ``mode`` run on ``device``, the reason in one line where it cannot)."""
    dev = torch.device(device)
    if mode not in FP32_MATMUL_MODES:
        return False, f"unknown fp32_matmul {mode!r}: choose one of {', '.join(FP32_MATMUL_MODES)}"
    if mode == "ieee":
        return True, ""
    if mode == "tf32":
        return _tf32_support(dev)
    return _bf16_support(dev)


def check_fp32_matmul(mode: str, device: torch.device | str) -> None:
    """A one-line :class:`UserError` where ``mode`` cannot run on ``device`` ("" keeps the process's own: fine)."""
    if not mode:
        return
    ok, why = fp32_matmul_support(mode, device)
    if not ok:
        raise UserError(f"fp32_matmul = {mode}: {why}")


def set_fp32_matmul(mode: str, device: torch.device | str) -> dict[str, str]:
    """Set ``device``'s fp32 matmul and convolution mode to ``mode`` (checked first); returns what was set before,
    for :func:`_restore`. ``ieee`` is full fp32."""
    check_fp32_matmul(mode, device)
    before = {}
    for path in _BACKENDS[_kind(device)]:
        backend = _backend(path)
        before[path] = backend.fp32_precision
        backend.fp32_precision = mode
    return before


@contextlib.contextmanager
def fp32_matmul(mode: str, device: torch.device | str) -> Iterator[None]:
    """``mode`` inside (nothing changes for ""), the process's own setting after."""
    if not mode:
        yield
        return
    before = set_fp32_matmul(mode, device)
    try:
        yield
    finally:
        _restore(before)


def fast_fp32_matmul_mode(device: torch.device | str) -> tuple[str | None, str]:
    """(the fast mode this device runs natively, or None with the reason): what the tune measures."""
    dev = torch.device(device)
    mode = "tf32" if dev.type == "cuda" else "bf16"
    ok, why = fp32_matmul_support(mode, dev)
    return (mode, "") if ok else (None, why)


@register_trick(
    "fp32_matmul",
    ids=("T33",),
    kind="train",
    trades="faster fp32 matmuls and convolutions (products in TF32 or bf16, fp32 kept everywhere else), for "
           "a few digits of the products",
    needs="a CUDA GPU of capability 8.0+ (tf32), or a CPU with AVX512-BF16 or AMX (bf16 through oneDNN)",
    config_key="fp32_matmul",
    available=lambda dev: _available(dev),
    measured_in="benchmarks/train_tricks.py",
)
def fp32_matmul_trick(mode: str, device: torch.device | str = "cpu") -> dict[str, str]:
    """Switch ``device``'s fp32 matmuls to ``mode`` for the rest of the process; returns the previous settings."""
    return set_fp32_matmul(mode, device)


# -- internals --------------------------------------------------------------------------


def _available(dev: torch.device) -> tuple[bool, str]:
    mode, why = fast_fp32_matmul_mode(dev)
    return mode is not None, why


def _tf32_support(dev: torch.device) -> tuple[bool, str]:
    if dev.type != "cuda":
        return False, ("TF32 is a CUDA tensor-core format (capability 8.0+); on a CPU the fast fp32 mode is bf16 "
                       "(oneDNN, on a CPU with AVX512-BF16 or AMX): remove it or use fp32_matmul = bf16 there")
    if not torch.cuda.is_available():
        return False, no_cuda_message()
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:
        return False, f"TF32 needs a GPU of capability 8.0+ (Ampere); this one is {major}.{minor}: remove it"
    return True, ""


def _bf16_support(dev: torch.device) -> tuple[bool, str]:
    if dev.type != "cpu":
        return False, ("bf16 products for fp32 matmuls are oneDNN's, on a CPU; on CUDA the fast fp32 mode is "
                       "tf32 (or train in bf16: precision = bf16)")
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if not cpu_has_bf16() or isa in _NO_BF16_ISAS or torch.backends.cpu.get_cpu_capability() not in (
            "AVX512", "AMX"):
        why = "this CPU has no AVX512-BF16 or AMX" if not cpu_has_bf16() else \
            f"oneDNN and torch are held to {isa or torch.backends.cpu.get_cpu_capability()} here"
        return False, (f"oneDNN computes fp32 matmuls in bf16 only with bf16 units, and {why}: it would keep "
                       "fp32 and change nothing; remove it")
    return True, ""


def _kind(device: torch.device | str) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def _backend(path: str):
    obj = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _restore(before: dict[str, str]) -> None:
    for path, value in before.items():
        _backend(path).fp32_precision = value
