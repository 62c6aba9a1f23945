"""make_loader defaults (D8, T5), seeded workers (D11), skipping bad samples (D10)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
    get_worker_info,
)

from torch_tricks.data.loader import (
    CountedBatch,
    SkipFailedCollate,
    SkipFailedDataset,
    SkipFailedLoader,
    _ChainedInit,
    _cpu_count,
    collate_skip_failed,
    default_num_workers,
    make_loader,
    rebuild_loader,
    seed_workers,
    skip_failed,
)
from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick
from torch_tricks.seed import worker_init_fn


class RandomDraws(Dataset):
    """Each sample: (index, worker id, numpy draw, python draw, torch draw) - like an augmentation would draw."""

    def __init__(self, n: int = 16) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        return (
            i,
            -1 if info is None else info.id,
            float(np.random.rand()),
            random.random(),
            float(torch.rand(())),
        )


class Flaky(Dataset):
    """Indices in `raises` raise, those in `nones` return None, the rest return (x, i)."""

    def __init__(self, n: int, raises: set[int], nones: set[int]) -> None:
        self.n, self.raises, self.nones = n, raises, nones

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.raises:
            raise ValueError(f"corrupt file #{i}")
        if i in self.nones:
            return None
        return torch.full((3,), float(i)), i


def _epoch(loader) -> list[tuple]:
    out = []
    for idx, wid, a, b, c in loader:
        out.extend(zip(idx.tolist(), wid.tolist(), a.tolist(), b.tolist(), c.tolist()))
    return out


# --- defaults ---------------------------------------------------------------------------


def test_defaults_for_a_tensor_dataset_use_no_workers():
    ds = TensorDataset(torch.randn(100, 3), torch.arange(100))
    loader = make_loader(ds, 16, device="cpu")
    assert loader.num_workers == 0 and default_num_workers(ds) == 0
    assert loader.persistent_workers is False and loader.prefetch_factor is None
    assert loader.pin_memory is False  # CPU target: pinning is useless
    assert loader.drop_last is True  # training
    assert isinstance(loader.sampler, RandomSampler) and loader.generator is not None
    assert len(loader) == 100 // 16


def test_defaults_for_a_disk_like_dataset():
    loader = make_loader(RandomDraws(64), 8, device="cpu")
    assert loader.num_workers == min(_cpu_count(), 8) == default_num_workers(RandomDraws())
    if loader.num_workers:
        assert loader.persistent_workers is True
        assert loader.prefetch_factor == 2
        assert loader.worker_init_fn is worker_init_fn
    cuda = make_loader(RandomDraws(64), 8, device="cuda", num_workers=2)
    assert cuda.prefetch_factor == 4
    assert cuda.pin_memory is torch.cuda.is_available()  # pinned only for a real CUDA target
    val = make_loader(RandomDraws(10), 4, train=False, num_workers=0)
    assert isinstance(val.sampler, SequentialSampler) and val.drop_last is False and len(val) == 3


def test_drop_last_never_empties_an_epoch():
    small = make_loader(RandomDraws(5), 8, num_workers=0)
    assert small.drop_last is False and len(small) == 1
    with pytest.raises(UserError, match="no batch"):
        make_loader(RandomDraws(5), 8, num_workers=0, drop_last=True)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=4, num_workers=0, persistent_workers=True), "persistent_workers"),
        (dict(batch_size=4, num_workers=0, prefetch_factor=2), "prefetch_factor"),
        (dict(batch_size=4, num_workers=-1), "num_workers"),
        (dict(batch_size=4, device="nonsense"), "device"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs, match):
    with pytest.raises(UserError, match=match):
        make_loader(RandomDraws(8), **kwargs)


def test_not_a_dataset():
    with pytest.raises(UserError, match="Dataset"):
        make_loader(42, 4)


# --- D11: reproducible, distinct worker streams ------------------------------------------


def test_two_workers_reproducible_epochs_and_distinct_streams():
    """With 2 workers and a fixed seed, two epochs of augmentation are reproducible, and workers draw different numbers."""
    runs = []
    for _ in range(2):  # two fresh loaders, same seed
        loader = make_loader(RandomDraws(16), 4, num_workers=2, seed=123, device="cpu")
        assert loader.persistent_workers  # the default: workers start once for both epochs
        runs.append([_epoch(loader), _epoch(loader)])
        del loader
    assert runs[0] == runs[1]  # identical order and identical random draws, epoch by epoch
    first, second = runs[0]
    assert sorted(s[0] for s in first) == list(range(16))  # every sample once
    assert first != second  # the next epoch draws new augmentations
    for epoch in runs[0]:
        by_worker = {w: [s[2:] for s in epoch if s[1] == w] for w in (0, 1)}
        assert by_worker[0] and by_worker[1]  # both workers contributed
        for k in range(3):  # numpy, random, torch: no value shared between the workers
            assert not {d[k] for d in by_worker[0]} & {d[k] for d in by_worker[1]}


def test_a_different_seed_gives_different_draws():
    a = _epoch(make_loader(RandomDraws(8), 4, num_workers=0, seed=1))
    b = _epoch(make_loader(RandomDraws(8), 4, num_workers=0, seed=2))
    assert [s[0] for s in a] != [s[0] for s in b]  # the shuffle follows the seed


def test_seed_workers_rebuilds_a_loader():
    ds = RandomDraws(20)

    def theirs(worker_id: int) -> None:
        pass

    plain = DataLoader(ds, batch_size=4, shuffle=True, worker_init_fn=theirs)
    seeded = seed_workers(plain, seed=5)
    assert isinstance(seeded, DataLoader) and seeded.batch_size == 4
    assert isinstance(seeded.worker_init_fn, _ChainedInit) and seeded.worker_init_fn.second is theirs
    ours = make_loader(ds, 4, num_workers=0, seed=5, drop_last=False)
    assert [s[0] for s in _epoch(seeded)] == [s[0] for s in _epoch(ours)]  # same generator -> same order
    again = seed_workers(seeded, seed=5)
    assert again.worker_init_fn is seeded.worker_init_fn  # not chained twice
    with pytest.raises(UserError):
        seed_workers([1, 2, 3])


# --- D10: skipping failed samples ---------------------------------------------------------


RAISES = {0, 5, 15} | {8, 9, 10, 11}  # 8..11 is one whole batch (batch 4, in order)
NONES = {3, 17}


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_failed_counts_and_never_crashes(workers):
    loader = make_loader(Flaky(20, RAISES, NONES), 4, train=False, num_workers=workers, skip_failed=True)
    assert isinstance(loader, SkipFailedLoader)
    bad = RAISES | NONES
    for epoch in range(2):
        batches = list(loader)
        assert len(batches) == 4  # 5 batches, the all-failed one (8..11) skipped
        seen = [i for x, idx in batches for i in idx.tolist()]
        assert seen == [i for i in range(20) if i not in bad]
        assert loader.failed == len(bad)  # counted in the main process, exact with workers
        assert sorted(i for i, _ in loader.failures) == sorted(bad)
        assert loader.failed_total == len(bad) * (epoch + 1)
    errors = dict(loader.failures)
    assert errors[5] == "ValueError: corrupt file #5" and "None" in errors[3]


def test_skip_failed_collate_and_plain_dataloader():
    ds = SkipFailedDataset(Flaky(6, {1}, {2}))
    batch = collate_skip_failed([ds[0], ds[1], ds[2], ds[3]])
    assert isinstance(batch, CountedBatch) and batch.failed == 2
    x, idx = batch.batch
    assert idx.tolist() == [0, 3]
    empty = SkipFailedCollate()([ds[1], ds[2]])
    assert empty.batch is None and empty.failed == 2
    assert ds.n == 6  # attributes reach through the wrapper


class Batched(Flaky):
    """A dataset with a batched read (like PackedDataset) that returns a special batch type, and its own collate_fn."""

    class Stacked(list):
        pass

    def __getitems__(self, indices):
        if any(i in self.raises for i in indices):
            raise OSError("one bad record spoils the batched read")
        return Batched.Stacked(self[i] for i in indices)

    @staticmethod
    def collate_fn(samples):
        kind = "stacked" if isinstance(samples, Batched.Stacked) else "items"
        return kind, default_collate(samples)


def test_skip_failed_keeps_batched_reads_and_the_dataset_collate():
    loader = make_loader(Batched(8, {5}, set()), 4, train=False, num_workers=0, skip_failed=True)
    (kind0, (x0, i0)), (kind1, (x1, i1)) = list(loader)
    assert kind0 == "stacked" and i0.tolist() == [0, 1, 2, 3]  # the fast path survives the wrapper
    assert kind1 == "items" and i1.tolist() == [4, 6, 7]  # the failed batch was re-read item by item
    assert loader.failed == 1


def test_skip_failed_rebuilds_a_loader_and_rejects_iterables():
    loader = skip_failed(DataLoader(Flaky(8, {2}, set()), batch_size=4))
    assert isinstance(loader, SkipFailedLoader)
    assert sum(len(idx) for _, idx in loader) == 7 and loader.failed == 1
    assert skip_failed(loader) is loader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(UserError, match="map-style"):
        make_loader(Stream(), 2, skip_failed=True)


def test_rebuild_loader_keeps_settings_and_class():
    loader = make_loader(Flaky(12, {4}, set()), 4, num_workers=2, skip_failed=True, prefetch_factor=3)
    sampler = SequentialSampler(loader.dataset)
    again = rebuild_loader(loader, sampler=sampler)
    assert isinstance(again, SkipFailedLoader) and again.sampler is sampler
    assert again.generator is loader.generator and again.prefetch_factor == 3 and again.persistent_workers
    assert again.collate_fn is loader.collate_fn and again.dataset is loader.dataset  # not wrapped twice
    assert (again.batch_size, again.drop_last, again.worker_init_fn) == (4, True, worker_init_fn)
    with pytest.raises(UserError, match="rebuild"):
        rebuild_loader(loader, num_workers=0)  # prefetch_factor without workers
    with pytest.raises(UserError):
        rebuild_loader("loader")


def test_tricks_are_registered():
    for name, ids in [("loader_defaults", ("D8", "T5")), ("skip_failed_samples", ("D10",)), ("worker_seeding", ("D11",))]:
        trick = get_trick(name)
        assert trick.kind == "data" and trick.ids == ids
