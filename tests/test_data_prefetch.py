"""Prefetcher (D5): the CPU thread path here; the CUDA stream path where a GPU exists."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from torch_tricks.data.loader import make_loader
from torch_tricks.data.prefetch import Prefetcher, to_device
from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torch-tricks-prefetch" and t.is_alive()]


class Source:
    """An iterable of tensors that records when each item was produced and whether it was closed."""

    def __init__(self, n: int, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.n, self.delay, self.fail_at = n, delay, fail_at
        self.produced: list[tuple[float, float]] = []
        self.closed = False

    def __iter__(self):
        try:
            for i in range(self.n):
                if i == self.fail_at:
                    raise ValueError(f"bad batch {i}")
                start = time.perf_counter()
                if self.delay:
                    time.sleep(self.delay)
                self.produced.append((start, time.perf_counter()))
                yield torch.tensor([i])
        finally:
            self.closed = True


def test_order_preserved_and_transform_applied():
    loader = make_loader(TensorDataset(torch.arange(20.0), torch.arange(20)), 4, train=False)
    expected = list(loader)
    got = list(Prefetcher(loader, "cpu", transform=lambda b: [b[0] * 2, b[1]]))
    assert len(got) == len(expected) == 5
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex * 2) and torch.equal(y, ey)
    assert len(Prefetcher(loader, "cpu")) == 5
    assert not _prefetch_threads()


def test_exceptions_reach_the_consumer():
    src = Source(10, fail_at=3)
    seen = []
    with pytest.raises(ValueError, match="bad batch 3"):
        for b in Prefetcher(src, "cpu"):
            seen.append(int(b))
    assert seen == [0, 1, 2]
    assert not _prefetch_threads()


def test_early_break_leaves_no_thread():
    src = Source(1000, delay=0.001)
    for i, _ in enumerate(Prefetcher(src, "cpu", depth=2)):
        if i == 2:
            break
    assert not _prefetch_threads()
    assert src.closed  # the producer stopped and closed its source
    assert len(src.produced) < 1000


def test_close_and_context_manager_stop_open_iterations():
    src = Source(1000, delay=0.001)
    with Prefetcher(src, "cpu") as pf:
        it = iter(pf)
        next(it)
        assert _prefetch_threads()
    assert not _prefetch_threads() and src.closed


def test_loading_overlaps_with_compute():
    """A sleep-based producer (30 ms) and consumer (60 ms): with prefetch the next item is being made while this one is used."""
    n, produce, consume = 10, 0.03, 0.06
    src = Source(n, delay=produce)
    used: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    for _ in Prefetcher(src, "cpu", depth=2):
        start = time.perf_counter()
        time.sleep(consume)
        used.append((start, time.perf_counter()))
    total = time.perf_counter() - t0
    assert len(used) == n
    # Overlap by timestamps: item i+1's production started before item i's use ended.
    overlapped = sum(src.produced[i + 1][0] < used[i][1] for i in range(n - 1))
    assert overlapped >= n - 2
    # And the whole run took clearly less than producing and consuming one after the other.
    serial = sum(e - s for s, e in src.produced) + sum(e - s for s, e in used)
    assert total < 0.85 * serial


class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        if i == 5:
            raise OSError("truncated image")
        return torch.full((12, 16, 3), i, dtype=torch.uint8), i


def test_with_workers_skip_failed_and_device_transforms():
    """The pieces together: worker loader that skips a bad sample -> prefetch -> batched augmentation."""
    from torch_tricks.data.transforms import device_augment

    loader = make_loader(Images(), 8, train=False, num_workers=2, skip_failed=True, device="cpu")
    aug = device_augment(8, generator=torch.Generator().manual_seed(0))
    batches = list(Prefetcher(loader, "cpu", transform=aug))
    assert [tuple(x.shape) for x, _ in batches] == [(7, 3, 8, 8), (8, 3, 8, 8), (8, 3, 8, 8)]
    assert sum(len(y) for _, y in batches) == 23 and loader.failed == 1
    assert not _prefetch_threads()


def test_to_device_walks_containers():
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(2), (torch.zeros(1), "label")], "p": Pair(torch.ones(1), 3)}
    out = to_device(batch, "cpu")
    assert out["x"][1][1] == "label" and isinstance(out["p"], Pair) and out["p"].b == 3
    assert torch.equal(out["x"][0], torch.ones(2))


def test_bad_arguments():
    with pytest.raises(UserError):
        Prefetcher(42, "cpu")
    with pytest.raises(UserError):
        Prefetcher([], "cpu", depth=0)
    with pytest.raises(UserError):
        Prefetcher([], "cpu", transform="nope")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA"):
            Prefetcher([], "cuda")


def test_trick_registered():
    assert get_trick("prefetch").ids == ("D5",)


@requires_cuda
def test_cuda_stream_path_matches_and_overlaps():
    ds = TensorDataset(torch.randn(64, 3, 32, 32), torch.arange(64))
    loader = make_loader(ds, 8, train=False, device="cuda")
    expected = [(x.cuda() * 2, y.cuda()) for x, y in loader]
    got = list(Prefetcher(loader, "cuda", transform=lambda b: [b[0] * 2, b[1]]))
    assert len(got) == len(expected)
    for (x, y), (ex, ey) in zip(got, expected):
        assert x.is_cuda and torch.equal(x, ex) and torch.equal(y, ey)


@requires_cuda
def test_cuda_batches_stay_valid_while_the_next_copy_runs():
    ds = TensorDataset(torch.arange(32 * 1024, dtype=torch.float32).view(32, 1024))
    loader = make_loader(ds, 4, train=False, device="cuda")
    for i, (x,) in enumerate(Prefetcher(loader, "cuda")):
        y = (x @ torch.ones(1024, 1024, device="cuda")).sum()  # work on the current stream while i+1 copies
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), ds.tensors[0][4 * i : 4 * i + 4]) and torch.isfinite(y)
