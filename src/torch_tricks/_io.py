"""Atomic file writes: a reader never sees a half-written file, and a failed write
leaves the previous file (if any) in place."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from torch_tricks.errors import UserError

__all__ = ["atomic_path", "fsync_dir"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` if the block succeeds.

    ``suffix`` lets writers that look at the extension (e.g. gzip for ``.gz``) see the
    right one on the temporary name.
    """
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{str(target)!r} is a directory: give a file name")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the file should get what open() would give
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask sets it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename inside ``directory`` durable (POSIX); a no-op where directories
    cannot be opened or synced (Windows), where it is neither possible nor needed."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
