"""Jupyter notebooks for the static doctor: the code cells, in order, read as one module.

Much training code lives in notebooks, where a cell's names come from the cells above it, so the cells are
linted together (as the kernel ran them top to bottom), and each finding is put back in its cell: ``nb.ipynb:cell
3:2:5: TT101 ...``, as ruff names notebook findings. IPython's own syntax is not Python: a line magic
(``%matplotlib inline``), a shell line (``!pip install``, ``files = !ls``) or a help query (``x?``) is read as a blank
line, and a cell magic other than timing (``%%bash``, ``%%writefile``) makes the whole cell blank; line numbers
stay those of the cell. The notebook format is JSON (nbformat 4); this reads its ``cells`` directly rather than
through ``nbformat``, which would be a dependency for one list.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["NotebookSource", "notebook_source"]

_PYTHON_CELL_MAGICS = ("%%time", "%%timeit", "%%capture")  # the cell below them is Python
_IPYTHON_LINE = re.compile(r"^\s*(%|!)|^\s*[\w.]+\s*=\s*!|\?\s*$")


@dataclass
class NotebookSource:
    """The code cells as one module, and where each of its lines comes from."""

    source: str
    lines: list[tuple[int, int]]  # for line n of ``source`` (1-based, index n - 1): (cell number, line in the cell)

    def place(self, line: int) -> tuple[int, int]:
        """(cell number, 1-based; line in that cell) of ``line`` of the module."""
        return self.lines[line - 1] if 0 < line <= len(self.lines) else (0, line)


def notebook_source(text: str) -> NotebookSource:
    """The code cells of the notebook ``text`` (its JSON) as one module; a :class:`ValueError` in one line where
    it is not a notebook."""
    try:
        nb = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a notebook: its JSON does not parse ({exc.msg}, line {exc.lineno})") from None
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise ValueError("not a notebook: no list of cells (nbformat 4)")
    out: list[str] = []
    where: list[tuple[int, int]] = []
    for number, cell in enumerate(cells, 1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        for i, line in enumerate(_python_lines(_cell_text(cell)), 1):
            out.append(line)
            where.append((number, i))
    return NotebookSource("\n".join(out) + "\n", where)


def _cell_text(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


def _python_lines(text: str) -> list[str]:
    """The cell's lines with IPython's own syntax blanked (the line count kept)."""
    lines = text.split("\n")
    if lines and lines[0].lstrip().startswith("%%"):
        if not lines[0].split()[0] in _PYTHON_CELL_MAGICS:
            return ["" for _ in lines]  # %%bash, %%writefile ...: not Python
        lines[0] = ""
    return ["" if _IPYTHON_LINE.search(line) else line for line in lines]
