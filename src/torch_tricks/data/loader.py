"""A DataLoader with sane defaults, seeded workers, and bad samples skipped (catalogue D8, D10, D11, T5).

:func:`make_loader` is ``torch.utils.data.DataLoader`` with the settings people get wrong
chosen for them, each for a reason:

* ``num_workers = min(CPUs, 8)``: decoding and augmenting in the main process starves the
  model; past ~8 workers per process the gain is usually gone and each worker costs memory
  (a copy of the dataset object) and start-up time. A :class:`~torch.utils.data.TensorDataset`
  gets 0: its samples are already tensors in memory, and shipping them between processes
  costs more than indexing them.
* ``pin_memory`` only when the target device is CUDA: page-locked host memory lets the
  copy to the GPU run asynchronously (``non_blocking=True``, T5); on CPU it is useless and
  DataLoader warns about it.
* ``persistent_workers`` when there are workers: otherwise every epoch forks and
  initialises all workers again (seconds for big datasets).
* ``prefetch_factor`` 2 batches per worker (PyTorch's default), 4 on CUDA, where steps are
  fast and a slow sample otherwise stalls the GPU.
* ``drop_last=True`` when training: a last batch of one sample makes BatchNorm fail
  ("Expected more than 1 value per channel") and a small one gives noisy statistics; it
  also keeps shapes fixed for ``cudnn.benchmark`` and ``torch.compile``.
* a seeded ``generator`` and :func:`torch_tricks.seed.worker_init_fn` (D11): the
  shuffle order and every worker's ``random`` / numpy / torch streams are reproducible
  from ``seed`` and distinct between workers. (With 0 workers samples are drawn in the
  main process, whose generators only :func:`~torch_tricks.seed.seed_everything`
  controls.)

Bad samples (D10): with ``skip_failed=True`` a sample whose loading raises, or that is
``None``, is dropped from its batch and counted, and the epoch goes on. See
:class:`SkipFailedLoader` for where the count appears.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    Subset,
    TensorDataset,
    default_collate,
)

from torch_tricks.device import parse as parse_device
from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import register_trick
from torch_tricks.seed import seeded_generator, worker_init_fn

__all__ = [
    "make_loader",
    "default_num_workers",
    "SkipFailedLoader",
    "SkipFailedDataset",
    "SkipFailedCollate",
    "collate_skip_failed",
    "FailedSample",
    "CountedBatch",
    "skip_failed",
    "seed_workers",
    "rebuild_loader",
    "MAX_DEFAULT_WORKERS",
]

MAX_DEFAULT_WORKERS = 8


@register_trick(
    "loader_defaults",
    ids=("D8", "T5"),
    kind="data",
    trades="host memory (worker copies, prefetched and pinned batches) and start-up time for a GPU that is never kept waiting",
    needs="a map-style or iterable Dataset; a CUDA device for pinned memory to matter",
)
def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    train: bool = True,
    device: torch.device | str | None = None,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool | None = None,
    prefetch_factor: int | None = None,
    drop_last: bool | None = None,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    skip_failed: bool = False,
    sampler: Sampler[Any] | None = None,
) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` with the defaults in the module docstring.

    Every ``None`` argument gets its default; anything given is used as it is (after a
    check that DataLoader would accept it). ``train`` shuffles (with the seeded generator)
    and drops the last partial batch (unless it is the only one); ``device`` (default: CUDA if available, else CPU)
    decides pinning and the prefetch depth. ``sampler`` (e.g. a ``DistributedSampler``)
    replaces the shuffle. ``collate_fn=None`` uses the dataset's own ``collate_fn``
    attribute when it has a callable one, else ``default_collate``.
    ``skip_failed=True`` returns a :class:`SkipFailedLoader`.
    """
    _check_dataset(dataset)
    _require_int("batch_size", batch_size, 1)
    # a loader may be built for a CUDA target on a machine without one (it is pinned only for a real one)
    dev = resolve_device(device) if device is None else parse_device(device)
    _check_order_args(dataset, sampler, skip_failed)
    iterable = isinstance(dataset, IterableDataset)
    workers = default_num_workers(dataset) if num_workers is None else _require_int("num_workers", num_workers, 0)
    pin_memory, persistent_workers, prefetch_factor = _worker_settings(
        dev, workers, pin_memory, persistent_workers, prefetch_factor
    )
    drop_last = _drop_last(drop_last, _length(sampler if sampler is not None else dataset), batch_size,
                           bool(train) and not iterable)

    if collate_fn is None:
        collate_fn = _dataset_collate(dataset)

    kwargs: dict[str, Any] = dict(
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=bool(pin_memory),
        drop_last=bool(drop_last),
        worker_init_fn=worker_init_fn if workers > 0 else None,
        generator=seeded_generator(seed),
        prefetch_factor=prefetch_factor,
        persistent_workers=bool(persistent_workers),
    )
    if sampler is not None:
        kwargs["sampler"] = sampler
    elif not iterable:
        kwargs["shuffle"] = bool(train)
    if skip_failed:
        return SkipFailedLoader(dataset, **kwargs)
    return DataLoader(dataset, **kwargs)


def default_num_workers(dataset: Any = None) -> int:
    """``min(usable CPUs, 8)``, or 0 for a TensorDataset (in memory already: workers only add IPC)."""
    if _in_memory(dataset):
        return 0
    return max(0, min(_cpu_count(), MAX_DEFAULT_WORKERS))


# --- skipping samples that fail to load (D10) ------------------------------------------


class FailedSample:
    """Stands in for a sample whose loading raised (or returned ``None``), inside a worker.

    Small and picklable, so it crosses the worker queue where the exception might not.
    """

    def __init__(self, index: Any, error: str) -> None:
        self.index = index
        self.error = error

    def __repr__(self) -> str:
        return f"FailedSample(index={self.index!r}, error={self.error!r})"


class SkipFailedDataset(Dataset):
    """Wrap ``dataset`` so that a failing ``__getitem__`` yields a :class:`FailedSample` instead of raising.

    ``catch`` is the tuple of exception types treated as "this sample is bad"
    (default: every ``Exception``; ``KeyboardInterrupt`` and ``SystemExit`` still stop
    the run). Attributes not found here are looked up on the wrapped dataset.
    """

    def __init__(self, dataset: Dataset[Any], catch: tuple[type[BaseException], ...] = (Exception,)) -> None:
        _check_dataset(dataset)
        if isinstance(dataset, IterableDataset):
            raise UserError("SkipFailedDataset needs a map-style dataset (one with __getitem__)")
        self.dataset = dataset
        self.catch = tuple(catch)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        try:
            sample = self.dataset[index]
        except self.catch as exc:
            return FailedSample(index, one_line(exc, 200, with_type=True))
        if sample is None:
            return FailedSample(index, "__getitem__ returned None")
        return sample

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        """A whole batch (DataLoader calls this when it exists): the wrapped dataset's own
        batched read if it has one, and sample by sample only when that fails, to find the bad ones."""
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is not None:
            try:
                items = batched(indices)
            except self.catch:
                items = None
            if items is not None:
                if any(s is None for s in items):
                    return [FailedSample(i, "__getitems__ returned None") if s is None else s for i, s in zip(indices, items)]
                return items  # as it is: it may be a special batch type its collate_fn knows
        return [self[i] for i in indices]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "catch") or name.startswith("__"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


class CountedBatch:
    """What :class:`SkipFailedCollate` returns: the collated good samples plus the failures.

    ``batch`` is ``None`` when every sample of the batch failed. It has a ``pin_memory``
    method, so DataLoader's pinning thread pins the batch inside and keeps the failures.
    """

    def __init__(self, batch: Any, failures: tuple[tuple[Any, str], ...]) -> None:
        self.batch = batch
        self.failures = failures

    @property
    def failed(self) -> int:
        return len(self.failures)

    def pin_memory(self) -> CountedBatch:
        from torch.utils.data._utils.pin_memory import pin_memory as _pin  # DataLoader's own tree walk

        return CountedBatch(None if self.batch is None else _pin(self.batch), self.failures)

    def __repr__(self) -> str:
        return f"CountedBatch(failed={self.failed}, batch={'None' if self.batch is None else type(self.batch).__name__})"


class SkipFailedCollate:
    """``collate_fn`` that drops :class:`FailedSample` entries, collates the rest, and returns a :class:`CountedBatch`.

    It runs inside the worker, so the count has to travel with the batch to reach the
    main process: worker copies of any counter would stay in the workers.
    :class:`SkipFailedLoader` unwraps the :class:`CountedBatch` again; with a plain
    ``DataLoader`` you get the :class:`CountedBatch` objects themselves.
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.collate_fn = collate_fn if collate_fn is not None else default_collate

    def __call__(self, samples: Sequence[Any]) -> CountedBatch:
        failures = tuple((s.index, s.error) for s in samples if isinstance(s, FailedSample))
        if not failures:  # untouched, so batch types that the inner collate_fn knows keep working
            return CountedBatch(self.collate_fn(samples), ())
        good = [s for s in samples if not isinstance(s, FailedSample)]
        return CountedBatch(self.collate_fn(good) if good else None, failures)


collate_skip_failed = SkipFailedCollate()  # with default_collate


class SkipFailedLoader(DataLoader):
    """A DataLoader whose bad samples are dropped from their batch and counted; the epoch never stops for one.

    Where the count is: every batch travels from its worker as a :class:`CountedBatch`,
    so the count is exact whatever the number of workers; iterating this loader unwraps
    it, yields the ordinary collated batch (fewer samples where some failed), and
    accumulates in the main process:

    * ``failed``: samples dropped so far in the current (or last finished) epoch, reset
      when a new iteration starts;
    * ``failures``: ``(index, "ExcType: message")`` for each of them;
    * ``failed_total``: all samples dropped since the loader was made.

    A batch in which *every* sample failed is skipped (not yielded), so an epoch can
    yield fewer than ``len(loader)`` batches. Don't run two iterations of one loader at
    once: they share the counters.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        catch: tuple[type[BaseException], ...] = (Exception,),
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, SkipFailedDataset):
            dataset = SkipFailedDataset(dataset, catch)
        collate = kwargs.get("collate_fn")
        if not isinstance(collate, SkipFailedCollate):
            kwargs["collate_fn"] = SkipFailedCollate(collate)
        super().__init__(dataset, **kwargs)
        self.failed = 0
        self.failed_total = 0
        self.failures: list[tuple[Any, str]] = []

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        inner = super().__iter__()
        self.failed = 0
        self.failures = []
        return self._unwrap(inner)

    def _unwrap(self, inner: Iterator[Any]) -> Iterator[Any]:
        for item in inner:
            if not isinstance(item, CountedBatch):  # a collate_fn swapped in after construction
                yield item
                continue
            if item.failures:
                self.failed += item.failed
                self.failed_total += item.failed
                self.failures.extend(item.failures)
            if item.batch is not None:
                yield item.batch


@register_trick(
    "skip_failed_samples",
    ids=("D10",),
    kind="data",
    trades="batches that are sometimes smaller, and silently bad data unless you read the count, for epochs that never crash on a bad file",
    needs="a map-style dataset; check loader.failed / loader.failures after each epoch",
)
def skip_failed(loader: DataLoader, *, catch: tuple[type[BaseException], ...] = (Exception,)) -> SkipFailedLoader:
    """The same loader (same dataset order, workers, collate_fn...) rebuilt as a :class:`SkipFailedLoader`."""
    if not isinstance(loader, DataLoader):
        raise UserError(f"skip_failed needs a torch DataLoader, got {type(loader).__name__}")
    if isinstance(loader, SkipFailedLoader):
        return loader
    if isinstance(loader.dataset, IterableDataset):
        raise UserError("skip_failed needs a map-style dataset (one with __getitem__)")
    return SkipFailedLoader(loader.dataset, catch=catch, **_loader_kwargs(loader))


# --- per-worker seeding (D11) ----------------------------------------------------------


@register_trick(
    "worker_seeding",
    ids=("D11",),
    kind="data",
    trades="nothing measurable, for augmentations that differ between workers and repeat from run to run",
    needs="a DataLoader; random numbers drawn inside the dataset (numpy, random, torch)",
)
def seed_workers(loader: DataLoader, seed: int = 0) -> DataLoader:
    """The same loader rebuilt with a generator seeded by ``seed`` and :func:`~torch_tricks.seed.worker_init_fn`.

    The generator fixes the shuffle order and each epoch's worker ``base_seed`` (without
    it both come from the global RNG, so they change with anything else that drew from
    it); the init function re-seeds ``random``, numpy and OpenCV from it in each worker,
    explicitly rather than relying on DataLoader's internals. An existing
    ``worker_init_fn`` still runs, after ours.
    """
    if not isinstance(loader, DataLoader):
        raise UserError(f"seed_workers needs a torch DataLoader, got {type(loader).__name__}")
    g = seeded_generator(seed)
    kwargs = _loader_kwargs(loader, generator=g)
    theirs = loader.worker_init_fn
    if theirs is None or theirs is worker_init_fn:
        kwargs["worker_init_fn"] = worker_init_fn
    elif isinstance(theirs, _ChainedInit) and theirs.first is worker_init_fn:
        kwargs["worker_init_fn"] = theirs
    else:
        kwargs["worker_init_fn"] = _ChainedInit(worker_init_fn, theirs)
    return _build(loader, kwargs)


def rebuild_loader(loader: DataLoader, **overrides: Any) -> DataLoader:
    """A new loader like ``loader`` (same class if it is a :class:`SkipFailedLoader`), with ``overrides`` applied.

    Keeps what ``DataLoader(loader.dataset, batch_size=..., ...)`` by hand tends to lose:
    the generator, ``prefetch_factor``, ``persistent_workers``, ``in_order``, the
    worker init function and the skip-failed wrapping. For DDP pass
    ``sampler=DistributedSampler(loader.dataset, ...)``: the batch size and
    ``drop_last`` stay.
    """
    if not isinstance(loader, DataLoader):
        raise UserError(f"rebuild_loader needs a torch DataLoader, got {type(loader).__name__}")
    kwargs = _loader_kwargs(loader)
    kwargs.update(overrides)
    return _build(loader, kwargs)


def _build(loader: DataLoader, kwargs: dict[str, Any]) -> DataLoader:
    try:
        if isinstance(loader, SkipFailedLoader):
            return SkipFailedLoader(loader.dataset, **kwargs)
        return DataLoader(loader.dataset, **kwargs)
    except (ValueError, TypeError) as exc:  # DataLoader's own argument checks
        raise UserError(f"cannot rebuild the loader: {exc}") from None


class _ChainedInit:
    """Two worker init functions, in order; a class (not a closure) so spawn can pickle it."""

    def __init__(self, first: Callable[[int], None], second: Callable[[int], None]) -> None:
        self.first, self.second = first, second

    def __call__(self, worker_id: int) -> None:
        self.first(worker_id)
        self.second(worker_id)


# --- helpers ---------------------------------------------------------------------------


def _loader_kwargs(loader: DataLoader, generator: torch.Generator | None = None) -> dict[str, Any]:
    """Constructor arguments that rebuild ``loader`` (optionally with a new generator)."""
    gen = generator if generator is not None else loader.generator
    kw: dict[str, Any] = dict(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=gen,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        kw["pin_memory_device"] = loader.pin_memory_device
    if hasattr(loader, "in_order"):
        kw["in_order"] = loader.in_order
    iterable = isinstance(loader.dataset, IterableDataset)
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) and generator is not None:
        sampler = RandomSampler(
            sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples, generator=generator
        )
    if loader.batch_size is not None:  # DataLoader built the BatchSampler itself: rebuild it from the sampler
        kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
        if not iterable:
            kw["sampler"] = sampler
    elif loader.batch_sampler is not None:  # a user batch_sampler: it keeps its own randomness
        kw["batch_sampler"] = loader.batch_sampler
    else:
        kw["batch_size"] = None
        if not iterable:
            kw["sampler"] = sampler
    return kw


def _require_int(name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) of at least ``minimum``; else a UserError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_order_args(dataset: Any, sampler: Any, skip_failed: bool) -> None:
    """An IterableDataset takes no sampler and cannot skip failed samples: say so before DataLoader does worse."""
    iterable = isinstance(dataset, IterableDataset)
    if iterable and sampler is not None:
        raise UserError("an IterableDataset decides its own order: drop sampler= (DataLoader cannot use one)")
    if iterable and skip_failed:
        raise UserError("skip_failed needs a map-style dataset (one with __getitem__): an iterable one cannot be resumed after an error")


def _worker_settings(
    dev: torch.device, workers: int, pin_memory: bool | None, persistent_workers: bool | None,
    prefetch_factor: int | None,
) -> tuple[bool, bool, int | None]:
    """``(pin_memory, persistent_workers, prefetch_factor)``: the defaults for ``None``, the given ones checked."""
    if pin_memory is None:
        pin_memory = dev.type == "cuda" and torch.cuda.is_available()
    if persistent_workers is None:
        persistent_workers = workers > 0
    elif persistent_workers and workers == 0:
        raise UserError("persistent_workers=True needs num_workers > 0: there are no workers to keep")
    if prefetch_factor is None:
        prefetch_factor = (4 if dev.type == "cuda" else 2) if workers > 0 else None
    elif workers == 0:
        raise UserError("prefetch_factor needs num_workers > 0: without workers nothing is prefetched")
    else:
        _require_int("prefetch_factor", prefetch_factor, 1)
    return pin_memory, persistent_workers, prefetch_factor


def _drop_last(drop_last: bool | None, n: int | None, batch_size: int, map_style_training: bool) -> bool:
    """``drop_last`` when training, except for the only (partial) batch; an explicit True that leaves
    no batch at all is refused."""
    if drop_last is None:
        # Never drop the only (partial) batch: an epoch with no batch at all helps nobody.
        return map_style_training and (n is None or n >= batch_size)
    if drop_last and n is not None and n < batch_size:
        raise UserError(
            f"drop_last=True with {n} samples and batch_size={batch_size} gives no batch at all: "
            "lower batch_size or set drop_last=False"
        )
    return drop_last


def _check_dataset(dataset: Any) -> None:
    if isinstance(dataset, IterableDataset):
        return
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UserError(
            f"expected a torch Dataset with __getitem__ and __len__ (or an IterableDataset), got {type(dataset).__name__}"
        )


def _dataset_collate(dataset: Any) -> Callable[[list[Any]], Any] | None:
    """The dataset's own ``collate_fn`` attribute, if it has a callable one (a dataset knows its batch type best)."""
    fn = getattr(dataset, "collate_fn", None)
    return fn if callable(fn) else None


def _in_memory(dataset: Any) -> bool:
    while isinstance(dataset, (Subset, SkipFailedDataset)):
        dataset = dataset.dataset
    return isinstance(dataset, TensorDataset)


def _length(obj: Any) -> int | None:
    if isinstance(obj, IterableDataset):
        return None
    try:
        return len(obj)
    except TypeError:
        return None


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (containers, taskset)
    except (AttributeError, OSError):
        return os.cpu_count() or 1

