"""torch_tricks._optional: the one place that names a pip extra, and errors.one_line."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from torch_tricks._optional import EXTRAS, available, install_hint, require
from torch_tricks.errors import UserError, one_line


def test_require_of_a_missing_module_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)  # `import h5py` now raises ImportError
    with pytest.raises(UserError) as info:
        require("h5py", "data", "HDF5 support")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == 'HDF5 support needs h5py: pip install "torch-tricks[data]"'
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_require_without_a_purpose_still_names_module_and_extra():
    with pytest.raises(UserError, match=r'needs no_such_module_xyz: pip install "torch-tricks\[plot\]"'):
        require("no_such_module_xyz.sub", "plot")


def test_require_of_a_present_module_returns_it():
    import json
    import os.path

    assert require("json", "data") is json
    assert require("os.path", "data") is os.path


def test_require_refuses_an_unknown_extra():
    with pytest.raises(ValueError, match="unknown extra"):
        require("json", "no-such-extra")


def test_available():
    assert available("json")
    assert not available("no_such_module_xyz")


def test_available_sees_a_blocked_module_as_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdb", None)
    assert not available("lmdb")


def test_extras_match_pyproject():
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert EXTRAS == set(declared)
    assert install_hint("onnx") == 'pip install "torch-tricks[onnx]"'


def test_no_other_module_writes_a_pip_extra_by_hand():
    src = Path(__file__).resolve().parents[1] / "src" / "torch_tricks"
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py")
                 if p.name != "_optional.py" and "torch-tricks[" in p.read_text()]
    assert offenders == []


@pytest.mark.parametrize("exc, kw, want", [
    (ValueError("bad value\nsecond line"), {}, "bad value"),
    (ValueError("\n\n  first   real  line \nnext"), {}, "first real line"),
    (ValueError(""), {}, "ValueError"),
    (KeyError(), {}, "KeyError"),
    (RuntimeError("x" * 50), {"limit": 10}, "xxxxxxx..."),
    (TypeError("oops\nmore"), {"with_type": True}, "TypeError: oops"),
    (TypeError(""), {"with_type": True}, "TypeError"),
])
def test_one_line(exc, kw, want):
    assert one_line(exc, **kw) == want
