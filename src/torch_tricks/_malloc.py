"""glibc malloc's two thresholds, raised for the whole process (one place for the ``mallopt`` calls).

Why by hand: neither PyTorch nor the standard library sets malloc options, and the
environment variables (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``) work only
when set before Python starts. Two callers want freed memory kept in the process: the
data loader's decoding threads (:func:`torch_tricks.data.threads.keep_freed_heap`) and
the training step (:func:`torch_tricks.train.speed.keep_heap`). A threshold is only ever
raised here, so whichever asks for less after the other does not undo it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["raise_malloc_thresholds", "malloc_thresholds"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_set: dict[str, int] = {}  # what this process set: "trim" / "mmap" -> bytes


def raise_malloc_thresholds(*, trim: int | None = None, mmap: int | None = None) -> bool:
    """Raise glibc's ``M_TRIM_THRESHOLD`` / ``M_MMAP_THRESHOLD`` to at least these bytes.

    ``trim``: freed memory at the top of the heap is returned to the kernel only past it.
    ``mmap``: allocations of at least this size get their own mapping (fresh pages, each
    page-faulted in and zeroed by the kernel, unmapped again when freed); glibc caps it at
    32 MiB on 64-bit. Setting either fixes the mmap threshold, which glibc otherwise raises
    by itself as mapped blocks are freed. Returns whether glibc accepted every value asked
    for (False off glibc, or when it refused).
    """
    libc = _glibc()
    if libc is None:
        return False
    ok = True
    for key, param, value in (("trim", _M_TRIM_THRESHOLD, trim), ("mmap", _M_MMAP_THRESHOLD, mmap)):
        if value is None or _set.get(key, -1) >= value:
            continue
        if libc.mallopt(param, int(value)) == 1:
            _set[key] = int(value)
        else:
            ok = False
    return ok


def malloc_thresholds() -> dict[str, int]:
    """What :func:`raise_malloc_thresholds` set in this process so far (bytes by ``trim``/``mmap``)."""
    return dict(_set)


def _glibc() -> Any:
    """The C library, where it is glibc (Linux); else None."""
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
