"""Issue 37: the doctor reads notebooks: the code cells in order as one module, each finding named by its cell and
the line in it (text and SARIF), IPython's own lines (magics, shell) read as blank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torch_tricks.doctor.notebook import notebook_source
from torch_tricks.doctor.static import lint_paths

CELLS = [
    ("code", ["%matplotlib inline\n", "!pip install torch\n", "import torch\n", "import torch.nn as nn\n"]),
    ("markdown", ["# Training\n", "x.cuda()\n"]),  # markdown: never linted
    ("code", ["class Net(nn.Module):\n", "    def __init__(self):\n", "        super().__init__()\n",
              "        self.layers = [nn.Linear(4, 4)]  # TT101: a plain list\n"]),
    ("code", ["files = !ls\n", "x = torch.randn(3)\n", "x.cuda()  # TT113: the result thrown away\n"]),
    ("code", ["%%bash\n", "x.cuda()\n"]),  # a shell cell: not Python
]


def _notebook(path: Path) -> Path:
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
          "cells": [{"cell_type": kind, "metadata": {}, "source": src, **({"outputs": [], "execution_count": None}
                                                                          if kind == "code" else {})}
                    for kind, src in CELLS]}
    path.write_text(json.dumps(nb))
    return path


def test_findings_name_their_cell_and_line(tmp_path):
    nb = _notebook(tmp_path / "train.ipynb")
    result = lint_paths([tmp_path])
    assert result.files == 1 and not result.errors
    got = [(f.rule, f.extra["cell"], f.line) for f in result.findings]
    assert got == [("TT101", 3, 4), ("TT113", 4, 3)]  # cells 2 (markdown) and 5 (%%bash) are not Python
    assert all(f.path == str(nb) for f in result.findings)


def test_text_and_sarif(tmp_path, capsys):
    from torch_tricks.cli import main

    from tests.test_doctor_cli import validate_sarif

    nb = _notebook(tmp_path / "train.ipynb")
    assert main(["doctor", str(nb)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{nb}:cell 3:4:") and " TT101 " in lines[0]
    assert lines[1].startswith(f"{nb}:cell 4:3:1: TT113 ")
    assert main(["doctor", str(nb), "--format", "sarif"]) == 1
    log = json.loads(capsys.readouterr().out)
    validate_sarif(log)
    results = log["runs"][0]["results"]
    assert [(r["ruleId"], r["properties"]["cell"], r["locations"][0]["physicalLocation"]["region"]["startLine"])
            for r in results] == [("TT101", 3, 4), ("TT113", 4, 3)]


def test_a_file_that_is_no_notebook_is_reported_not_linted(tmp_path):
    (tmp_path / "bad.ipynb").write_text("{not json")
    result = lint_paths([tmp_path])
    (path, reason), = result.errors
    assert path.endswith("bad.ipynb") and reason.startswith("not a notebook: its JSON does not parse")
    with pytest.raises(ValueError, match="no list of cells"):
        notebook_source('{"cells": 3}')


def test_fix_leaves_a_notebook_as_it_is(tmp_path):
    from torch_tricks.doctor.fix import fix_paths

    nb = _notebook(tmp_path / "train.ipynb")
    before = nb.read_text()
    assert fix_paths([tmp_path]) == []
    assert nb.read_text() == before and re.search("cuda", before)
