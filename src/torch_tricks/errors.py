"""One exception type for mistakes the user can fix.

The CLI turns a :class:`UserError` into a single line on stderr and exit status 2;
anything else is a bug in torch-tricks and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: an unknown name, a wrong shape, a missing file.

    The message must say what is wrong and how to fix it, on one line.
    """
