"""Prefetch the next batch while the current one is being used (catalogue D5, T5).

On CUDA this is NVIDIA apex's ``data_prefetcher``: batch i+1 is copied host-to-device on a
side ``torch.cuda.Stream`` with ``non_blocking=True`` from pinned memory while the model
computes on batch i on the current stream. Two synchronisations make it correct:

* ``current_stream.wait_stream(side)`` before batch i+1 is handed out, so no kernel reads
  it before its copy (and device-side ``transform``) has finished;
* ``tensor.record_stream(current_stream)`` on every tensor of the batch: the memory was
  allocated on the side stream, and without it the caching allocator could hand that
  memory to the next copy while kernels on the current stream still read it.

The next copy is queued *before* the current batch is handed out, so it is in flight
during the step even if the step synchronises (``loss.item()``).

Elsewhere (CPU, or any other device) a background thread pulls batches from the loader
into a bounded queue (``depth`` batches), moves them to the device and applies
``transform``, so loading overlaps with compute wherever the loader or the transform
releases the GIL (DataLoader workers, torch ops, file reads, sleeps). Errors raised by the
loader are re-raised in the consumer; leaving the loop early stops and joins the thread.

DataLoader already overlaps *loading* (its workers); what it does not do is the device
copy and a device-side transform, which is why this small class exists.
"""

from __future__ import annotations

import collections.abc
import queue
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["Prefetcher", "to_device"]

_END = object()
_JOIN_TIMEOUT_S = 60.0  # how long closing waits for a loader that is in the middle of a batch


@register_trick(
    "prefetch",
    ids=("D5",),
    kind="data",
    trades="one or two extra batches of (pinned host / device) memory for host-to-device copies hidden behind compute",
    needs="a CUDA device for the stream path (pinned batches: make_loader pins them); elsewhere a background thread",
)
class Prefetcher:
    """Iterate ``loader``'s batches already on ``device`` (and through ``transform``), one step ahead.

    ``transform(batch) -> batch`` runs on the device-side batch, on the side stream on
    CUDA, in the background thread elsewhere (e.g. a :class:`~torch_tricks.data.transforms.Compose`
    of batch transforms, which accept ``(images, labels, ...)`` batches). ``depth`` is the
    number of batches the background thread may hold ready (not used on CUDA, where one
    batch ahead is enough to hide the copy).

    Batches may be tensors, or (nested) lists, tuples, named tuples and dicts of them;
    other leaves pass through unchanged. A CPU tensor that is not pinned is pinned before
    a non-blocking copy to CUDA (otherwise the copy would not be asynchronous); pinning in
    the DataLoader (``pin_memory=True``, done by ``make_loader``) does that in its own
    thread instead.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device | str,
        *,
        non_blocking: bool = True,
        transform: Callable[[Any], Any] | None = None,
        depth: int = 2,
    ) -> None:
        if not isinstance(loader, collections.abc.Iterable):
            raise UserError(f"Prefetcher needs an iterable of batches (e.g. a DataLoader), got {type(loader).__name__}")
        self.device = resolve_device(device)
        if transform is not None and not callable(transform):
            raise UserError(f"transform must be callable, got {type(transform).__name__}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise UserError(f"depth must be an integer >= 1, got {depth!r}")
        self.loader = loader
        self.non_blocking = bool(non_blocking)
        self.transform = transform
        self.depth = depth
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()

    def __iter__(self) -> Iterator[Any]:
        it = self._cuda_iter() if self.device.type == "cuda" else self._thread_iter()
        self._live.add(it)
        return it

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop every iteration still open (and its thread); iterating again starts afresh."""
        for it in list(self._live):
            it.close()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- CUDA: side stream -------------------------------------------------------------

    def _cuda_iter(self) -> Iterator[Any]:
        device = self.device
        stream = torch.cuda.Stream(device=device)
        source = iter(self.loader)

        def load() -> Any:
            try:
                batch = next(source)
            except StopIteration:
                return _END
            with torch.cuda.stream(stream):
                batch = to_device(batch, device, non_blocking=self.non_blocking, pin=self.non_blocking)
                if self.transform is not None:
                    batch = self.transform(batch)
            return batch

        upcoming = load()
        while upcoming is not _END:
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)  # the copy (and transform) of this batch is done before it is used
            batch = upcoming
            _record_stream(batch, current)  # its memory is in use on `current` until the step is done
            upcoming = load()  # queue the next copy now, so it overlaps this step
            yield batch

    # --- elsewhere: background thread --------------------------------------------------

    def _thread_iter(self) -> Iterator[Any]:
        # The loader's iterator is made here, in the caller's thread: that is where
        # DataLoader forks its workers, before our thread exists (forking a process that
        # runs other threads can deadlock the child).
        source = iter(self.loader)
        q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._produce, args=(source, q, stop), name="torch-tricks-prefetch", daemon=True
        )
        del source  # the thread owns it now, and releases it when done
        thread.start()
        try:
            while True:
                try:
                    kind, item = q.get(timeout=0.1)
                except queue.Empty:
                    if not thread.is_alive() and q.empty():
                        raise RuntimeError("the prefetch thread stopped without a result") from None
                    continue
                if kind == "batch":
                    yield item
                elif kind == "end":
                    return
                else:
                    raise item  # the loader's own exception, with its traceback
        finally:
            stop.set()
            _drain(q)  # unblock a producer waiting to put
            thread.join(_JOIN_TIMEOUT_S)

    def _produce(self, source: Iterator[Any], q: queue.Queue[tuple[str, Any]], stop: threading.Event) -> None:
        try:
            for batch in source:
                if stop.is_set():
                    return
                batch = to_device(batch, self.device, non_blocking=self.non_blocking)
                if self.transform is not None:
                    batch = self.transform(batch)
                if not _put(q, ("batch", batch), stop):
                    return
            _put(q, ("end", None), stop)
        except BaseException as exc:  # handed to the consumer, who decides
            _put(q, ("error", exc), stop)
        finally:
            close = getattr(source, "close", None)
            if callable(close):  # a generator: run its cleanup here, in this thread
                close()
            source = None  # a DataLoader iterator shuts its workers down when released


def batch_nbytes(batch: Any) -> int:
    """Bytes of every tensor in ``batch``, through lists, tuples and dicts (other leaves count 0)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (list, tuple)):
        return sum(batch_nbytes(b) for b in batch)
    if isinstance(batch, collections.abc.Mapping):
        return sum(batch_nbytes(b) for b in batch.values())
    return 0


def to_device(batch: Any, device: torch.device | str, *, non_blocking: bool = False, pin: bool = False) -> Any:
    """``batch`` with every tensor moved to ``device``, through lists, tuples, named tuples and dicts.

    ``pin=True`` pins CPU tensors first when the target is CUDA, so that a
    ``non_blocking`` copy really is asynchronous.
    """
    device = torch.device(device)
    pin = pin and device.type == "cuda"

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if pin and x.device.type == "cpu" and not x.is_pinned():
                x = x.pin_memory()
            return x.to(device, non_blocking=non_blocking)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # named tuple
            return type(x)(*(move(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(move(v) for v in x)
        if isinstance(x, collections.abc.Mapping):
            moved = {k: move(v) for k, v in x.items()}
            try:
                return type(x)(moved)
            except TypeError:  # a mapping type that cannot be built from a dict (defaultdict...)
                return moved
        return x

    return move(batch)


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record_stream(v, stream)
    elif isinstance(batch, collections.abc.Mapping):
        for v in batch.values():
            _record_stream(v, stream)


def _put(q: queue.Queue[tuple[str, Any]], item: tuple[str, Any], stop: threading.Event) -> bool:
    """Put, giving up when the consumer has stopped (so the thread never blocks forever)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _drain(q: queue.Queue[tuple[str, Any]]) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
