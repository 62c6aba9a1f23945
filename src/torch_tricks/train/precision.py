"""Mixed precision (T1): autocast in bf16 or fp16, with a grad scaler for fp16.

Why these pieces and not more: ``torch.autocast`` already keeps the numerically unsafe
ops (sums, means, softmax, norms, losses) in fp32 by its per-op lists, and
``torch.amp.GradScaler`` already does dynamic loss scaling; what a training loop still
has to get right is around them:

* whether a precision can run at all on this device, decided by a real probe (CPU fp16
  autocast exists only in recent torch builds; bf16 needs an Ampere+ GPU), with one
  clear line when it cannot (:func:`check_precision`);
* a scaler the loop can call unconditionally: disabled (a no-op) for fp32 and bf16,
  which need no loss scaling (bf16 has fp32's exponent range);
* knowing when fp16's scaler *skipped* a step because of inf/nan gradients, so the lr
  scheduler is not stepped for an optimizer step that never happened (the scheduler
  would otherwise run ahead, and PyTorch warns "lr_scheduler.step() before
  optimizer.step()") — :func:`scaler_step` returns whether the step was taken.

bf16 runs everywhere torch has a CPU autocast; on a CPU without native bf16
instructions (``avx512_bf16`` / ``amx_bf16``) every bf16 op is emulated through fp32
conversions and is often *slower* than fp32: measure before assuming it helps
(:func:`cpu_has_bf16` tells which case this machine is).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch

from torch_tricks.device import no_cuda_message
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = [
    "PRECISIONS",
    "normalize_precision",
    "check_precision",
    "precision_dtype",
    "autocast",
    "make_grad_scaler",
    "scaler_step",
    "step_was_skipped",
    "MixedPrecision",
    "mixed_precision",
    "precision_available",
    "cpu_has_bf16",
]

PRECISIONS = ("fp32", "bf16", "fp16")

_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "16": "fp16", "half": "fp16",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def normalize_precision(precision: str) -> str:
    """The canonical name (``fp32``/``bf16``/``fp16``) of ``precision``; aliases such as
    ``bfloat16`` or ``half`` are accepted. An unknown name is a :class:`UserError`."""
    key = str(precision).strip().lower()
    if key not in _ALIASES:
        raise UserError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return _ALIASES[key]


def precision_dtype(precision: str) -> torch.dtype:
    """The autocast dtype of ``precision`` (``torch.float32`` for fp32)."""
    return DTYPES[normalize_precision(precision)]


def check_precision(precision: str, device: torch.device | str) -> None:
    """Raise a one-line :class:`UserError` if ``precision`` cannot run on ``device``.

    fp32 runs everywhere. bf16 needs a CUDA device with bf16 support
    (``torch.cuda.is_bf16_supported()``) or a CPU autocast that works (probed).
    fp16 needs CUDA, or a torch whose CPU autocast accepts fp16 (probed: a tiny
    autocast matmul and its backward must run and come out in fp16).
    """
    p = normalize_precision(precision)
    if p == "fp32":
        return
    ok, reason = precision_support(p, torch.device(device))
    if not ok:
        raise UserError(reason)


def autocast(precision: str, device: torch.device | str) -> ContextManager[Any]:
    """A context manager for the forward pass: ``torch.autocast(device_type, dtype)`` for
    bf16/fp16, ``contextlib.nullcontext()`` for fp32. A fresh one per call."""
    p = normalize_precision(precision)
    if p == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=DTYPES[p])


def make_grad_scaler(precision: str, device: torch.device | str) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler`` for ``device``, enabled only for fp16.

    For fp32 and bf16 the scaler is disabled: ``scale`` returns the loss unchanged,
    ``step`` calls ``optimizer.step()``, ``update`` and ``unscale_`` do nothing, so the
    loop calls the same four methods whatever the precision.
    """
    p = normalize_precision(precision)
    dev = torch.device(device)
    return torch.amp.GradScaler(dev.type, enabled=(p == "fp16"))


def scaler_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """``scaler.step(optimizer)`` then ``scaler.update()``; True if the optimizer stepped.

    An enabled scaler skips the step when the gradients hold inf/nan, and then (and only
    then) lowers its scale by ``backoff_factor``; so the step was skipped exactly when
    the scale went down (:func:`step_was_skipped`). This reads the public
    ``get_scale()``, which costs one device sync per step for fp16 only; a disabled
    scaler never skips and never syncs.
    """
    if not scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        return True
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return not step_was_skipped(scaler, before)


def step_was_skipped(scaler: torch.amp.GradScaler, scale_before_update: float) -> bool:
    """True if the step just taken with ``scaler`` was skipped for inf/nan gradients.

    Call it after ``scaler.update()`` with ``scaler.get_scale()`` read before ``step``:
    ``update`` multiplies the scale by ``backoff_factor`` (< 1) after a skipped step and
    keeps or grows it otherwise. A disabled scaler never skips.
    """
    if not scaler.is_enabled():
        return False
    return scaler.get_scale() < scale_before_update


@dataclass
class MixedPrecision:
    """Everything a training step needs for one precision on one device.

    Usage::

        mp = mixed_precision("fp16", "cuda")
        with mp.autocast():
            loss = loss_fn(model(x), y)
        mp.backward(loss)
        if mp.step(optimizer):      # False when fp16's scaler skipped the step
            scheduler.step()
    """

    precision: str
    device: torch.device
    scaler: torch.amp.GradScaler = field(repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    def autocast(self) -> ContextManager[Any]:
        return autocast(self.precision, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients in place (before gradient clipping)."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        return scaler_step(self.scaler, optimizer)


def precision_available(device: torch.device) -> tuple[bool, str]:
    """Availability of the ``mixed_precision`` trick: True where bf16 or fp16 can run.

    The reason string also carries a note when the answer is yes but a caveat applies
    (bf16 on a CPU without native bf16 instructions).
    """
    dev = torch.device(device)
    ok_bf16, why_bf16 = precision_support("bf16", dev)
    ok_fp16, why_fp16 = precision_support("fp16", dev)
    if not (ok_bf16 or ok_fp16):
        return False, f"{why_bf16}; {why_fp16}"
    if dev.type == "cpu" and ok_bf16 and not cpu_has_bf16():
        return True, (
            "bf16 runs on this CPU but it has no native bf16 instructions (avx512_bf16/amx_bf16): "
            "bf16 is emulated and may be slower than fp32"
        )
    return True, ""


@register_trick(
    "mixed_precision",
    ids=("T1",),
    kind="train",
    trades="half the activation memory and faster matmuls on tensor cores / bf16 CPUs, for reduced precision",
    needs="CUDA (fp16 or Ampere+ bf16), or a CPU autocast; fp16 adds loss scaling",
    config_key="precision",
    available=precision_available,
    measured_in="benchmarks/train_tricks.py",
)
def mixed_precision(precision: str = "bf16", device: torch.device | str = "cpu") -> MixedPrecision:
    """Check ``precision`` on ``device`` and return its autocast + grad scaler bundle."""
    p = normalize_precision(precision)
    dev = torch.device(device)
    check_precision(p, dev)
    return MixedPrecision(p, dev, make_grad_scaler(p, dev))


@functools.lru_cache(maxsize=None)
def cpu_has_bf16() -> bool:
    """True if this CPU advertises native bf16 instructions (``avx512_bf16`` or
    ``amx_bf16`` in ``/proc/cpuinfo``; Linux only, False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


# -- internals --------------------------------------------------------------------------

def precision_support(p: str, dev: torch.device) -> tuple[bool, str]:
    """(can ``p`` in {bf16, fp16} run on ``dev``, one-line reason if not)."""
    if dev.type == "cuda":
        return _cuda_support(p, dev)
    if not torch.amp.is_autocast_available(dev.type):
        return False, f"torch {torch.__version__} has no autocast for {dev.type}: use precision=fp32"
    if dev.type == "cpu":
        return _cpu_support(p)
    return True, ""  # other accelerators (mps, xpu, ...): trust is_autocast_available


def _cuda_support(p: str, dev: torch.device) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, no_cuda_message()
    if p == "bf16" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(dev)
        return False, f"bf16 is not supported on {name} (needs compute capability 8.0+): use precision=fp16"
    return True, ""


def _cpu_support(p: str) -> tuple[bool, str]:
    if _cpu_autocast_works(p):
        return True, ""
    alt = "bf16" if p == "fp16" else "fp32"
    return False, (
        f"{p} autocast does not run on CPU with torch {torch.__version__}: "
        f"use precision={alt} (or a CUDA device)"
    )


@functools.lru_cache(maxsize=None)
def _cpu_autocast_works(p: str) -> bool:
    """Probe once: a tiny autocast matmul in ``p`` on CPU, forward and backward.

    ``torch.amp.is_autocast_available('cpu')`` says nothing about which dtypes the CPU
    autocast accepts (fp16 came years after bf16); older builds warn and silently run
    in fp32, so the probe checks the output dtype too.
    """
    import warnings

    dtype = DTYPES[p]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = torch.ones(4, 4, requires_grad=True)
            b = torch.ones(4, 4)
            with torch.autocast(device_type="cpu", dtype=dtype):
                c = a @ b
            if c.dtype != dtype:
                return False
            c.float().sum().backward()
            return a.grad is not None and bool(torch.isfinite(a.grad).all())
    except Exception:
        return False
