"""The device floor: one reading of a device name, one line when it cannot be served.

Every entry point takes a device from a user: the CLI's ``--device``, ``Tricks`` / ``fit``,
``tune``, ``optimize``, the doctor's runtime checks, the loaders. They all resolve it
here, so ``auto``, a typo, ``cuda`` on a machine without one and ``cuda:3`` on a machine
with one GPU get the same answer everywhere, before any kernel runs (``cuda:3`` would
otherwise surface much later as CUDA's "invalid device ordinal" with a traceback).

Also here: waiting for a device's queued work (:func:`synchronize`, which timing needs) and
the device a module lives on (:func:`module_device`).
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Iterable

import torch
from torch import nn

from torch_tricks.errors import UserError

__all__ = ["resolve", "parse", "check_available", "no_cuda_message", "synchronize", "module_device", "is_oom"]


def resolve(device: torch.device | str | int | None = "auto", *, what: str = "device") -> torch.device:
    """A ``torch.device`` for ``device``, checked against this machine.

    ``None`` or ``"auto"`` is CUDA when this torch sees a CUDA device, else the CPU. An int
    is an index on the current accelerator (CUDA where there is none other). A name torch
    does not know, CUDA where there is none, or an index past the last device is a
    :class:`UserError` of one line; ``what`` names the option in it (``"--device"`` on the
    command line, ``"device"`` in Python).
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = device if isinstance(device, torch.device) else parse(device, what=what)
    check_available(dev, what=what)
    return dev


def parse(device: str | int | torch.device, *, what: str = "device") -> torch.device:
    """A device name, or an index on the current accelerator (CUDA where there is none
    other), as torch reads it: unchecked against this machine, for a timer set up before
    the device is used. One line for a name torch does not know."""
    try:
        if isinstance(device, int) and not isinstance(device, bool):
            acc = _current_accelerator()
            return torch.device(acc.type if acc is not None else "cuda", device)
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"unknown {what} {device!r}: use auto, cpu, cuda or cuda:N") from None


def check_available(device: torch.device, *, what: str = "device") -> None:
    """Raise one line when ``device`` is CUDA this machine cannot serve (none, or too few)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise UserError(no_cuda_message(what))
    n = torch.cuda.device_count()
    if device.index is not None and not 0 <= device.index < n:
        last = "cuda:0" if n == 1 else f"cuda:0 to cuda:{n - 1}"
        raise UserError(f"{what} {device} asked for, but this machine has {n} CUDA device(s): use {last}, or cpu")


def no_cuda_message(what: str = "device") -> str:
    """The one sentence for "CUDA asked for, none here", with the option to change."""
    use = f"{what} cpu" if what.startswith("--") else f"{what}='cpu'"
    return f"{what} cuda asked for, but this torch sees no CUDA device: use {use}"


def synchronize(device: torch.device | str | int | None = None) -> None:
    """Wait until all queued work on ``device`` has finished; a no-op on CPU.

    ``None`` means "whatever accelerator is in use": CUDA only if it has been initialised
    (no kernels can be pending otherwise, and initialising it would cost seconds), else the
    current ``torch.accelerator`` (MPS, XPU, ...) where this torch has one. A timer read
    without this measures only the kernel launches.
    """
    if device is None:
        _synchronize_in_use()
        return
    dev = device if isinstance(device, torch.device) else parse(device)
    if dev.type in ("cpu", "meta"):
        return
    if dev.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(dev)
        return
    _synchronize_accelerator(dev)


def _synchronize_in_use() -> None:
    """:func:`synchronize` of no device: initialised CUDA, else the current non-CUDA accelerator."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        return
    acc = _current_accelerator()
    if acc is not None and acc.type != "cuda":
        torch.accelerator.synchronize()


def _synchronize_accelerator(dev: torch.device) -> None:
    """A non-CUDA accelerator (MPS, XPU...): through ``torch.accelerator``, or its own module on torch < 2.6."""
    if hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(dev)
        return
    backend = getattr(torch, dev.type, None)  # torch.mps / torch.xpu
    if backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory: CUDA's OutOfMemoryError, or a RuntimeError saying so
    (on a CPU, the allocator's "can't allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError if hasattr(torch, "OutOfMemoryError") else torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def module_device(model: nn.Module, fallback: Iterable[Any] = ()) -> torch.device:
    """The device of the module's first parameter or buffer; else of the first tensor in
    ``fallback`` (its inputs, say); else the CPU."""
    for t in chain(model.parameters(), model.buffers(), fallback):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


# -- internals -------------------------------------------------------------------------------

def _current_accelerator() -> torch.device | None:
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    return acc.current_accelerator()
