"""Keep other libraries' import noise off the command line's terminal.

Importing an optional dependency can log or warn before our output starts: torchao logs
"Failed to load .../_C_mxfp8...so" for kernels built for another GPU, torch's ``_pytree``
logs a deprecation when torchao registers an Enum, transformers warns about its own
deprecations. None of it is about the user's model or command, and it pushes the table
down. :func:`install`, a context manager the CLI runs each command in unless
``--debug``/``-v`` is given, holds back:

- **log records of level WARNING or lower that a library logs while a module is being
  imported** (an ``importlib`` frame on the stack), from any logger outside ``torch_tricks``.
  Loggers are given a filter through :func:`logging.setLoggerClass`, so this needs no list
  of library names; records logged after the imports (a real problem at run time) and
  errors pass;
- **deprecation warnings** (``DeprecationWarning``, ``PendingDeprecationWarning``,
  ``FutureWarning``) attributed to a file of another installed package or of Python itself.

The project's own warnings and log records, and anything attributed to the user's code,
are never held back. What was held back is kept on the :class:`Quiet` object it yields
(``held``), for a caller that wants to show it.

Written here because neither :mod:`logging` nor :mod:`warnings` can filter by "emitted
during an import, by a third party" out of the box; both hooks used are their public ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["Quiet", "install"]

_DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
_OWN = "torch_tricks"


@dataclass
class Quiet:
    """What :func:`install` held back: one line each (``logger: message`` or ``file:line: warning``)."""

    held: list[str] = field(default_factory=list)


@contextlib.contextmanager
def install() -> Iterator[Quiet]:
    """Hold back third-party import noise while the block runs; yields where it is kept. Loggers
    created meanwhile keep the filter (it passes everything once no import is running)."""
    quiet = Quiet()
    noise = _ImportNoise(quiet)
    base = logging.getLoggerClass()

    class _QuietLogger(base):  # type: ignore[misc, valid-type]
        def __init__(self, name: str, level: int = logging.NOTSET) -> None:
            super().__init__(name, level)
            if not _is_own(name):
                self.addFilter(noise)

    _filter_existing(noise)
    roots = _library_roots()
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, _DEPRECATIONS) and _in_library(filename, roots):
            quiet.held.append(f"{filename}:{lineno}: {category.__name__}: {message}")
            return
        show(message, category, filename, lineno, file, line)

    logging.setLoggerClass(_QuietLogger)
    warnings.showwarning = showwarning
    try:
        yield quiet
    finally:
        if warnings.showwarning is showwarning:
            warnings.showwarning = show
        if logging.getLoggerClass() is _QuietLogger:
            logging.setLoggerClass(base)
        _unfilter_all(noise)


def _filter_existing(noise: logging.Filter) -> None:
    """Filter the root logger, and the third-party loggers made before us."""
    made = [logging.getLogger()] + [lg for name, lg in logging.Logger.manager.loggerDict.items()
                                    if isinstance(lg, logging.Logger) and not _is_own(name)]
    for existing in made:
        existing.addFilter(noise)


def _unfilter_all(noise: logging.Filter) -> None:
    """Take the filter off every logger that has it, made before or while the block ran."""
    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(lg, logging.Logger) and noise in lg.filters:
            lg.removeFilter(noise)


class _ImportNoise(logging.Filter):
    """Drops (and keeps) records of WARNING or lower logged while an import runs."""

    def __init__(self, quiet: Quiet) -> None:
        super().__init__()
        self.quiet = quiet

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING or not _importing():
            return True
        self.quiet.held.append(f"{record.name}: {record.getMessage()}")
        return False


def _importing() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _is_own(name: str) -> bool:
    return name == _OWN or name.startswith(_OWN + ".")


def _library_roots() -> tuple[str, ...]:
    """Folders of installed packages and of Python's own library (not this package's source)."""
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    roots.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return tuple(os.path.normcase(os.path.abspath(r)) + os.sep for r in roots if r)


def _in_library(filename: str, roots: tuple[str, ...]) -> bool:
    path = os.path.normcase(os.path.abspath(filename))
    own = os.path.normcase(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return not path.startswith(own) and path.startswith(roots)
