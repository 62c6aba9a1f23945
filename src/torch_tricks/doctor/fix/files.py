"""Files: the text of a file in its own encoding (PEP 263), the fixed text written back atomically
(a temporary file in the same folder, then :func:`os.replace`; the mode is kept, a symlink stays a
link) and only while the file still holds the text that was fixed, and a unified diff of the change."""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
import stat
import tempfile
import tokenize
from pathlib import Path

from torch_tricks.doctor.fix.base import FileFix, FixError


def _write_fixed(ff: FileFix, data: bytes, original: bytes) -> None:
    """Write ``data`` over the file ``ff`` is about (which must still hold ``original``), and say so in ``ff``."""
    try:
        _write_atomic(Path(ff.path), data, original)
    except (OSError, FixError) as exc:
        ff.error = f"not written: {_strerror(exc)}"
    else:
        ff.written = True


def _write_atomic(path: Path, data: bytes, original: bytes) -> None:
    target = Path(os.path.realpath(path))  # a symlink stays a link to the fixed file
    mode = stat.S_IMODE(target.stat().st_mode)
    if target.read_bytes() != original:
        raise FixError("the file changed while it was being fixed")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tt-fix")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _decode(data: bytes) -> tuple[str, str]:
    """The text (line endings as they are) and the encoding to write it back in (PEP 263)."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        encoding = "utf-8"
    return data.decode(encoding), encoding


def _strerror(exc: Exception) -> object:
    """The OS's message for ``exc`` without the errno and file name, else ``exc`` itself."""
    return getattr(exc, "strerror", None) or exc


def unified_diff(old: str, new: str, path: str) -> str:
    """``diff -u`` of two versions of ``path`` (line endings kept; a last line without one is marked)."""
    out = []
    for line in difflib.unified_diff(_keepends(old), _keepends(new), path, path):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def _keepends(text: str) -> list[str]:
    return re.findall(r"[^\n]*\n|[^\n]+\Z", text)
