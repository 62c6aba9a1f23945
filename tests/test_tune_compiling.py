"""compile in the tune (issue 35, item 1): the first call an earlier tune measured here decides whether compile fits
the budget the next time, not the size rule (which under-estimated a transformers model by 4x)."""

from __future__ import annotations

import pytest
import torch.nn as nn

import torch_tricks.tuning.compiling as compiling


def test_a_measured_first_call_replaces_the_size_estimate(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    first = compiling._compile_estimate(model, 0.01)
    assert first == pytest.approx(8.0 + 0.45 * 4 + 10 * 0.01)  # no record yet: the size rule
    compiling.record_compile(model, 61.5)
    assert (tmp_path / "compile_times.json").is_file()
    assert compiling._compile_estimate(model, 0.01) == pytest.approx(61.5 * 1.1 + 10 * 0.01)
    compiling.record_compile(model, 20.0)  # a warm cache's: the last, where inductor's cache holds kernels
    monkeypatch.setattr(compiling, "_inductor_cache_warm", lambda: True)
    assert compiling._compile_estimate(model, 0.01) == pytest.approx(20.0 * 1.1 + 10 * 0.01)
    monkeypatch.setattr(compiling, "_inductor_cache_warm", lambda: False)  # an empty cache: the longest (cold)
    assert compiling._compile_estimate(model, 0.01) == pytest.approx(61.5 * 1.1 + 10 * 0.01)
    # beside other processes using half the cores, a compilation takes longer: the estimate says so
    assert compiling._compile_estimate(model, 0.01, foreign_share=0.5) == pytest.approx(61.5 * 1.6 + 10 * 0.01)
    assert compiling._compile_estimate(nn.Linear(2, 2), 0.0, foreign_share=0.5) == pytest.approx((8.0 + 0.45) * 1.5)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))  # another size: its own record
    assert compiling._compile_estimate(other, 0.01) == first


def test_a_damaged_or_unwritable_cache_falls_back_to_the_size_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path))
    (tmp_path / "compile_times.json").write_text("{not json")
    model = nn.Linear(4, 4)
    assert compiling._compile_estimate(model, 0.0) == pytest.approx(8.0 + 0.45)
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "file.txt" / "sub"))
    (tmp_path / "file.txt").write_text("")
    compiling.record_compile(model, 3.0)  # cannot be written: left as it is, no error
