"""Batches read by threads of this process, written straight into the batch (catalogue D3, D5, D8).

:class:`ThreadLoader` is what to use instead of ``DataLoader(num_workers=N)`` when the
per-sample work is decoding and cropping (or just copying raw bytes), which is what is
left once augmentation runs batched on the device (:func:`~torch_tricks.data.transforms.device_augment`, D2).

Why threads, and why by hand: the JPEG decoders (simplejpeg, PyTurboJPEG, opencv), zlib's
crc32 and numpy's copies all release the GIL, so threads decode in parallel as well as
processes do. But a DataLoader worker process must pickle or share-memory every batch it
makes, and the main process must receive it: on 2 cores that is a third of the CPU for
224x224 batches, and it caps decoded samples at a few thousand per second however fast
the decoder is. Here each sample is decoded and copied once, into its row of a batch
buffer (pinned, when the batch goes to a GPU); buffers are reused once the caller has let
go of the batch made from one (never while any tensor or view of it is alive); nothing
is pickled, nothing lives in shared memory (nothing to leak after a crash), start-up is
instant. ``torch.utils.data`` has no thread-based loader, and FFCV's (the model here)
needs its own file format and numba.

Order and resumption: batches follow a seeded permutation per epoch (``seed + epoch``), so
two runs with the same seed see the same batches; :meth:`ThreadLoader.state_dict` records
the epoch and the batches already yielded, and :meth:`~ThreadLoader.load_state_dict`
continues mid-epoch with the very next batch. The per-sample work must be deterministic
(decode, resize, crop): threads finish in any order, so random per-sample transforms would
draw in any order. Put random augmentation in a batched, seeded step instead.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from torch_tricks._malloc import raise_malloc_thresholds
from torch_tricks.data.dataset import PackedDataset, copy_row
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["ThreadLoader", "thread_loader", "keep_freed_heap"]


@register_trick(
    "thread_loader",
    ids=("D3", "D5", "D8"),
    kind="data",
    trades="the GIL for the IPC of worker processes: threads decode straight into the batch buffer, so "
    "per-sample work must release the GIL (JPEG decoders, crc32 and copies do) and be deterministic",
    needs="a map-style dataset of (image array, label) items of one shape, e.g. a PackedDataset with a crop",
    measured_in="benchmarks/data_loading.py",
)
def thread_loader(dataset: Any, batch_size: int, **kwargs: Any) -> "ThreadLoader":
    """A :class:`ThreadLoader` over ``dataset`` (the registered form of the trick)."""
    return ThreadLoader(dataset, batch_size, **kwargs)


class ThreadLoader:
    """Batches ``(images uint8 (B, H, W, C), labels int64 (B,))`` from a map-style dataset, read by threads.

    ``dataset[i]`` must give ``(image, label)`` with ``image`` a numpy array or tensor of
    the same shape for every sample (crop in the dataset's transform). A fixed-shape raw
    :class:`~torch_tricks.data.dataset.PackedDataset` without a transform is read a chunk
    at a time, its bytes copied (and crc-checked) straight into the batch.
    ``num_threads`` (default: the usable cores) threads each fill whole batches (a batch is
    split between threads only when there are more threads than batches in flight);
    ``prefetch`` batches are in flight ahead of the one being consumed.
    ``shuffle``: a new seeded permutation each epoch; ``drop_last`` (default: ``shuffle``)
    drops a last partial batch. ``pin_memory``: batch buffers in page-locked memory
    (needs CUDA; copy them with ``non_blocking=True``).
    ``keep_freed_heap``: on glibc, raise malloc's trim threshold to 64 MB for this process
    (:func:`keep_freed_heap`) when iteration starts: decoders free their work memory after
    every image, glibc hands it back to the kernel, and the kernel then interrupts every
    other thread of the process to flush its TLB: ~7% of the decode time with 2 threads,
    measured. The cost: up to 64 MB of freed memory per malloc arena stays with the process.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        num_threads: int | None = None,
        prefetch: int = 2,
        drop_last: bool | None = None,
        seed: int = 0,
        pin_memory: bool = False,
        keep_freed_heap: bool = True,
    ) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise UserError(f"ThreadLoader needs a map-style dataset (with __getitem__ and __len__), "
                            f"not {type(dataset).__name__}")
        for name, value, low in (("batch_size", batch_size, 1), ("prefetch", prefetch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"{name} must be an integer >= {low}, got {value!r}")
        threads = num_threads if num_threads is not None else len(os.sched_getaffinity(0))
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise UserError(f"num_threads must be an integer >= 1, got {num_threads!r}")
        if pin_memory and not torch.cuda.is_available():
            raise UserError("pin_memory=True needs CUDA (page-locked memory only speeds up copies to a GPU)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.num_threads = threads
        self.prefetch = prefetch
        self.drop_last = shuffle if drop_last is None else bool(drop_last)
        self.seed = int(seed)
        self.pin_memory = pin_memory
        self.keep_freed_heap = keep_freed_heap
        self.epoch = 0
        self._skip = 0  # batches of the current epoch already consumed (set by load_state_dict)
        self._yielded = 0
        self._raw = _raw_shape(dataset)  # (H, W, C) when whole chunks can be copied in
        self._item: tuple[tuple[int, ...], Any] | None = None  # an item's shape and dtype, once seen
        self._pool: ThreadPoolExecutor | None = None
        self._buffers = _Buffers(keep=prefetch + 3)  # in flight, the one being yielded, the caller's last one

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation next (as ``DistributedSampler.set_epoch``)."""
        self.epoch, self._skip = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """Where this loader is: the epoch and how many of its batches were yielded."""
        return {"epoch": self.epoch, "batches": self._yielded, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: the next iteration yields the batch after the last one yielded."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise UserError(f"this loader state was saved with seed {state['seed']}, not {self.seed}: "
                            "the batches would differ; build the loader with the same seed")
        self.epoch, self._skip = int(state["epoch"]), int(state["batches"])

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The sample indices of every batch of ``epoch`` (default: the current one), in order."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + (self.epoch if epoch is None else epoch))
            order = torch.randperm(n, generator=g).numpy()
        else:
            order = np.arange(n)
        stop = (n // self.batch_size) * self.batch_size if self.drop_last else n
        return [order[s : min(s + self.batch_size, stop)] for s in range(0, stop, self.batch_size)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.keep_freed_heap:
            keep_freed_heap()
        plan = self.batches()[self._skip :]
        self._yielded = self._skip
        self._skip = 0
        pool = self._threads()
        inflight: deque[_Batch] = deque()
        last = len(plan) - 1
        try:
            todo = iter(enumerate(plan))
            for k, idx in todo:
                inflight.append(self._start(pool, idx, last=k == last))
                if len(inflight) > self.prefetch:
                    break
            while inflight:
                batch = inflight.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    inflight.append(self._start(pool, nxt[1], last=nxt[0] == last))
                out = batch.result()
                self._yielded += 1
                yield out
            self.epoch += 1
            self._yielded = 0
        finally:
            for b in inflight:  # an epoch left early: drop its queued work, finish what runs
                b.cancel()
            for b in inflight:
                b.wait()

    def close(self) -> None:
        """Stop the loader's threads (also done when the loader is garbage-collected)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _threads(self) -> ThreadPoolExecutor:
        """The loader's threads, kept across epochs (a new thread per epoch costs a start-up each time)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix=f"torch-tricks-loader-{id(self):x}")
        return self._pool

    # ------------------------------------------------------------------ internals

    def _start(self, pool: ThreadPoolExecutor, idx: np.ndarray, last: bool = False) -> "_Batch":
        b = _Batch(len(idx), self.pin_memory, self._buffers)
        if self._raw is not None:
            b.allocate(self._raw)
        elif self._item is not None:  # every item has one shape: allocate now, decode straight into it
            b.allocate(*self._item)
        # a thread fills whole batches: fewer hand-offs between threads, each writing a buffer of its own
        # (1.14x for raw rows, 1.04x for JPEGs on 2 cores, measured); a batch is split only when fewer
        # batches are in flight than there are threads, and the epoch's last batch is split in parts of
        # 8 samples, so that no thread idles while another decodes it alone (on average half a batch's
        # time per epoch: ~1% of an epoch of 50 batches on 2 cores)
        parts = min(len(idx), -(-self.num_threads // (self.prefetch + 1)))
        if last and self.num_threads > 1:
            parts = max(parts, min(-(-len(idx) // 8), 4 * self.num_threads))
        bounds = np.linspace(0, len(idx), parts + 1).astype(int)
        for k0, k1 in zip(bounds[:-1], bounds[1:]):
            if k1 > k0:
                b.futures.append(pool.submit(self._fill, b, idx[k0:k1], int(k0)))
        return b

    def _fill(self, b: "_Batch", idx: np.ndarray, k0: int) -> None:
        if self._raw is not None:
            rows = b.images.reshape(b.n, -1)[k0 : k0 + len(idx)]
            self.dataset.read_batch_into(idx.tolist(), rows)
            b.labels[k0 : k0 + len(idx)] = self.dataset.labels[idx]
            return
        load_into = getattr(self.dataset, "load_into", None)  # decodes straight into the row
        for k, i in enumerate(idx.tolist(), start=k0):
            if load_into is not None and b.images is not None:
                b.labels[k] = load_into(i, b.images[k])
                continue
            item = self.dataset[i]
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise UserError(f"ThreadLoader needs (image, label) items; sample {i} is {type(item).__name__}")
            img, label = item
            if b.images is None:
                first = img.numpy() if isinstance(img, torch.Tensor) else np.asarray(img)
                b.allocate(first.shape, first.dtype)  # the first sample fixes the batch's shape and dtype
            copy_row(i, img, b.images[k])
            b.labels[k] = int(label)
        if b.images is not None:
            self._item = (tuple(b.images.shape[1:]), b.images.dtype)


_TRIM_THRESHOLD = 64 << 20


def keep_freed_heap(nbytes: int = _TRIM_THRESHOLD) -> bool:
    """Raise glibc malloc's trim threshold (``mallopt(M_TRIM_THRESHOLD)``, process-wide) to ``nbytes``.

    Why: a decoder allocates and frees its work memory for every image; by default glibc
    returns freed memory at the top of a heap to the kernel as soon as it passes a small
    threshold, and releasing memory of a multi-threaded process makes the kernel interrupt
    the process's other threads on other cores to flush their TLBs. With two decoding
    threads that cost ~7% of the CPU time per image here (measured: 394 vs 423 us per JPEG;
    two processes paid 400). The same as ``MALLOC_TRIM_THRESHOLD_=67108864`` in the
    environment, but that must be set before Python starts. Only ever raised (a training
    step's :func:`~torch_tricks.train.speed.keep_heap` may have set more); returns whether
    glibc took it (False off glibc). Setting it also fixes the mmap threshold where it is
    instead of letting glibc raise it.
    """
    return raise_malloc_thresholds(trim=nbytes)


class _Buffers:
    """Batch buffers, each handed out again once nothing holds the batch last made from it.

    Why by hand: torch's CPU allocator does not cache, so a fresh 10 MB batch buffer per
    batch pays a page fault (and the kernel zeroing a page) every 4 KB: 10-15% of reading
    a raw batch, measured. FFCV reuses its buffers too, but overwrites a batch the caller
    may still hold; here a buffer is reused only when every tensor, view and array of the
    batch made from it is gone: the batch is made from a fresh numpy view of the buffer,
    every tensor or array derived from the batch keeps that view alive, and a weak
    reference to it says when it died. Pinned buffers are not kept: torch's caching host
    allocator already reuses them, and also knows when a ``non_blocking`` copy out of one
    is still running.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._slots: list[list[Any]] = []  # [buffer, weak reference to the view last handed out]
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A buffer of ``shape`` and ``dtype`` that nothing else holds (contents undefined)."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        with self._lock:
            for slot in self._slots:
                buf, ref = slot
                if buf.shape == shape and buf.dtype == dtype and ref() is None:
                    view = buf.view()
                    slot[1] = weakref.ref(view)
                    return view
            buf = _huge_pages(shape, dtype)
            view = buf.view()
            if len(self._slots) < self.keep:
                self._slots.append([buf, weakref.ref(view)])
            return view


class _Batch:
    """One batch being filled by several threads: a buffer allocated on the first sample's shape."""

    def __init__(self, n: int, pin: bool, buffers: _Buffers) -> None:
        self.n, self.pin, self.buffers = n, pin, buffers
        self.tensor: torch.Tensor | None = None
        self.images: np.ndarray | None = None
        self.labels = np.empty(n, dtype=np.int64)
        self.futures: list[Future] = []
        self._lock = threading.Lock()

    def allocate(self, shape: Sequence[int], dtype: Any = np.uint8) -> None:
        with self._lock:
            if self.images is None:
                if self.pin:
                    t = torch.empty((self.n, *shape), dtype=torch.from_numpy(np.empty(0, dtype)).dtype,
                                    pin_memory=True)
                    self.tensor, self.images = t, t.numpy()
                else:
                    self.images = self.buffers.take((self.n, *shape), dtype)
                    self.tensor = torch.from_numpy(self.images)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        for f in self.futures:
            f.result()  # re-raises a sample's error here, in the consuming thread
        assert self.tensor is not None
        return self.tensor, torch.from_numpy(self.labels)

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()

    def wait(self) -> None:
        """Until no thread writes into this batch any more (its errors are dropped: nobody reads it)."""
        from concurrent.futures import wait

        wait(self.futures)


_HUGE_PAGE = 2 << 20


def _huge_pages(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array in transparent huge pages where Linux offers them on request (``madvise``), else ``np.empty``.

    Why: a 224x224 batch spans ~2,400 4-KB pages, so copying rows into it misses the TLB
    all the time; with 2-MB pages two threads copying rows into eight rotating buffers each
    ran 1.4-1.6x faster here, though ThreadLoader reading raw batches gained only ~3% (it
    rotates fewer buffers). torch's allocator does the same only under ``THP_MEM_ALLOC_ENABLE=1``.
    """
    nbytes = int(np.prod(shape)) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < _HUGE_PAGE:
        return np.empty(shape, dtype)
    mm = mmap.mmap(-1, nbytes + _HUGE_PAGE)  # anonymous, zero pages until written; freed with the last view
    try:
        mm.madvise(advice)
    except OSError:  # THP disabled ("never") or not supported: 4-KB pages, still correct
        pass
    flat = np.frombuffer(mm, dtype=np.uint8)
    start = -flat.ctypes.data % _HUGE_PAGE  # a 2-MB-aligned start: every whole 2 MB can be one page
    return flat[start : start + nbytes].view(dtype).reshape(shape)


def _raw_shape(dataset: Any) -> tuple[int, ...] | None:
    """The sample shape when ``dataset`` can copy whole chunks of raw samples into a batch."""
    if (isinstance(dataset, PackedDataset) and dataset.storage == "raw" and dataset.shape is not None
            and dataset.transform is None and not dataset.labels_only and dataset.center_crop is None):
        return tuple(dataset.shape)
    return None
