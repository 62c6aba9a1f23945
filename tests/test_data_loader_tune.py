"""tune_loader (D7, D8): trials, read and decode rates, and the verdict rules."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from torch_tricks.data.loader_tune import (
    ImageFolderDataset,
    LoaderTrial,
    _verdict,
    open_dataset,
    tune_loader,
    tune_loader_path,
)
from torch_tricks.errors import UserError


class SlowFiles(Dataset):
    """Samples read from one file, each costing `delay` seconds of 'decode' (a sleep, so busy CPUs don't skew it)."""

    def __init__(self, path, n: int = 64, sample_bytes: int = 1024, delay: float = 0.004) -> None:
        self.path, self.n, self.sample_bytes, self.delay = str(path), n, sample_bytes, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with open(self.path, "rb") as f:
            f.seek(i * self.sample_bytes)
            raw = f.read(self.sample_bytes)
        time.sleep(self.delay)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8), i

    def files(self) -> list[str]:
        return [self.path]


@pytest.fixture
def slow_files(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes())
    return SlowFiles(path)


def test_tune_measures_trials_rates_and_verdict(slow_files):
    report = tune_loader(slow_files, batch_sizes=(8,), workers=(0, 2), seconds_per_trial=0.4, progress=False)
    assert [(t.batch_size, t.num_workers) for t in report.trials] == [(8, 0), (8, 2)]
    assert all(t.error is None and t.samples > 0 and t.samples_per_s > 0 for t in report.trials)
    assert report.best is max(report.trials, key=lambda t: t.samples_per_s)
    assert report.read_rate_bytes_per_s and report.read_rate_bytes_per_s > 0 and report.read_bytes == 64 * 1024
    assert report.storage_bytes_per_sample == 1024
    assert 50 < report.decode_rate_samples_per_s < 260  # one process, ~4 ms a sample
    assert report.best.batch_bytes_per_sample == 1024 + 8  # uint8 bytes + the int64 index
    # Sleep-bound samples: two workers do about twice the work of one process, so the
    # throughput is what the per-sample cost allows: decode-bound.
    assert report.best.num_workers == 2
    assert report.verdict == "decode-bound", report.reasons
    assert report.advice
    d = report.to_dict()
    json.dumps(d)
    assert d["best"]["num_workers"] == 2 and len(report.rows()) == 2
    assert report.loader_kwargs()["num_workers"] == 2


def _trial(workers: int, rate: float) -> LoaderTrial:
    return LoaderTrial(batch_size=32, num_workers=workers, pin_memory=False, samples=100, seconds=1.0, samples_per_s=rate)


def test_verdict_rules():
    trials = [_trial(0, 100.0), _trial(4, 350.0)]
    best = trials[1]
    # 350 samples/s x 100 kB = 35 MB/s from a 40 MB/s disk: I/O-bound whatever the CPU does.
    v, reasons, advice = _verdict(best, trials, decode_rate=100.0, read_rate=40e6, stored=100e3, cpus=8)
    assert v == "I/O-bound" and any("D4" in a for a in advice)
    # Fast disk; 4 workers x 100/s predicts 400, measured 350: decode-bound.
    v, _, advice = _verdict(best, trials, decode_rate=100.0, read_rate=2e9, stored=100e3, cpus=8)
    assert v == "decode-bound" and any("D3" in a for a in advice)
    # 4 workers x 300/s predicts 1200, measured 350: the time goes elsewhere.
    v, _, _ = _verdict(best, trials, decode_rate=300.0, read_rate=2e9, stored=100e3, cpus=8)
    assert v == "overhead-bound"
    # No files known and no decode rate: cannot tell.
    v, _, _ = _verdict(best, trials, decode_rate=None, read_rate=None, stored=None, cpus=8)
    assert v == "unknown"
    # Workers capped by the CPUs: 2 cores, 4 workers -> predicts 2 x 100.
    v, _, advice = _verdict(best, trials, decode_rate=100.0, read_rate=None, stored=None, cpus=2)
    assert v == "decode-bound" and "CPUs are busy" in advice[0]
    assert _verdict(None, [], None, None, None, 2)[0] == "unknown"
    # More workers were measured and were slower: never "try more workers"; threads instead.
    slow = [_trial(0, 100.0), _trial(2, 60.0)]
    v, _, advice = _verdict(slow[0], slow, decode_rate=105.0, read_rate=None, stored=None, cpus=8)
    assert v == "decode-bound" and "slower" in advice[0] and "ThreadLoader" in advice[0]
    assert not any("try more workers" in a for a in advice)
    # A pack resized at packing time is not told to pre-resize.
    _, _, advice = _verdict(best, trials, decode_rate=100.0, read_rate=2e9, stored=100e3, cpus=8, pre_resized=True)
    assert not any("D1" in a for a in advice)


def test_open_dataset_and_tune_an_image_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        for k in range(3):
            size = (10 + k, 8 + 2 * k)  # different sizes: the batch cannot be stacked
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(tmp_path / c / f"{k}.png")
    ds = open_dataset(tmp_path)
    assert isinstance(ds, ImageFolderDataset) and len(ds) == 6 and ds.classes == ["cat", "dog"]
    image, label = ds[4]
    assert image.dtype == torch.uint8 and image.shape[-1] == 3 and label == 1
    report = tune_loader_path(tmp_path, batch_sizes=(2,), workers=(0,), seconds_per_trial=0.1, progress=False)
    assert report.best is not None and report.best.samples_per_s > 0
    assert report.storage_bytes_per_sample and report.read_rate_bytes_per_s


def test_open_dataset_hdf5(tmp_path):
    pytest.importorskip("h5py")
    from torch_tricks.data.hdf5 import HDF5Dataset, write_hdf5

    write_hdf5((np.zeros((4, 2, 2, 3), dtype=np.uint8), np.arange(4)), tmp_path / "d.h5")
    assert isinstance(open_dataset(tmp_path / "d.h5"), HDF5Dataset)


def test_bad_inputs(tmp_path, slow_files):
    with pytest.raises(UserError, match="no dataset"):
        open_dataset(tmp_path / "missing")
    with pytest.raises(UserError, match="empty"):
        tune_loader(SlowFiles(slow_files.path, n=0), progress=False)
    with pytest.raises(UserError, match="seconds_per_trial"):
        tune_loader(slow_files, seconds_per_trial=0, progress=False)
    with pytest.raises(UserError, match="workers"):
        tune_loader(slow_files, workers=(-1,), progress=False)

    class Stream(IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(UserError, match="map-style"):
        tune_loader(Stream(), progress=False)


def test_every_trial_failing_is_a_user_error(tmp_path):
    class Broken(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise OSError("disk gone")

    with pytest.raises(UserError, match="disk gone"):
        tune_loader(Broken(), workers=(0,), seconds_per_trial=0.1, progress=False)


def test_the_cli_prints_the_reports_own_text(tmp_path, monkeypatch, capsys):
    """``torch-tricks loader-tune`` prints LoaderTuneReport.to_text() (and --json its to_dict())."""
    from PIL import Image

    import torch_tricks.data.loader_tune as LT
    from torch_tricks.cli import main

    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for k in range(3):
            Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(tmp_path / "imgs" / c / f"{k}.png")
    real, reports = LT.tune_loader_path, []
    monkeypatch.setattr(LT, "tune_loader_path", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    args = ["loader-tune", str(tmp_path / "imgs"), "--batch", "2", "--workers", "0", "--seconds", "0.1",
            "--no-progress"]
    assert main(args) == 0
    text = reports[-1].to_text()
    assert capsys.readouterr().out == text + "\n"
    lines = text.splitlines()
    assert lines[0] == "ImageFolderDataset: 6 samples, " + lines[0].split(", ", 1)[1]
    assert lines[1].split() == ["batch", "workers", "pinned", "samples/s", "first", "batch", "s", "best", "error"]
    assert f"verdict: {reports[-1].verdict}" in lines
    assert lines[-1] == "use: make_loader(dataset, batch_size=2, num_workers=0, pin_memory=False)"
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["batch_size"] == 2


def test_report_text_without_rates_or_a_best_setting():
    from torch_tricks.data.loader_tune import LoaderTuneReport

    report = LoaderTuneReport(trials=[LoaderTrial(8, 2, True, error="OSError: gone")], best=None, verdict="unknown",
                              reasons=["no trial ran"], dataset="D", num_samples=1500, cpu_count=4, device="cuda:0")
    assert report.to_text() == "\n".join([
        "D: 1,500 samples, 4 CPUs, device cuda:0",
        "batch  workers  pinned  samples/s  first batch s  best  error",
        "-----  -------  ------  ---------  -------------  ----  -------------",
        "    8        2  yes             0           0.00        OSError: gone",
        "verdict: unknown",
        "  no trial ran",
    ])
