"""Measure the best DataLoader settings for a dataset, and say what limits it (catalogue D7, D8).

:func:`tune_loader` runs one short trial per (batch size, worker count): a loader made by
:func:`~torch_tricks.data.loader.make_loader` is iterated for ``seconds_per_trial``
seconds, the first batch excluded (it carries the worker start-up), and samples/s is
recorded. Two more measurements explain the result:

* the **storage read rate**: the dataset's files (``dataset.files()``, or the file or
  directory at ``dataset.path``) read sequentially for a bounded time, with the page cache
  for each file dropped first where the OS allows (``posix_fadvise(DONTNEED)``; no root
  needed, only this file's clean pages are evicted), so it is the disk's rate, not RAM's;
* the **decode rate**: ``dataset[i]`` for random ``i`` in this process, i.e. the work one
  worker does per sample (read + decode + transform).

The verdict, with ``T`` the best throughput (samples/s) at ``w`` workers, ``B`` the stored
bytes per sample (file bytes / samples), ``R`` the read rate, ``D`` the decode rate and
``C`` the usable CPUs:

* **I/O-bound** if ``T * B >= 0.7 * R``: the loader already pulls at least 70% of what the
  storage gives sequentially (random reads get less), so more workers cannot help; pack
  small files (D4), cache in RAM (D6), store smaller samples (D1) or use faster storage
  (D7);
* otherwise **decode-bound** if ``T >= 0.6 * D * min(max(w, 1), C)``: throughput is what
  the per-sample work allows on the cores in use, so it scales with workers until the
  cores run out; faster decoding (D3), pre-resized or raw storage (D1, D3), augmentation
  on the device (D2), or more cores;
* otherwise **overhead-bound**: the workers deliver much less than their per-sample rate
  predicts, so the time goes elsewhere: shipping big batches between processes, the
  collate, or the main process; with ``w == 0`` best, multiprocessing costs more than it
  saves (samples are cheap or already in memory);
* **unknown** when a rate could not be measured.

Timings are wall clock on a possibly busy machine: treat differences under ~10% as noise.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset, IterableDataset, RandomSampler, default_collate

from torch_tricks._format import human_bytes, table
from torch_tricks._optional import require
from torch_tricks.data.loader import _cpu_count, _dataset_collate, make_loader
from torch_tricks.data.prefetch import batch_nbytes, to_device
from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError, one_line
from torch_tricks.seed import seeded_generator

__all__ = ["tune_loader", "tune_loader_path", "open_dataset", "LoaderTrial", "LoaderTuneReport", "ImageFolderDataset"]

IO_BOUND_FRACTION = 0.7
DECODE_BOUND_FRACTION = 0.6
_CHUNK = 8 << 20
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp", ".gif")


@dataclass
class LoaderTrial:
    """One measured setting."""

    batch_size: int
    num_workers: int
    pin_memory: bool
    samples: int = 0  # counted after the first batch
    seconds: float = 0.0
    samples_per_s: float = 0.0
    first_batch_s: float = 0.0  # worker start-up + first batch, not in samples_per_s
    batch_bytes_per_sample: float | None = None  # in-memory (decoded) bytes per sample
    error: str | None = None


@dataclass
class LoaderTuneReport:
    """What :func:`tune_loader` measured, the fastest setting, and the verdict (see the module docstring)."""

    trials: list[LoaderTrial]
    best: LoaderTrial | None
    verdict: str  # "I/O-bound" | "decode-bound" | "overhead-bound" | "unknown"
    reasons: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    read_rate_bytes_per_s: float | None = None
    read_bytes: int = 0
    read_cold: bool = False  # page cache dropped before reading
    storage_bytes_per_sample: float | None = None
    decode_rate_samples_per_s: float | None = None
    device: str = "cpu"
    cpu_count: int = 1
    dataset: str = ""
    num_samples: int = 0

    def rows(self) -> list[dict[str, Any]]:
        """One dict per trial, for a table."""
        return [
            {
                "batch_size": t.batch_size,
                "workers": t.num_workers,
                "pin_memory": t.pin_memory,
                "samples/s": round(t.samples_per_s, 1),
                "first batch s": round(t.first_batch_s, 3),
                "best": t is self.best,
                "error": t.error or "",
            }
            for t in self.trials
        ]

    def loader_kwargs(self) -> dict[str, Any]:
        """``make_loader`` keyword arguments for the fastest setting (empty if nothing ran)."""
        if self.best is None:
            return {}
        return {"batch_size": self.best.batch_size, "num_workers": self.best.num_workers, "pin_memory": self.best.pin_memory}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["best"] = asdict(self.best) if self.best is not None else None
        return d

    def to_text(self) -> str:
        """What ``torch-tricks loader-tune`` prints: the trials' table, the read and decode rates, the
        verdict with its reasons, the advice, and the ``make_loader`` call to use."""
        rows = [[t["batch_size"], t["workers"], "yes" if t["pin_memory"] else "no", f"{t['samples/s']:,.0f}",
                 f"{t['first batch s']:.2f}", "*" if t["best"] else "", t["error"]] for t in self.rows()]
        lines = [f"{self.dataset}: {self.num_samples:,} samples, {self.cpu_count} CPUs, device {self.device}",
                 table(["batch", "workers", "pinned", "samples/s", "first batch s", "best", "error"], rows, "rrlrrll")]
        if self.read_rate_bytes_per_s:
            lines.append(f"storage read rate: {human_bytes(self.read_rate_bytes_per_s)}/s "
                         f"({'cold' if self.read_cold else 'page cache'}, {human_bytes(self.read_bytes)} read)")
        if self.decode_rate_samples_per_s:
            lines.append(f"decode rate, one process: {self.decode_rate_samples_per_s:,.0f} samples/s")
        lines.append(f"verdict: {self.verdict}")
        lines += [f"  {why}" for why in self.reasons]
        if self.advice:
            lines.append("advice:")
            lines += [f"  {a}" for a in self.advice]
        if self.best is not None:
            kwargs = ", ".join(f"{k}={v}" for k, v in self.loader_kwargs().items())
            lines.append(f"use: make_loader(dataset, {kwargs})")
        return "\n".join(lines)


def tune_loader(
    dataset: Dataset[Any],
    *,
    batch_sizes: Sequence[int] = (64,),
    workers: Sequence[int] | None = None,
    seconds_per_trial: float = 2.0,
    device: torch.device | str = "cpu",
    progress: bool = True,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    cold_read: bool = True,
    seed: int = 0,
) -> LoaderTuneReport:
    """Time the loader for every ``batch_sizes`` x ``workers`` and diagnose the bottleneck.

    ``workers`` defaults to 0, 1, 2, 4, ... up to the usable CPUs (at most 16).
    ``device="cuda"`` pins memory and copies every batch to the GPU, as training would.
    Samples that cannot be stacked (images of different sizes) are counted as lists, so
    the trial measures read + decode, not the collate. ``cold_read=False`` keeps the page
    cache (the read rate is then RAM's for files already cached).
    """
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UserError(f"tune_loader needs a map-style dataset (with __getitem__ and __len__), got {type(dataset).__name__}")
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise UserError("the dataset is empty: nothing to time")
    try:
        seconds = float(seconds_per_trial)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0:
        raise UserError(f"seconds_per_trial must be > 0, got {seconds_per_trial!r}")
    sizes = _positive_ints(batch_sizes, "batch_sizes", minimum=1)
    cpus = _cpu_count()
    counts = _positive_ints(workers, "workers", minimum=0) if workers is not None else _default_workers(cpus)
    dev = resolve_device(device)

    from tqdm.auto import tqdm

    bar = tqdm(total=len(sizes) * len(counts) + 2, desc="loader-tune", unit="step", disable=not progress)
    trials: list[LoaderTrial] = []
    try:
        for bs in sizes:
            for w in counts:
                bar.set_postfix_str(f"batch {bs}, workers {w}")
                trials.append(_trial(dataset, bs, w, seconds, dev, collate_fn, seed))
                bar.update(1)
        if all(t.error is not None for t in trials):
            raise UserError(f"every loader trial failed; the first: {trials[0].error}")
        bar.set_postfix_str("decode rate")
        decode_rate = _decode_rate(dataset, seconds, seed)
        bar.update(1)
        bar.set_postfix_str("read rate")
        files = _dataset_files(dataset)
        read_rate, read_bytes, cold = _read_rate(files, seconds, cold_read) if files else (None, 0, False)
        bar.update(1)
    finally:
        bar.close()

    ok = [t for t in trials if t.error is None]
    best = max(ok, key=lambda t: t.samples_per_s) if ok else None
    stored = sum(_size(f) for f in files) / n if files else None
    if getattr(dataset, "lengths", None) is not None and best is not None:  # token rows, held in memory
        verdict, reasons, advice = _token_verdict(best, trials)
    else:
        verdict, reasons, advice = _verdict(best, trials, decode_rate, read_rate, stored, cpus,
                                            _pre_resized(dataset))
    return LoaderTuneReport(
        trials=trials,
        best=best,
        verdict=verdict,
        reasons=reasons,
        advice=advice,
        read_rate_bytes_per_s=read_rate,
        read_bytes=read_bytes,
        read_cold=cold,
        storage_bytes_per_sample=stored,
        decode_rate_samples_per_s=decode_rate,
        device=str(dev),
        cpu_count=cpus,
        dataset=_name(dataset),
        num_samples=n,
    )


def tune_loader_path(path: str | os.PathLike[str], *, tokenizer: str | None = None, **kwargs: Any) -> LoaderTuneReport:
    """:func:`tune_loader` on the dataset at ``path`` (see :func:`open_dataset`); for the CLI.

    A packed dataset is timed with its own ``collate_packed`` (batches read as one array),
    as training would use it; a token set (rows of token ids: ``tokenizer`` for a text
    column) with the padding collate training uses by default (T39).
    """
    from torch_tricks.data.token_sets import is_token_set

    if is_token_set(path):
        from torch_tricks.data.token_batches import pad_collate
        from torch_tricks.data.token_sets import load_token_rows

        kwargs.setdefault("collate_fn", pad_collate())
        return tune_loader(load_token_rows(path, tokenizer=tokenizer), **kwargs)
    if tokenizer is not None:
        raise UserError(f"--tokenizer is for a token set (a saved data set folder, FILE.jsonl or FILE.parquet); "
                        f"{str(path)!r} is not one: leave it out")
    dataset = open_dataset(path)
    if kwargs.get("collate_fn") is None and type(dataset).__name__ == "PackedDataset":
        from torch_tricks.data import dataset as packed

        kwargs["collate_fn"] = getattr(packed, "collate_packed", None)
    return tune_loader(dataset, **kwargs)


def open_dataset(path: str | os.PathLike[str]) -> Dataset[Any]:
    """The dataset stored at ``path``: an HDF5 file, an ImageFolder tree (``root/class/image``), or a packed dataset."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"no dataset at {str(p)!r}")
    if p.is_file() and p.suffix.lower() in (".h5", ".hdf5", ".hdf"):
        from torch_tricks.data.hdf5 import HDF5Dataset

        return HDF5Dataset(p)
    if p.is_dir() and ImageFolderDataset.looks_like(p):
        return ImageFolderDataset(p)
    try:
        from torch_tricks.data.dataset import PackedDataset
    except ImportError as exc:
        raise UserError(f"{str(p)!r} is not an ImageFolder tree or HDF5 file, and packed datasets cannot be read here: {exc}") from None
    return PackedDataset(p)


class ImageFolderDataset(Dataset):
    """``root/<class>/<image>`` files as ``(uint8 HWC tensor, class index)``, decoded with Pillow.

    A minimal reader (torchvision's ``ImageFolder`` without torchvision) so that the
    tuner can time a raw tree; classes are the sorted sub-directory names.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = str(root)
        root_p = Path(root)
        self.classes = sorted(d.name for d in root_p.iterdir() if d.is_dir())
        self.samples: list[tuple[str, int]] = []
        for c, name in enumerate(self.classes):
            for dirpath, _, names in sorted(os.walk(root_p / name)):
                for f in sorted(names):
                    if f.lower().endswith(_IMAGE_SUFFIXES):
                        self.samples.append((os.path.join(dirpath, f), c))
        if not self.samples:
            raise UserError(f"no images under {self.path!r} (expected root/<class>/<image>)")

    @staticmethod
    def looks_like(root: Path) -> bool:
        for d in root.iterdir():
            if d.is_dir() and any(f.suffix.lower() in _IMAGE_SUFFIXES for f in d.iterdir() if f.is_file()):
                return True
        return False

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import numpy as np

        Image = require("PIL.Image", "data", "reading an ImageFolder tree")
        path, label = self.samples[index]
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
        return torch.from_numpy(arr.copy()), label

    def files(self) -> list[str]:
        return [p for p, _ in self.samples]


# --- measurements ----------------------------------------------------------------------


def _trial(
    dataset: Any, batch_size: int, workers: int, seconds: float, device: torch.device,
    collate_fn: Callable[[list[Any]], Any] | None, seed: int,
) -> LoaderTrial:
    n = len(dataset)
    # Enough shuffled epochs back to back that no trial runs out (the sampler is lazy).
    sampler = RandomSampler(dataset, num_samples=n * max(1, math.ceil(10**7 / n)), generator=seeded_generator(seed))
    loader = make_loader(
        dataset, batch_size, train=True, device=device, num_workers=workers, persistent_workers=False,
        drop_last=False, seed=seed, sampler=sampler,
        collate_fn=_TolerantCollate(collate_fn or _dataset_collate(dataset) or default_collate),
    )
    trial = LoaderTrial(batch_size, workers, loader.pin_memory)
    it = None
    try:
        start = time.perf_counter()
        it = iter(loader)
        first = _consume(next(it), device)
        trial.first_batch_s = time.perf_counter() - start
        k = _batch_len(first)
        trial.batch_bytes_per_sample = batch_nbytes(first) / k if k else None
        t0 = time.perf_counter()
        count = 0
        for batch in it:
            count += _batch_len(_consume(batch, device))
            if time.perf_counter() - t0 >= seconds:
                break
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        trial.seconds = time.perf_counter() - t0
        trial.samples = count
        trial.samples_per_s = count / trial.seconds if trial.seconds > 0 else 0.0
    except Exception as exc:  # a failing setting is a result, not a crash of the whole tuning
        trial.error = one_line(exc, 200, with_type=True)
    finally:
        del it  # shuts the workers down now, not at the next garbage collection
    return trial


def _decode_rate(dataset: Any, seconds: float, seed: int) -> float | None:
    """``dataset[i]`` per second in this process (random ``i``), at least 3 samples."""
    rng = random.Random(seed)
    n = len(dataset)
    count, t0 = 0, time.perf_counter()
    try:
        while count < 3 or time.perf_counter() - t0 < seconds:
            dataset[rng.randrange(n)]
            count += 1
    except Exception:
        return None
    elapsed = time.perf_counter() - t0
    return count / elapsed if elapsed > 0 else None


def _read_rate(files: list[str], seconds: float, cold: bool) -> tuple[float | None, int, bool]:
    """Sequential read rate (bytes/s) of ``files``, for at most ``seconds``."""
    total, dropped = 0, cold and hasattr(os, "posix_fadvise")
    buf = bytearray(_CHUNK)
    t0 = time.perf_counter()
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if dropped:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    dropped = False
            with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
                while True:
                    got = f.readinto(buf)
                    if not got:
                        break
                    total += got
                    if time.perf_counter() - t0 >= seconds:
                        break
        finally:
            os.close(fd)
        if time.perf_counter() - t0 >= seconds:
            break
    elapsed = time.perf_counter() - t0
    if total == 0 or elapsed <= 0:
        return None, total, False
    return total / elapsed, total, dropped


def _verdict(
    best: LoaderTrial | None, trials: list[LoaderTrial], decode_rate: float | None,
    read_rate: float | None, stored: float | None, cpus: int, pre_resized: bool = False,
) -> tuple[str, list[str], list[str]]:
    if best is None:
        return "unknown", ["no trial succeeded"], []
    t, w = best.samples_per_s, best.num_workers
    reasons = [f"best: {t:.1f} samples/s with batch {best.batch_size} and {w} workers"]
    base = [x for x in trials if x.error is None and x.num_workers == 0 and x.batch_size == best.batch_size]
    if base and base[0].samples_per_s > 0 and w > 0:
        reasons.append(f"{t / base[0].samples_per_s:.2f}x the throughput without workers")
    if read_rate is not None and stored is not None and _io_bound(t * stored, read_rate, reasons):
        return "I/O-bound", reasons, [
            "pack small files into one container (D4: torch-tricks pack)",
            "cache the data in RAM if it fits (D6)",
            "store pre-resized samples (D1) or use faster storage such as local NVMe (D7)",
        ]
    if decode_rate is None or t <= 0:
        reasons.append("the per-sample rate could not be measured")
        return "unknown", reasons, []
    effective = min(max(w, 1), cpus)
    predicted = decode_rate * effective
    reasons.append(
        f"one process does {decode_rate:.1f} samples/s; x{effective} worker(s) predicts {predicted:.1f}, measured {t:.1f}"
    )
    if t >= DECODE_BOUND_FRACTION * predicted:
        return "decode-bound", reasons, _decode_bound_advice(best, trials, cpus, pre_resized)
    if w == 0:
        return "overhead-bound", reasons, [
            "workers cost more than they save here (cheap or in-memory samples): use num_workers=0",
        ]
    return "overhead-bound", reasons, [
        "batches are expensive to move between processes or to collate: keep samples uint8, "
        "make batches larger, or collate less",
        "check that the main process is not the bottleneck (transforms in the loop, .item() syncs)",
    ]


def _token_verdict(best: LoaderTrial, trials: list[LoaderTrial]) -> tuple[str, list[str], list[str]]:
    """Token rows are read from memory and padded: nothing to decode, so workers only cost their copies; what
    decides the step's speed is how many of the tokens computed are padding (T39-T41), which ``tune`` measures."""
    t, w = best.samples_per_s, best.num_workers
    reasons = [f"best: {t:.1f} rows/s with batch {best.batch_size} and {w} workers (token rows in memory, each "
               "batch padded to its longest row)"]
    base = [x for x in trials if x.error is None and x.num_workers == 0 and x.batch_size == best.batch_size]
    if base and base[0].samples_per_s > 0 and w > 0:
        reasons.append(f"{t / base[0].samples_per_s:.2f}x the throughput without workers")
    advice = ["num_workers=0 (rows come from memory: workers only add copies)" if w == 0 else
              f"num_workers={w}: the collate of many rows is worth a process here",
              "how the rows are batched (padded, grouped, packed: token_batches) decides the step's speed: "
              "torch-tricks tune --data PATH measures it in real tokens a second"]
    return "in-memory", reasons, advice


def _io_bound(need: float, read_rate: float, reasons: list[str]) -> bool:
    """Whether reading ``need`` bytes/s comes close to the storage's sequential rate (said in ``reasons``)."""
    reasons.append(f"reads {need / 1e6:.1f} MB/s of the storage's {read_rate / 1e6:.1f} MB/s sequential")
    return need >= IO_BOUND_FRACTION * read_rate


def _decode_bound_advice(best: LoaderTrial, trials: list[LoaderTrial], cpus: int, pre_resized: bool) -> list[str]:
    """What helps when decoding is the limit, led by whether more workers can (they were slower, the
    CPUs are all busy, or they are worth a try)."""
    w = best.num_workers
    advice = [
        "faster decoding (D3): decode only the crop (PackedDataset(center_crop=N) on a crop-ready JPEG "
        "pack), the fast IDCT (fast_dct=True), reduce-on-decode, or raw uint8 storage",
        *([] if pre_resized else ["store samples pre-resized to the training size (D1)"]),
        "move augmentation to the device as batched transforms (D2)",
    ]
    slower = [x for x in trials if x.error is None and x.batch_size == best.batch_size and x.num_workers > w]
    if slower:
        advice.insert(0, f"more worker processes were slower ({max(x.num_workers for x in slower)} measured): "
                         "moving decoded batches between processes costs more than it saves here; read with "
                         "ThreadLoader (threads decode straight into the batch, no inter-process copies)")
    elif w >= cpus:
        advice.insert(0, f"all {cpus} CPUs are busy: more workers will not help; more cores will")
    else:
        advice.insert(0, f"try more workers (up to {cpus})")
    return advice


# --- helpers ---------------------------------------------------------------------------


def _pre_resized(dataset: Any) -> bool:
    """Whether ``dataset`` is a pack whose samples were resized (or decoded to raw) when packed (D1)."""
    reader = getattr(dataset, "reader", None)
    meta = (getattr(reader, "header", None) or {}).get("meta", {}) if reader is not None else {}
    return bool(meta.get("resize") or meta.get("raw_size") or getattr(dataset, "storage", "") == "raw")


class _Unstacked(list):
    """A batch whose samples could not be stacked: kept as a list of samples."""


class _TolerantCollate:
    """``inner(samples)``, or the samples as an :class:`_Unstacked` list when they cannot be stacked."""

    def __init__(self, inner: Callable[[list[Any]], Any]) -> None:
        self.inner = inner

    def __call__(self, samples: list[Any]) -> Any:
        try:
            return self.inner(samples)
        except (RuntimeError, TypeError, ValueError):
            return _Unstacked(samples)


def _consume(batch: Any, device: torch.device) -> Any:
    if device.type == "cuda":
        return to_device(batch, device, non_blocking=True)
    return batch


def _batch_len(batch: Any) -> int:
    if isinstance(batch, _Unstacked):
        return len(batch)
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return 1


def _dataset_files(dataset: Any) -> list[str]:
    files = getattr(dataset, "files", None)
    if callable(files):
        try:
            return [str(f) for f in files()]
        except Exception:
            return []
    path = getattr(dataset, "path", None)
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        if p.is_file():
            return [str(p)]
        if p.is_dir():
            return [os.path.join(d, f) for d, _, names in sorted(os.walk(p)) for f in sorted(names)]
    return []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _default_workers(cpus: int) -> list[int]:
    top = min(cpus, 16)
    counts = {0, top}
    k = 1
    while k < top:
        counts.add(k)
        k *= 2
    return sorted(counts)


def _positive_ints(values: Any, name: str, minimum: int) -> list[int]:
    if isinstance(values, int) and not isinstance(values, bool):
        values = (values,)
    try:
        out = [v for v in values]
    except TypeError:
        raise UserError(f"{name} must be a list of integers, got {values!r}") from None
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in out):
        raise UserError(f"{name} must be a non-empty list of integers >= {minimum}, got {values!r}")
    return sorted(set(out))


def _name(dataset: Any) -> str:
    text = repr(dataset)
    if text.startswith("<"):  # the default object repr says nothing useful
        text = type(dataset).__name__
    return text if len(text) <= 120 else text[:117] + "..."
