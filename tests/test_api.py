"""The Python API one import away: ``import torch_tricks as tt`` gives the verbs, lazily."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest
import torch

import torch_tricks as tt


def test_the_verbs_are_one_import_away_and_are_the_functions():
    from torch_tricks.deploy.pipeline import optimize
    from torch_tricks.inspect.summarize import summary
    from torch_tricks.train import TrainConfig, fit
    from torch_tricks.tuning.tuner import tune

    assert (tt.summary, tt.tune, tt.fit, tt.TrainConfig, tt.optimize) == (summary, tune, fit, TrainConfig, optimize)
    for name in tt.__all__:
        assert getattr(tt, name) is not None
    assert set(tt.__all__) <= set(dir(tt))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tt.nope  # noqa: B018


def test_summary_through_the_package_counts_macs():
    s = tt.summary(tt.get_model("resnet18"), torch.randn(1, 3, 64, 64))
    assert s.totals["macs"] == 148_557_824


def test_importing_torch_tricks_does_not_import_torch():
    code = "import sys, torch_tricks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_issue_one_liner_prints_the_macs():
    code = ("import torch, torch_tricks as tt; "
            "print(tt.summary(tt.get_model('resnet18'), torch.randn(1, 3, 64, 64)).totals['macs'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "148557824"


def _packages():
    import torch_tricks

    yield torch_tricks
    for m in pkgutil.walk_packages(torch_tricks.__path__, "torch_tricks."):
        if m.ispkg:
            yield importlib.import_module(m.name)


@pytest.mark.parametrize("pkg", list(_packages()), ids=lambda p: p.__name__)
def test_no_public_name_is_shadowed_by_a_submodule(pkg):
    """``from pkg import name`` must give the function even after ``import pkg.<name>`` ran."""
    subs = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    public = set(getattr(pkg, "__all__", ())) | set(getattr(pkg, "_EXPORTS", ()))
    assert not public & subs, f"{pkg.__name__}: submodules named like public names: {sorted(public & subs)}"


def test_inspect_summary_is_the_function_after_its_module_is_imported():
    importlib.import_module("torch_tricks.inspect.summarize")
    from torch_tricks.inspect import summary

    assert callable(summary) and summary.__name__ == "summary"
    importlib.import_module("torch_tricks.tuning")
    assert callable(tt.tune) and tt.tune.__name__ == "tune"
