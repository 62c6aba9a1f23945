"""Read a pack made by :func:`~torch_tricks.data.pack.pack` as a map-style ``Dataset`` (D4, D6, D9).

Random access by index, so any sampler shuffles globally (no shard-level shuffle
buffers), ``len()`` comes from the header (no guessing with many workers), resuming
mid-epoch is just resuming the sampler, and nothing lives in shared memory (nothing to
leak after a crash). Files are opened lazily in each worker process (D9) and never
cross a fork.

Batches of fixed-shape raw samples are read as **one** ``(B, H, W, 3)`` uint8 array
through ``__getitems__`` (which torch's DataLoader calls when a dataset has it): no
per-sample decode, no per-sample objects, no per-sample trip through a worker pipe.
Use it with :func:`collate_packed`::

    ds = PackedDataset("train.pack")
    loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=4,
                        persistent_workers=True, collate_fn=collate_packed)
    for images, labels in loader:   # uint8 (B, H, W, 3), int64 (B,)
        ...

With the default ``collate_fn`` the same batches come out, at the cost of one more copy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from torch_tricks.data import decode as _dec
from torch_tricks.data.formats import LMDBReader, NativeReader, open_reader
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["PackedDataset", "collate_packed"]


@register_trick(
    "packed_dataset",
    ids=("D4", "D6", "D9"),
    kind="data",
    trades="nothing at read time: random access into a pack, files opened per worker, whole raw batches "
    "as one array; cache_bytes spends RAM to pin samples in memory",
    needs="a pack made by `torch-tricks pack`; lmdb for LMDB packs",
    measured_in="benchmarks/data_loading.py",
)
class PackedDataset(Dataset):
    """A packed data set (native or LMDB, detected) as ``(image, label)`` pairs.

    ``image`` is an ``(H, W, 3)`` uint8 RGB array, or ``transform(image)``.
    ``decode_size``: for JPEG/encoded packs, decode at the smallest fast DCT scale whose
    shorter side is still ``>= decode_size`` (the image can be larger: resize in your
    transform). Ignored for raw packs.
    ``labels_only``: items are just the label (an int), read from the index without
    touching sample bytes; for class-balance counts or building samplers. ``targets``
    gives all labels at once the same way.
    ``cache_bytes`` (D6): keep up to this many bytes of stored samples (the first ones
    in index order) in this process's RAM, filled here in ``__init__``. DataLoader
    workers started by fork (the Linux default up to Python 3.13) share that one copy
    copy-on-write; with spawn / forkserver workers the cache is not sent along, and each
    worker caches the first samples it reads, up to ``cache_bytes / num_workers``, so
    the total stays within budget (use ``persistent_workers=True`` or it is refilled
    every epoch). Both formats are memory-mapped, so the OS page cache already keeps
    hot samples in RAM for all workers; the cache guarantees residency, and saves the
    crc check on hits, but not the decode of encoded samples.
    ``verify``: check each sample's crc32 (``"once"``, the default: the first time this
    process reads it; ``True``: on every read; ``False``: never). zlib's crc32 runs at
    about 3-4 GB/s here, as much as the copy of a raw sample: re-checking unchanged
    bytes every epoch would cost raw reading most of its speed, and a damaged sample is
    still caught the first time it is read (:func:`~torch_tricks.data.formats.verify_pack`
    checks a whole pack at once).
    ``decoder``: force one of :data:`~torch_tricks.data.decode.DECODERS`.
    ``center_crop``: items are the central ``N x N`` (or ``(h, w)``) of each image, as
    torchvision's ``CenterCrop`` (small images padded with zeros), before ``transform``.
    For JPEG packs made crop-ready (``pack(storage="jpeg")``'s default) only the MCUs the
    crop covers are decoded (:func:`~torch_tricks.data.decode.decode_crop`, same pixels):
    ~7% less time per image for a 224 crop of a 256-short-side image, measured.
    ``fast_dct``: decode JPEGs with libjpeg-turbo's fast IDCT (as FFCV does): ~3% less
    decode time for pixels within a few levels of the accurate IDCT (see
    :func:`~torch_tricks.data.decode.decode`); off by default.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        transform: Callable[[np.ndarray], Any] | None = None,
        decode_size: int | None = None,
        labels_only: bool = False,
        cache_bytes: int = 0,
        verify: bool | str = "once",
        decoder: str | None = None,
        center_crop: int | tuple[int, int] | None = None,
        fast_dct: bool = False,
    ) -> None:
        self.path = Path(path)
        self.reader: NativeReader | LMDBReader = open_reader(path, verify=verify)
        self.transform = transform
        self.decode_size = decode_size
        self.fast_dct = bool(fast_dct)
        self.center_crop = _crop_size(center_crop)
        self.labels_only = labels_only
        self.storage = self.reader.storage
        self.shape = self.reader.shape
        self.classes: list[str] = self.reader.classes
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.decoder = _dec._resolve(decoder) if self.storage != "raw" and not labels_only else decoder
        self._labels: np.ndarray | None = None
        if cache_bytes < 0:
            raise UserError(f"cache_bytes must be >= 0, not {cache_bytes}")
        self._cache = _RamCache(int(cache_bytes))
        if cache_bytes and not labels_only:
            self._cache.fill(self.reader)

    # ------------------------------------------------------------------ map-style API

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, i: int) -> Any:
        i = self._check(i)
        if self.labels_only:
            return self._label(i)
        img = self._image(i, self._stored(i))
        return (self.transform(img) if self.transform is not None else img), self._label(i)

    def __getitems__(self, indices: Sequence[int]) -> list:
        """A batch: what torch's DataLoader calls (with automatic batching) instead of ``__getitem__``.

        Fixed-shape raw packs without a transform return the batch pre-stacked (a list of
        ``(image, label)`` views into one array, which :func:`collate_packed` turns into
        tensors without copying); everything else returns a list of items.
        """
        indices = [self._check(int(i)) for i in indices]
        if self.labels_only:
            return [self._label(i) for i in indices]
        if self.storage == "raw" and self.shape is not None and self.transform is None and self.center_crop is None:
            images, labels = self._batch(np.asarray(indices, dtype=np.int64))
            return _StackedSamples(images, labels)
        stored = self._stored_many(indices)
        out = []
        for i, buf in zip(indices, stored):
            img = self._image(i, buf)
            out.append(((self.transform(img) if self.transform is not None else img), self._label(i)))
        return out

    # ------------------------------------------------------------------ extras

    @property
    def labels(self) -> np.ndarray:
        """Every label as an int64 array, from the index alone (no sample bytes read)."""
        if self._labels is None:
            self._labels = self.reader.labels
        return self._labels

    @property
    def targets(self) -> list[int]:
        """Every label as a list, like ``ImageFolder.targets`` (from the index alone)."""
        return self.labels.tolist()

    def get_batch(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(images (B, H, W, C) uint8, labels (B,) int64)`` for a fixed-shape raw pack, in one array.

        Needs ``storage='raw'`` packed with ``raw_size`` (or raw samples that all happen to
        share one shape).
        """
        self._require_fixed_raw()
        return self._batch(self._check_many(indices))

    def read_batch_into(self, indices: Sequence[int], flat: np.ndarray) -> None:
        """Copy raw samples ``indices`` into the rows of ``flat`` (``(B, H*W*C)`` uint8; crc-checked, cached).

        What :meth:`get_batch` and :class:`~torch_tricks.data.threads.ThreadLoader` use to
        write straight into a batch buffer they own.
        """
        self._require_fixed_raw()
        self._read_rows(self._check_many(indices), flat)

    def _batch(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`get_batch` for indices already checked (non-negative, in range)."""
        out = np.empty((len(idx), *self.shape), dtype=np.uint8)
        self._read_rows(idx, out.reshape(len(idx), -1))
        return out, self.labels[idx]

    def _read_rows(self, idx: np.ndarray, flat: np.ndarray) -> None:
        """:meth:`read_batch_into` for indices already checked: from the RAM cache where it has them."""
        if not self._cache.active:
            self.reader.read_into(idx, flat)
            return
        misses, rows = [], []
        for k, i in enumerate(idx.tolist()):
            hit = self._cache.get(i)
            if hit is not None:
                flat[k] = hit
            else:
                misses.append(i)
                rows.append(k)
        if misses:
            tmp = np.empty((len(misses), flat.shape[1]), dtype=np.uint8)
            self.reader.read_into(misses, tmp)
            for k, row in enumerate(rows):
                flat[row] = tmp[k]
                self._cache.offer(misses[k], tmp[k])

    def load_into(self, i: int, out: np.ndarray) -> int:
        """Sample ``i`` (decoded, transformed) copied into ``out``; returns its label.

        What :class:`~torch_tricks.data.threads.ThreadLoader` calls to fill a batch row: the
        JPEG is decoded into a buffer the calling thread reuses (no allocation per image),
        since the result is copied out at once. ``out`` must have the item's shape.
        """
        i = self._check(int(i))
        if isinstance(self.reader, LMDBReader) and not self._cache.active:
            stored = self.reader.view(i)  # no copy, no transaction per sample: decoded at once
        else:
            stored = self._stored(i)
        img = self._image(i, stored, transient=True)
        copy_row(i, self.transform(img) if self.transform is not None else img, out)
        return self._label(i)

    def cache_info(self) -> dict[str, int]:
        """This process's RAM cache: ``budget``, ``samples``, ``bytes`` held, ``pid``."""
        return self._cache.info()

    def name(self, i: int) -> str:
        """Sample ``i``'s source name (its path relative to the packed folder, or its index)."""
        return self.reader.name(self._check(i))

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.shape)) if self.shape else "varying"
        return (f"PackedDataset({str(self.path)!r}, {len(self)} samples, {len(self.classes)} classes, "
                f"{self.reader.fmt}/{self.storage}, shape {shape})")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = self._cache.for_worker()  # never pickle the cached bytes into every worker
        return state

    # ------------------------------------------------------------------ internals

    def _require_fixed_raw(self) -> None:
        if self.storage != "raw" or self.shape is None:
            raise UserError(
                f"batched reads need a raw pack whose samples share one shape; {self.path} is "
                f"{self.storage!r} with {'one shape' if self.shape else 'varying shapes'}: "
                "re-pack with storage='raw', raw_size=N, or read samples one by one"
            )

    def _check_many(self, indices: Sequence[int]) -> np.ndarray:
        """``indices`` as an int64 array, negative ones counted from the end (one numpy pass, not one call each)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if len(idx) and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"sample index {bad} out of range for {n} samples")
        return np.where(idx < 0, idx + n, idx) if len(idx) and idx.min() < 0 else idx

    def _check(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} samples")
        return int(i) + n if i < 0 else int(i)

    def _label(self, i: int) -> int:
        return int(self.labels[i])

    def _stored(self, i: int) -> np.ndarray:
        hit = self._cache.get(i)
        if hit is not None:
            return hit
        buf = self.reader.read(i)
        self._cache.offer(i, buf)
        return buf

    def _stored_many(self, indices: Sequence[int]) -> list[np.ndarray]:
        if self._cache.active or not isinstance(self.reader, LMDBReader):
            return [self._stored(i) for i in indices]
        return self.reader.read_many(indices)  # one LMDB transaction for the batch

    def _image(self, i: int, buf: np.ndarray, *, transient: bool = False) -> np.ndarray:
        """Sample ``i``'s image from its stored bytes (center-cropped if asked). ``transient``: the caller
        copies it out at once, so it may be a view of the pack or of the thread's decode buffer."""
        crop = self.center_crop
        if self.storage == "raw":
            rec = self.reader.index[i]
            img = np.asarray(buf).reshape(int(rec["height"]), int(rec["width"]), int(rec["channels"]))
            if crop is not None:
                return _dec.center_crop(img, crop, copy=not transient)
            return img if transient else np.array(img)
        try:
            if crop is not None and self.decode_size is None:
                rec = self.reader.index[i]
                h, w = int(rec["height"]), int(rec["width"])
                if h >= crop[0] and w >= crop[1]:  # else decode whole and pad, as center_crop does
                    top, left = int(round((h - crop[0]) / 2.0)), int(round((w - crop[1]) / 2.0))
                    return _dec.decode_crop(buf, top, left, crop[0], crop[1], decoder=self.decoder,
                                            reuse=transient, fast_dct=self.fast_dct)
            img = _dec.decode(buf, min_size=self.decode_size, decoder=self.decoder, reuse=transient,
                              fast_dct=self.fast_dct)
            return img if crop is None else _dec.center_crop(img, crop, copy=not transient)
        except _dec.DecodeError as exc:
            raise _dec.DecodeError(f"sample {i} ({self.reader.name(i)}) of {self.path}: {exc}") from None


def _crop_size(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if size is None:
        return None
    hw = (size, size) if isinstance(size, int) and not isinstance(size, bool) else tuple(size)
    if len(hw) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in hw):
        raise UserError(f"center_crop must be a positive int or (height, width), not {size!r}")
    return hw


def copy_row(i: int, img: Any, out: np.ndarray) -> None:
    """Copy sample ``i``'s image (array or tensor) into its batch row ``out``, which fixes shape and dtype."""
    arr = img.numpy() if isinstance(img, torch.Tensor) else np.asarray(img)
    if arr.shape != out.shape or arr.dtype != out.dtype:
        raise UserError(
            f"sample {i} is {tuple(arr.shape)} {arr.dtype} but the batch is {tuple(out.shape)} {out.dtype}: "
            "give the dataset a transform that crops every sample to one size and keeps one dtype"
        )
    np.copyto(out, arr)


def collate_packed(batch: Any) -> Any:
    """``collate_fn`` for :class:`PackedDataset`: pre-stacked raw batches become tensors without a copy.

    Returns ``[images uint8 (B, H, W, C), labels int64 (B,)]``, the same structure and
    dtypes ``default_collate`` gives for ``(array, int)`` items; anything else is passed
    to ``default_collate``.
    """
    if isinstance(batch, _StackedSamples):
        return [torch.from_numpy(batch.images), torch.from_numpy(batch.labels)]
    return default_collate(batch)


class _StackedSamples(list):
    """A batch read as one array, that still looks like a list of ``(image, label)`` items.

    ``default_collate`` sees ordinary items (views into the stacked array) and stacks them
    again; :func:`collate_packed` uses ``.images`` / ``.labels`` directly.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        super().__init__(zip(images, labels.tolist()))
        self.images = images
        self.labels = np.ascontiguousarray(labels, dtype=np.int64)


class _RamCache:
    """A per-process, first-come cache of stored sample bytes, bounded by ``budget`` bytes.

    First-come, not LRU: with random sampling every sample is equally likely next, so
    evicting buys nothing, and a cache that never changes stays shared copy-on-write
    across forked workers (its pages are only ever read).
    """

    def __init__(self, budget: int, *, share: bool = False) -> None:
        self.budget = budget
        self._share = share  # a spawned worker: take budget / num_workers on first use
        self._buf: np.ndarray | None = None
        self._off: np.ndarray | None = None  # per sample: offset in _buf, -1 if not cached
        self._len: np.ndarray | None = None
        self._used = 0
        self._pid = os.getpid()

    @property
    def active(self) -> bool:
        return self.budget > 0

    def fill(self, reader: NativeReader | LMDBReader) -> None:
        """Cache samples 0, 1, 2, ... while they fit (read sequentially, so this is fast)."""
        lengths = np.asarray(reader.index["length"], dtype=np.int64)
        ends = np.cumsum(lengths)
        k = int(np.searchsorted(ends, self.budget, side="right"))
        self._alloc(len(lengths), int(ends[k - 1]) if k else 0)
        step = 1024
        for start in range(0, k, step):
            idx = list(range(start, min(k, start + step)))
            for i, buf in zip(idx, reader.read_many(idx)):
                self._put(i, buf)

    def get(self, i: int) -> np.ndarray | None:
        if self._off is None:
            return None
        off = self._off[i]
        if off < 0:
            return None
        return self._buf[off : off + self._len[i]]

    def offer(self, i: int, buf: np.ndarray) -> None:
        """Keep ``buf`` if there is room (only in worker processes that were not forked from a filled cache)."""
        if not self._share or not self.budget:
            return
        if self._buf is None:
            info = torch.utils.data.get_worker_info()
            share = self.budget // (info.num_workers if info is not None else 1)
            self._alloc(None, share)
        if self._used + len(buf) <= len(self._buf):
            self._put(i, buf)

    def for_worker(self) -> "_RamCache":
        return _RamCache(self.budget, share=True)

    def info(self) -> dict[str, int]:
        held = 0 if self._off is None else int((self._off >= 0).sum())
        return {"budget": self.budget, "samples": held, "bytes": self._used, "pid": os.getpid()}

    def _alloc(self, n: int | None, nbytes: int) -> None:
        self._buf = np.empty(nbytes, dtype=np.uint8)  # pages are only committed as they are written
        self._off = np.full(n or 0, -1, dtype=np.int64) if n is not None else None
        self._len = np.zeros(n or 0, dtype=np.int64) if n is not None else None
        self._used = 0

    def _put(self, i: int, buf: np.ndarray) -> None:
        if self._off is None or i >= len(self._off):  # lazily sized in workers
            n = max(i + 1, 1024 if self._off is None else 2 * len(self._off))
            off = np.full(n, -1, dtype=np.int64)
            ln = np.zeros(n, dtype=np.int64)
            if self._off is not None:
                off[: len(self._off)] = self._off
                ln[: len(self._len)] = self._len
            self._off, self._len = off, ln
        n = len(buf)
        self._buf[self._used : self._used + n] = buf
        self._off[i] = self._used
        self._len[i] = n
        self._used += n
