"""The machine's peak matmul rate (issue 22, item 6): measured per dtype, cached per machine and reused, measured
again when what it depends on changes; MFU against it."""

from __future__ import annotations

import json

import pytest
import torch

from torch_tricks.cli import main
from torch_tricks.errors import UserError
from torch_tricks.inspect.peak import cache_path, device_peak, machine_key, mfu


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "peaks.json"


class Counting:
    """A stand-in measure that counts its calls (the real one is run once, below)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, dev, dtype, max_size):
        self.calls += 1
        return 1e9 * (2 if dtype == torch.bfloat16 else 1), 256


def test_measured_once_then_read_from_the_cache(cache):
    measure = Counting()
    first = device_peak("cpu", measure=measure, max_size=256)
    calls = measure.calls
    assert not first.cached and calls >= 1 and first.flops["fp32"] == 1e9 and cache.is_file()
    again = device_peak("cpu", measure=measure, max_size=256)
    assert again.cached and measure.calls == calls and again.flops == first.flops  # not measured twice
    assert json.loads(cache.read_text())[first.key]["flops"] == first.flops
    device_peak("cpu", measure=measure, max_size=256, refresh=True)
    assert measure.calls == 2 * calls


def test_a_change_of_threads_is_another_machine(cache):
    measure = Counting()
    first = device_peak("cpu", measure=measure, max_size=256)
    calls, threads = measure.calls, torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = device_peak("cpu", measure=measure, max_size=256)
        assert other.key != first.key and not other.cached and measure.calls == 2 * calls
    finally:
        torch.set_num_threads(threads)
    key = machine_key(torch.device("cpu"))
    assert f"threads={threads}" in key and f"torch={torch.__version__}" in key
    assert torch.backends.cpu.get_cpu_capability() in key


def test_the_real_measure_gives_each_dtype_a_rate():
    peak = device_peak("cpu", max_size=256)
    assert peak.flops["fp32"] > 1e8 and peak.size["fp32"] == 256
    assert set(peak.flops) | {n.split()[0] for n in peak.notes} >= {"fp32", "bf16", "fp16"}


def test_a_damaged_cache_is_measured_again_and_rewritten(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    peak = device_peak("cpu", measure=Counting(), max_size=256)
    assert not peak.cached and json.loads(cache.read_text())[peak.key]


def test_an_unwritable_cache_is_one_line(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_TRICKS_CACHE", str(blocker / "sub"))  # a folder under a file
    with pytest.raises(UserError, match="cannot write the peak cache.*set TORCH_TRICKS_CACHE"):
        device_peak("cpu", measure=Counting(), max_size=256)


def test_mfu_is_flops_over_time_over_peak():
    assert mfu(3e9, 0.5, 12e9) == pytest.approx(0.5)
    with pytest.raises(UserError):
        mfu(1.0, 0.0, 1.0)


def test_the_cli_shows_the_cached_peak(capsys, cache):
    device_peak("cpu", measure=Counting(), max_size=256)
    assert main(["peak", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cached"] and data["flops"]["fp32"] == 1e9 and data["path"] == str(cache_path())


def test_a_rate_reads_in_its_unit():
    """A peak measured far too low (a disturbed measurement) reads as itself, not as 0.0 GFLOP/s."""
    from torch_tricks.inspect.peak import rate

    assert (rate(3.2e6), rate(172.7e9), rate(699e12)) == ("3.2 MFLOP/s", "172.7 GFLOP/s", "699.0 TFLOP/s")
