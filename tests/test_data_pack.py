"""Packing and reading (D1, D3, D4, D6, D9): round trips, ImageFolder labels, damage, kills, workers."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from torch_tricks.data import decode as D
from torch_tricks.data.dataset import PackedDataset, collate_packed
from torch_tricks.data.threads import ThreadLoader
from torch_tricks.data.formats import (
    CorruptSampleError,
    NativeWriter,
    PackError,
    is_complete,
    open_reader,
    verify_pack,
)
from torch_tricks.data.pack import pack, read_list_file
from torch_tricks.errors import UserError

FORMATS = ["native", "lmdb"]
IMG_EXT = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def smooth(h: int, w: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    fx, fy, phase = rng.uniform(0.05, 0.3, 3)
    img = np.stack([x * 255 / w, y * 255 / h, 128 + 100 * np.sin(x * fx + y * fy + phase * 10)], -1)
    img = np.roll(img, int(rng.integers(0, 3)), axis=2)
    return (img + rng.normal(0, 3, img.shape)).clip(0, 255).astype(np.uint8)


def save(path: Path, img: np.ndarray, mode: str = "RGB", **kw) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(img).convert(mode).save(path, **kw)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """An ImageFolder tree: 3 classes (sorted order differs from creation and case order), JPEGs,
    a PNG, a grayscale JPEG, an upper-case extension, a nested folder, a non-image file, a
    corrupt file and a truncated JPEG."""
    root = tmp_path_factory.mktemp("tree")
    seed = 0
    for cls in ("dog", "cat", "Bird"):
        for k in range(8):
            seed += 1
            h, w = (48, 64) if k % 3 else (64, 48)
            save(root / cls / f"{k:03d}.jpg", smooth(h, w, seed), quality=92)
    save(root / "cat" / "png_one.png", smooth(40, 52, 99))
    save(root / "cat" / "GRAY.JPG", smooth(50, 60, 98), mode="L", quality=90)
    save(root / "dog" / "nested" / "deep.jpeg", smooth(48, 64, 97), quality=90)
    (root / "dog" / "notes.txt").write_text("not an image, not listed")
    (root / "Bird" / "corrupt.jpg").write_bytes(b"\x00garbage, not a JPEG at all" * 10)
    whole = io.BytesIO()
    Image.fromarray(smooth(48, 64, 96)).save(whole, format="JPEG", quality=90)
    (root / "dog" / "truncated.jpg").write_bytes(whole.getvalue()[:400])
    return root


def imagefolder_samples(root: Path):
    """torchvision's find_classes + make_dataset, written out here to check against."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    samples = []
    for c in sorted(class_to_idx):
        for dirpath, _, fnames in sorted(os.walk(root / c, followlinks=True)):
            for f in sorted(fnames):
                p = os.path.join(dirpath, f)
                if p.lower().endswith(IMG_EXT):
                    samples.append((p, class_to_idx[c]))
    return classes, class_to_idx, samples


BAD = {"Bird/corrupt.jpg", "dog/truncated.jpg"}


def good_samples(root: Path):
    _, _, samples = imagefolder_samples(root)
    return [(p, y) for p, y in samples if os.path.relpath(p, root) not in BAD]


@pytest.fixture(scope="module")
def packs(tree, tmp_path_factory):
    """Packs made once and shared: {(fmt, kind): (path, report)}."""
    base = tmp_path_factory.mktemp("packs")
    out = {}
    for fmt in FORMATS:
        for kind, kw in {
            "raw_fixed": dict(storage="raw", raw_size=32),
            "encoded": dict(storage="encoded"),
            "jpeg": dict(storage="jpeg", resize=24, quality=95),
            "raw_pil": dict(storage="raw", resize=20, decoder="pil"),
        }.items():
            dst = base / f"{fmt}-{kind}"
            out[fmt, kind] = dst, pack(tree, dst, fmt=fmt, progress=False, workers=2 if kind == "encoded" else 0, **kw)
    return out


# ---------------------------------------------------------------------------- labels


def test_class_mapping_and_order_match_imagefolder(tree, packs):
    classes, class_to_idx, _ = imagefolder_samples(tree)
    expected = good_samples(tree)
    assert classes == ["Bird", "cat", "dog"]
    for fmt in FORMATS:
        ds = PackedDataset(packs[fmt, "encoded"][0])
        assert ds.classes == classes and ds.class_to_idx == class_to_idx
        assert ds.targets == [y for _, y in expected]
        assert [ds.name(i) for i in range(len(ds))] == [os.path.relpath(p, tree) for p, _ in expected]
        assert "dog/notes.txt" not in {ds.name(i) for i in range(len(ds))}


def test_corrupt_sources_are_skipped_and_listed(tree, packs):
    for fmt in FORMATS:
        path, report = packs[fmt, "encoded"]
        assert {name for name, _ in report.skipped} == BAD
        assert report.count == len(good_samples(tree)) == len(PackedDataset(path))
        listed = (path / "skipped.txt").read_text().splitlines()
        assert {line.split("\t")[0] for line in listed} == BAD
        assert all(line.split("\t")[1] for line in listed)  # a reason for each


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMATS)
def test_raw_round_trip_is_exact(tree, packs, fmt):
    path, report = packs[fmt, "raw_fixed"]
    ds = PackedDataset(path)
    meta = ds.reader.header["meta"]
    assert ds.shape == (32, 32, 3) and meta["decoder"] == report.decoder
    for i, (src, label) in enumerate(good_samples(tree)):
        data = Path(src).read_bytes()
        want = D.center_crop(
            D.resize_shorter(D.decode(data, min_size=32, decoder=meta["decoder"]), 32, backend=meta["resize_backend"]),
            32,
        )
        img, y = ds[i]
        assert y == label and img.dtype == np.uint8 and np.array_equal(img, want), (i, src)
    images, labels = ds.get_batch([3, 0, 3])
    assert images.shape == (3, 32, 32, 3) and np.array_equal(images[1], ds[0][0]) and labels.dtype == np.int64


@pytest.mark.parametrize("fmt", FORMATS)
def test_raw_round_trip_varying_shapes_is_exact(tree, packs, fmt):
    path, _ = packs[fmt, "raw_pil"]
    ds = PackedDataset(path)
    meta = ds.reader.header["meta"]
    assert ds.shape is None and meta["decoder"] == "pil"
    for i, (src, label) in enumerate(good_samples(tree)):
        want = D.resize_shorter(D.decode(Path(src).read_bytes(), min_size=20, decoder="pil"), 20,
                                backend=meta["resize_backend"])
        img, y = ds[i]
        assert y == label and np.array_equal(img, want), (i, src)
    with pytest.raises(UserError, match="batched reads need a raw pack whose samples share one shape"):
        ds.get_batch([0, 1])
    items = ds.__getitems__([0, 1])  # per-sample fallback
    assert isinstance(items, list) and np.array_equal(items[1][0], ds[1][0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoded_round_trip_within_decoder_tolerance(tree, packs, fmt):
    path, _ = packs[fmt, "encoded"]
    for decoder in D.available_decoders():
        ds = PackedDataset(path, decoder=decoder)
        for i, (src, label) in enumerate(good_samples(tree)):
            want = D.decode(Path(src).read_bytes(), decoder="pil")
            img, y = ds[i]
            assert y == label and img.shape == want.shape
            diff = np.abs(img.astype(np.int16) - want)
            assert diff.max() <= D.DECODER_TOLERANCE_MAX and diff.mean() <= D.DECODER_TOLERANCE_MEAN
    assert bytes(open_reader(path).read(0)) == Path(good_samples(tree)[0][0]).read_bytes()  # the source bytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_jpeg_round_trip_pre_resized(tree, packs, fmt):
    path, report = packs[fmt, "jpeg"]
    meta = PackedDataset(path).reader.header["meta"]
    ref_ds = PackedDataset(path, decoder="pil")
    for decoder in D.available_decoders():
        ds = PackedDataset(path, decoder=decoder)
        for i, (src, label) in enumerate(good_samples(tree)):
            img, y = ds[i]
            assert y == label and min(img.shape[:2]) == 24  # D1: stored pre-resized
            diff = np.abs(img.astype(np.int16) - ref_ds[i][0])  # decoders agree on the stored JPEG
            assert diff.max() <= D.DECODER_TOLERANCE_MAX and diff.mean() <= D.DECODER_TOLERANCE_MEAN
            source = D.resize_shorter(D.decode(Path(src).read_bytes(), min_size=24, decoder=meta["decoder"]), 24,
                                      backend=meta["resize_backend"])
            assert img.shape == source.shape
            # the stored bytes are exactly the resized source encoded once at the chosen quality
            assert bytes(ds.reader.read(i)) == D.encode_jpeg(source, quality=95, crop_ready=True)
            assert np.abs(img.astype(np.int16) - source).mean() < 12  # 4:2:0 JPEG loss on a busy 24-pixel image


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["jpeg", "encoded", "raw_pil", "raw_fixed"])
def test_center_crop_items_equal_cropping_the_decoded_image(packs, fmt, kind, monkeypatch):
    """center_crop= gives torchvision's CenterCrop of each image (padded when the image is smaller); JPEGs
    go through decode_crop (whose bit-identity to decode-then-crop is tested in test_data_decode)."""
    path = packs[fmt, kind][0]
    whole = PackedDataset(path)
    calls = []
    real = D.decode_crop
    monkeypatch.setattr(D, "decode_crop", lambda *a, **k: calls.append(a[1:]) or real(*a, **k))
    for size in (16, (10, 22), 40):
        ds = PackedDataset(path, center_crop=size)
        hw = (size, size) if isinstance(size, int) else size
        for i in range(len(ds)):
            (img, y), (ref, y_ref) = ds[i], whole[i]
            assert y == y_ref and img.shape == (*hw, 3)
            assert np.array_equal(img, D.center_crop(ref, hw)), (size, i)
    assert bool(calls) == (kind in ("jpeg", "encoded"))  # 40 is larger than the images: padded, not cut
    items = PackedDataset(path, center_crop=16).__getitems__([0, 1, 2])  # what DataLoader calls for a batch
    assert all(np.array_equal(x, D.center_crop(whole[i][0], 16)) for i, (x, _) in enumerate(items))
    loader = ThreadLoader(PackedDataset(path, center_crop=16), 5, seed=1)
    x, y = next(iter(loader))
    idx = loader.batches(0)[0]
    assert np.array_equal(x.numpy(), np.stack([D.center_crop(whole[int(i)][0], 16) for i in idx]))
    with pytest.raises(UserError, match="center_crop"):
        PackedDataset(path, center_crop=0)


def test_jpeg_packs_are_crop_ready_unless_told_not(tree, tmp_path):
    plain = pack(tree, tmp_path / "plain", storage="jpeg", resize=24, crop_ready=False, progress=False, workers=0)
    assert plain.count > 0
    assert not D.crop_ready(PackedDataset(tmp_path / "plain").reader.read(0))


def test_crop_ready_without_an_encoder_for_it_is_one_clear_error(tree, tmp_path, monkeypatch):
    def no_restarts(img, quality):
        raise UserError("crop-ready JPEGs need opencv or Pillow >= 10.2 (restart markers): pip install x")

    monkeypatch.setattr(D, "_encode_restarts", no_restarts)
    with pytest.raises(UserError, match="crop-ready JPEGs need opencv"):
        pack(tree, tmp_path / "p", storage="jpeg", resize=24, progress=False, workers=0)
    assert not is_complete(tmp_path / "p")


def test_decode_size_reduces_on_read(packs):
    ds = PackedDataset(packs["native", "encoded"][0], decode_size=12)
    assert min(ds[0][0].shape[:2]) == 12  # a 48x64 JPEG decoded at 1/4


# ---------------------------------------------------------------------------- damage and kills


def test_checksum_catches_a_damaged_shard(packs, tmp_path):
    import shutil

    src, _ = packs["native", "raw_fixed"]
    path = tmp_path / "damaged"
    shutil.copytree(src, path)
    rec = np.load(path / "index.npy")[5]
    shard = path / f"shard-{int(rec['shard']):05d}.bin"
    with open(shard, "r+b") as f:
        f.seek(int(rec["offset"]) + 100)
        f.write(b"\xde\xad\xbe\xef")
    ds = PackedDataset(path)
    ds[4], ds[6]  # neighbours are fine
    with pytest.raises(CorruptSampleError, match=r"sample 5 \(.*\) in shard-00000\.bin") as exc:
        ds[5]
    assert "crc32" in str(exc.value)
    with pytest.raises(CorruptSampleError, match="sample 5"):
        ds.get_batch([4, 5])
    with pytest.raises(PackError, match="sample 5"):
        verify_pack(path)
    assert PackedDataset(path, verify=False)[5][0].shape == (32, 32, 3)  # verify=False reads it as it is
    with open(shard, "ab") as f:  # a shard of the wrong size is refused at open
        f.write(b"x")
    with pytest.raises(PackError, match="bytes, the header says"):
        PackedDataset(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_once_checks_each_sample_on_first_read_only(packs, tmp_path, fmt, monkeypatch):
    import zlib

    from torch_tricks.data import formats

    calls = []
    monkeypatch.setattr(formats, "zlib", type("Z", (), {"crc32": staticmethod(lambda b: calls.append(1) or zlib.crc32(b))}))
    ds = PackedDataset(packs[fmt, "raw_fixed"][0], verify="once")
    first = ds.get_batch([0, 1, 2])[0]
    n = len(calls)
    assert n >= 3
    again = ds.get_batch([2, 1, 0])[0]
    assert len(calls) == n and np.array_equal(again[::-1], first)  # no second check, same bytes
    ds[3]
    assert len(calls) > n  # a new sample is checked
    with pytest.raises(UserError, match="verify must be"):
        PackedDataset(packs[fmt, "raw_fixed"][0], verify="sometimes")


def test_verify_once_still_catches_damage_on_first_read(packs, tmp_path):
    import shutil

    path = tmp_path / "damaged-once"
    shutil.copytree(packs["native", "raw_fixed"][0], path)
    rec = np.load(path / "index.npy")[5]
    with open(path / f"shard-{int(rec['shard']):05d}.bin", "r+b") as f:
        f.seek(int(rec["offset"]) + 7)
        f.write(b"\x00\xff\x00\xff")
    ds = PackedDataset(path, verify="once")
    ds[4]
    with pytest.raises(CorruptSampleError, match="sample 5"):
        ds[5]
    with pytest.raises(CorruptSampleError, match="sample 5"):  # a failed check is not remembered as passed
        ds[5]


def test_checksum_catches_damage_in_lmdb(packs, tmp_path):
    import shutil

    src, _ = packs["lmdb", "raw_fixed"]
    path = tmp_path / "damaged.lmdb"
    shutil.copytree(src, path)
    payload = bytes(open_reader(src).read(7))
    blob = bytearray((path / "data.mdb").read_bytes())
    at = blob.find(payload)
    assert at > 0
    blob[at + 50 : at + 54] = b"\xde\xad\xbe\xef"
    (path / "data.mdb").write_bytes(bytes(blob))
    ds = PackedDataset(path)
    ds[6]
    with pytest.raises(CorruptSampleError, match=r"sample 7 .*data\.mdb fails its crc32"):
        ds[7]


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch_tricks.data.pack as P
    real = P._one
    def slow(ref, label):  # a few ms a sample, so the kill lands mid-pack whatever the machine load
        time.sleep(0.005)
        return real(ref, label)
    P._one = slow
    P.pack(sys.argv[1], sys.argv[2], fmt=sys.argv[3], storage="jpeg", resize=24, workers=int(sys.argv[4]),
           progress=False, commit_every=20, shard_bytes=20_000)  # many shards: resume truncates the last
    """
)


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big")
    for k in range(300):
        save(root / f"c{k % 3}" / f"{k:04d}.jpg", smooth(24 + k % 8, 32, k), quality=85)
    return root


def _progress_count(dst: Path, fmt: str) -> int:
    try:
        if fmt == "native":
            return json.loads((dst / "progress.json").read_text())["count"]
        import lmdb

        env = lmdb.open(str(dst), readonly=True, lock=False, max_dbs=4)
        try:
            with env.begin(db=env.open_db(b"meta", create=False)) as txn:
                return json.loads(bytes(txn.get(b"progress")))["count"]
        finally:
            env.close()
    except Exception:
        return -1


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are dead
    except OSError:
        return False


@pytest.mark.parametrize("fmt,workers", [("native", 2), ("lmdb", 0)])
def test_killed_pack_never_reads_as_complete_and_resumes(big_tree, tmp_path, fmt, workers):
    dst = tmp_path / f"killed-{fmt}"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(big_tree), str(dst), fmt, str(workers)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while _progress_count(dst, fmt) < 40:  # a couple of commits in
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "pack never got going"
            time.sleep(0.005)
        children = _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the parent only: its pool workers must follow it
    finally:
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the pack finished before it was killed"
    assert len(children) == workers, children
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children):
        assert time.monotonic() < deadline, "pack workers outlived the killed pack"
        time.sleep(0.05)
    assert not is_complete(dst)
    with pytest.raises(PackError, match="incomplete"):
        PackedDataset(dst)

    report = pack(big_tree, dst, fmt=fmt, storage="jpeg", resize=24, workers=0, progress=False, shard_bytes=20_000)
    assert 40 <= report.resumed_from < 300 and report.count == 300 and is_complete(dst)
    if fmt == "native":
        assert len(list(dst.glob("shard-*.bin"))) > 5
    fresh = pack(big_tree, tmp_path / "fresh", fmt=fmt, storage="jpeg", resize=24, workers=0, progress=False)
    a, b = open_reader(dst), open_reader(tmp_path / "fresh")
    assert np.array_equal(a.index[["label", "crc32", "length", "height", "width"]],
                          b.index[["label", "crc32", "length", "height", "width"]])
    assert fresh.count == 300 and verify_pack(dst)["count"] == 300


def test_unfinished_writer_leaves_an_incomplete_pack(tmp_path):
    w = NativeWriter(tmp_path / "p", storage="raw")
    w.add(np.zeros(12, np.uint8), 0, (2, 2, 3), "a")
    w.commit(1)
    w.close()
    assert not is_complete(tmp_path / "p")
    with pytest.raises(PackError, match="incomplete pack .*after 1 samples"):
        PackedDataset(tmp_path / "p")


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("fmt", FORMATS)
def test_dataloader_two_workers_sees_every_sample_once(packs, fmt):
    path, _ = packs[fmt, "raw_fixed"]
    ds = PackedDataset(path)
    ds[0]  # the main process has its files open before the workers fork: they must open their own
    want = Counter((ds[i][0].tobytes(), ds[i][1]) for i in range(len(ds)))
    for collate in (collate_packed, None):
        loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, collate_fn=collate,
                            generator=torch.Generator().manual_seed(0))
        got = Counter()
        for images, labels in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (32, 32, 3) and labels.dtype == torch.int64
            got.update((img.numpy().tobytes(), int(y)) for img, y in zip(images, labels))
        assert got == want


@pytest.mark.parametrize("fmt", FORMATS)
def test_dataloader_two_workers_decoded_packs(packs, fmt):
    path, _ = packs[fmt, "jpeg"]
    ds = PackedDataset(path, transform=lambda a: torch.from_numpy(a).float().mean())
    want = sorted(float(ds[i][0]) for i in range(len(ds)))
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate_packed)
    got = sorted(float(v) for means, _ in loader for v in means)
    assert got == pytest.approx(want)


def test_ram_cache_stays_within_budget_and_reads_the_same(packs):
    path, _ = packs["native", "raw_fixed"]
    plain = PackedDataset(path)
    budget = 10 * 32 * 32 * 3 + 100
    cached = PackedDataset(path, cache_bytes=budget)
    info = cached.cache_info()
    assert info["samples"] == 10 and info["bytes"] <= budget
    for i in range(len(plain)):
        assert np.array_equal(cached[i][0], plain[i][0])
    assert np.array_equal(cached.get_batch(range(len(plain)))[0], plain.get_batch(range(len(plain)))[0])
    loader = DataLoader(cached, batch_size=8, num_workers=2, collate_fn=collate_packed)
    assert sum(len(y) for _, y in loader) == len(plain)


def test_ram_cache_is_not_pickled_into_spawned_workers(packs):
    import pickle

    path, _ = packs["native", "raw_fixed"]
    budget = 5 * 32 * 32 * 3
    ds = PackedDataset(path, cache_bytes=budget)
    assert ds.cache_info()["samples"] == 5
    clone = pickle.loads(pickle.dumps(ds))  # what a spawn / forkserver worker receives
    assert clone.cache_info()["samples"] == 0 and len(pickle.dumps(ds)) < budget
    for i in range(len(clone)):
        assert np.array_equal(clone[i][0], ds[i][0])
    assert clone.cache_info()["samples"] == 5 and clone.cache_info()["bytes"] <= budget  # its own share


def test_labels_only_never_touches_sample_bytes(packs, tmp_path):
    import shutil

    path = tmp_path / "labels"
    shutil.copytree(packs["native", "encoded"][0], path)
    ds = PackedDataset(path, labels_only=True)
    for shard in path.glob("shard-*.bin"):
        shard.write_bytes(b"")  # the sample bytes are gone; labels still come from the index
    assert ds.targets == PackedDataset(packs["native", "encoded"][0]).targets
    assert ds[3] == ds.targets[3]
    assert next(iter(DataLoader(ds, batch_size=4))).tolist() == ds.targets[:4]


# ---------------------------------------------------------------------------- other sources and options


class ArrayDataset(torch.utils.data.Dataset):
    classes = ["a", "b", "c"]

    def __init__(self):
        self.images = [smooth(20 + i, 30, i) for i in range(9)]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = self.images[i]
        if i % 3 == 1:
            img = Image.fromarray(img)
        elif i % 3 == 2:
            out = io.BytesIO()
            Image.fromarray(img).save(out, format="PNG")
            img = out.getvalue()
        return img, i % 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_a_map_style_dataset(tmp_path, fmt):
    src = ArrayDataset()
    report = pack(src, tmp_path / "ds", fmt=fmt, storage="raw", workers=2, progress=False)
    ds = PackedDataset(tmp_path / "ds")
    assert report.count == 9 and ds.classes == ["a", "b", "c"] and ds.shape is None
    for i in range(9):
        img, y = ds[i]
        assert y == i % 3 and np.array_equal(img, src.images[i])
    out = ds.__getitems__([0, 1])  # varying shapes: per-sample items
    assert isinstance(out, list) and np.array_equal(out[1][0], src.images[1])


def test_pack_a_list_file(tree, tmp_path):
    _, _, samples = imagefolder_samples(tree)
    listing = tree.parent / "list.txt"
    lines = ["# path label"] + [f"{os.path.relpath(p, tree.parent)} {y}" for p, y in samples[:6]]
    listing.write_text("\n".join(lines) + "\n")
    report = pack(listing, tmp_path / "l", storage="encoded", workers=0, progress=False)
    ds = PackedDataset(tmp_path / "l")
    assert ds.targets == [y for _, y in samples[:6]] and report.classes == ["0"]
    names = tmp_path / "names.txt"
    names.write_text("x/a.jpg,cat\ny/b.jpg,Bird\n")
    assert read_list_file(names) == (["Bird", "cat"], [(str(tmp_path / "x/a.jpg"), 1), (str(tmp_path / "y/b.jpg"), 0)])


def test_bad_options_and_destinations(tree, packs, tmp_path):
    with pytest.raises(UserError, match="resize re-encodes"):
        pack(tree, tmp_path / "x", storage="encoded", resize=32, progress=False)
    with pytest.raises(UserError, match="raw_size is for storage='raw'"):
        pack(tree, tmp_path / "x", storage="jpeg", raw_size=32, progress=False)
    with pytest.raises(UserError, match="unknown pack format"):
        pack(tree, tmp_path / "x", fmt="hdf5", progress=False)
    with pytest.raises(UserError, match="already holds a complete pack"):
        pack(tree, packs["native", "encoded"][0], progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="not part of a pack"):
        pack(tree, tmp_path / "busy", progress=False)
    with pytest.raises(PackError, match="not a pack"):
        PackedDataset(tmp_path / "busy")
    with pytest.raises(UserError, match="does not exist"):
        pack(tmp_path / "nowhere", tmp_path / "y", progress=False)


def test_tricks_are_registered():
    from torch_tricks.registry import _TRICKS

    assert {"pack", "packed_dataset", "fast_decode"} <= set(_TRICKS)
    assert set(_TRICKS["pack"].ids) == {"D1", "D3", "D4"}


def test_pillow_alone_packs_and_reads(tree, tmp_path, monkeypatch):
    real = D._load
    monkeypatch.setattr(D, "_load", lambda name: real(name) if name == "pil" else None)
    report = pack(tree, tmp_path / "p", storage="jpeg", resize=20, workers=0, progress=False)
    assert report.decoder == "pil" and report.options["resize_backend"] == "pil"
    ds = PackedDataset(tmp_path / "p")
    assert min(ds[0][0].shape[:2]) == 20 and len(ds) == report.count


def test_missing_lmdb_is_a_clear_error(tree, packs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lmdb", None)  # import lmdb now raises ImportError
    with pytest.raises(UserError, match=r"needs lmdb: pip install \"torch-tricks\[data\]\""):
        pack(tree, tmp_path / "l", fmt="lmdb", progress=False)
    with pytest.raises(UserError, match=r"needs lmdb: pip install \"torch-tricks\[data\]\""):
        PackedDataset(packs["lmdb", "encoded"][0])


def test_lmdb_view_gives_each_samples_bytes_from_any_thread(packs):
    """LMDBReader.view (no copy, one transaction per thread) returns the bytes read() returns, in every
    thread that asks, and still checks the crc."""
    from concurrent.futures import ThreadPoolExecutor

    src, _ = packs["lmdb", "raw_fixed"]
    reader = open_reader(src)
    n = len(reader)
    want = [bytes(reader.read(i)) for i in range(n)]
    assert [bytes(reader.view(i)) for i in range(n)] == want
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda i: bytes(reader.view(i)), range(n)))
    assert got == want


# ---------------------------------------------------------------------------- the report's text


def test_the_cli_prints_the_reports_own_text(tree, tmp_path, monkeypatch, capsys):
    """``torch-tricks pack`` prints PackReport.to_text() (and --json its to_dict()): Python users get the same text."""
    import torch_tricks.data.pack as P
    from torch_tricks.cli import main

    real, reports = P.pack, []
    monkeypatch.setattr(P, "pack", lambda *a, **k: reports.append(real(*a, **k)) or reports[-1])
    args = ["pack", str(tree), str(tmp_path / "p"), "--resize", "24", "--workers", "0", "--no-progress"]
    assert main(args) == 0
    report = reports[-1]
    text = report.to_text()
    assert capsys.readouterr().out == text + "\n"
    assert text.startswith(f"packed {report.count} samples (3 classes) into {tmp_path / 'p'}: native, jpeg, ")
    assert f"\nskipped 2 unreadable source(s):\n  {report.skipped[0][0]}: " in text
    assert main([*args, "--overwrite", "--json"]) == 0
    assert capsys.readouterr().out == json.dumps(reports[-1].to_dict(), indent=2, default=str) + "\n"


def test_pack_report_text_says_a_resume_and_nothing_skipped():
    from torch_tricks.data.pack import PackReport

    report = PackReport(path="/d", fmt="lmdb", storage="raw", count=1234567, skipped=[], bytes=3 << 30, seconds=61.25,
                        classes=["a", "b", "c"], resumed_from=1000)
    assert report.to_text() == ("packed 1,234,567 samples (3 classes) into /d: lmdb, raw, 3.0 GiB on disk, 61.2 s, "
                                "resumed after 1,000")
