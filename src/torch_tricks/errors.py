"""One exception type for mistakes the user can fix.

The CLI turns a :class:`UserError` into a single line on stderr and exit status 2;
anything else is a bug in torch-tricks and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: an unknown name, a wrong shape, a missing file.

    The message must say what is wrong and how to fix it, on one line.
    """


def one_line(exc: BaseException, limit: int = 200, *, with_type: bool = False) -> str:
    """The first non-empty line of ``exc``'s message, whitespace collapsed, at most ``limit``
    characters; the type name when the message is empty. ``with_type`` prefixes ``Type: ``.
    """
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    text = " ".join(lines[0].split()) if lines else ""
    if len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if with_type else text
