"""Pack once, read many times faster: image loading speed of every storage mode, next to the peers.

Claim (issue 4): on an ImageNet-like JPEG folder, reading our pack of pre-resized JPEGs
(shorter side 256) with :class:`~torch_tricks.data.ThreadLoader` gives >= 3x the images/s of
a hand-written PIL ImageFolder loader, >= 85% of what the same decoder does in a plain loop
from RAM on all cores, and more than WebDataset and FFCV reading the same images; raw uint8
storage, read a whole batch at a time, gives >= 10x the baseline and more than FFCV's raw mode.

What is measured: images/s for one output, shuffled 224x224 uint8 HWC batches of 64
from 2 loader workers (DataLoader processes; threads for ThreadLoader and FFCV), after warm-up, for

* ``PIL baseline``: ImageFolder-style: open, convert("RGB"), resize the shorter side to
  256 (bilinear), center-crop 224, to a uint8 tensor (torchvision's eval transform, by hand);
* ``ours: encoded``: the original JPEG bytes in our native pack, decoded with the
  fastest decoder and reduce-on-decode (``decode_size=256``), resized and cropped as above;
* ``ours: jpeg256 lmdb`` / ``ours: jpeg256 native``: JPEGs pre-resized to shorter side 256
  at packing time (quality 90, crop-ready: a restart marker after every MCU); reading is the
  center 224 crop (``center_crop=224``), decoded from only the MCUs it covers (bit-identical
  to decoding whole, tested); ``..., whole decode`` decodes the whole image and crops it;
* every JPEG row of ours decodes with libjpeg-turbo's fast IDCT, as FFCV always does (its
  pixels are bit-identical to ours then); ``..., accurate IDCT`` shows the default;
* ``ours: raw224 native``: decoded uint8 pixels stored at 224x224 (``raw_size=224``),
  read a whole batch at a time (``__getitems__`` + ``collate_packed``), no decode at all;
  ``ours: raw224, 0 workers`` reads the same batches in the main process, and ``..., no crc``
  also with ``verify=False`` (no per-sample crc32, as FFCV);
* ``..., threads`` rows: the same packs read by ThreadLoader, ``--workers`` threads of this
  process decoding (or copying) straight into the batch buffer, as FFCV's threads do;
  every ``ours`` row checks each sample's crc32 the first time its process reads it
  (``PackedDataset``'s default ``verify="once"``); the ThreadLoader rows have read every
  sample once before timing, as in a second epoch (``epoch 2+``; FFCV never checks), and
  ``verify every read`` checks on every read;
* ``WebDataset jpeg256``: the very same JPEG bytes in tar shards, decoded whole by the same
  decoder and cropped (as its users do), shuffle buffer, batched in the workers;
* ``FFCV jpeg256`` / ``FFCV raw224``: the same pixels written by FFCV's own writer
  (its JPEG at quality 90, its raw mode) and read with its center-crop / simple decoder;
* ceilings, not loaders: ``decode+crop`` is the jpeg256 bytes' center crop decoded by the
  same decoder the same way (from the MCUs it covers, fast IDCT) into one reused row, in a
  plain loop from RAM on 2 processes: the per-image work with zero loading overhead;
  ``decode+resize+crop`` is the same for the original bytes (the encoded rows' ceiling);
  ``memcpy`` copies one batch's bytes on one thread.

The targets are for the way the README reads a pack, ThreadLoader; the DataLoader-worker
rows and the variants are there to compare. ThreadLoader and FFCV both run epochs: their
rows time the steady state within an epoch (each epoch's first ``--warmup`` batches untimed,
over as many epochs as it takes), as on a data set far larger than this one, where starting
an epoch is rare; one loader of each serves all rounds, as one serves all epochs of a
training run. Raw rows time ``RAW_BATCH_FACTOR`` times more batches (30 raw batches last
~25 ms). The process runs with glibc's malloc trim threshold raised, as ThreadLoader sets
it (see :func:`~torch_tricks.data.threads.keep_freed_heap`), from the start, so that every
candidate (FFCV's threads, DataLoader workers, the ceilings' processes) runs under it alike.

Candidates run in the same process, interleaved over ``--repeats`` rounds (each round
measures every candidate once, in forward order on even rounds and reversed on odd ones,
so linear drift hits all alike); the table shows each median and the spread of the
rounds, and every ratio is the median of the ratios measured within one round. Other
load on a shared machine moves wall-clock img/s a lot, so the table also gives the CPU
time per image of every process and thread involved (loader workers, FFCV's threads,
the ceiling's processes), and the targets repeat each comparison in those terms.

Before any target is judged the run checks its own baselines (issue 16, ``benchmarks/_trust.py``),
and a target whose check fails is UNRELIABLE, not PASS or FAIL (the check is named):
``ours: jpeg256 native, threads (A/A)`` is the headline row measured twice (a second loader
over the same pack, one more interleaved candidate), and the two must agree within
:data:`AA_NOISE`; ``ceiling: decode+crop, 1 process`` is the ceiling on one process, which
the ceiling on ``--workers`` processes must not be slower than; and other processes may
use at most a quarter of a core on average while a candidate runs (``/proc/stat`` less this
process tree's CPU time, workers and threads included), in every round of both sides of a
target.

Packing (and the peers' writing) is timed on its own, once, when the pack is made; packs
and the generated images are cached under ``--cache-dir`` keyed by their parameters, so
reruns skip that work (``--repack`` redoes the packs and the peers' files).

    bash benchmarks/setup_peers.sh            # WebDataset + FFCV (once; apt + pip)
    python benchmarks/data_loading.py         # ~3200 images, 3 rounds
    python benchmarks/data_loading.py --images 640 --batches 5 --repeats 1 --skip-peers
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_trust.py, when imported from elsewhere
from _trust import UNRELIABLE, ForeignLoad, LoadMonitor, aa_check, load_check, rules_text  # noqa: E402
from _trust import thread_check, verdict, why  # noqa: E402

from torch_tricks._format import human_bytes, table
from torch_tricks.data import PackedDataset, ThreadLoader, collate_packed, make_loader, pack_images
from torch_tricks.data import decode as dec
from torch_tricks.data.formats import is_complete, open_reader
from torch_tricks.data.threads import keep_freed_heap

BATCH = 64
SHORT = 256  # resize the shorter side to this (offline for the packs, online for the baseline)
CROP = 224  # the output: CROP x CROP uint8 HWC
QUALITY = 90  # JPEG quality of the generated images and of every re-encoded pack
FAST_DCT = True  # decode with libjpeg-turbo's fast IDCT, as FFCV does (one row also shows the accurate one)
GEN_VERSION = 1  # bump when the generator changes: the cache key includes it
CLASSES = 10

RAW_BATCH_FACTOR = 10  # raw rows time this many times --batches
TARGET_VS_BASELINE_JPEG = 3.0
TARGET_VS_CEILING_JPEG = 0.85
TARGET_VS_BASELINE_RAW = 10.0
AA_NOISE = 0.05  # the A/A pair (the headline row measured twice) must agree within this (issue 16)

BASELINE = "PIL baseline"
ENCODED = "ours: encoded"
LMDB = "ours: jpeg256 lmdb"
NATIVE = "ours: jpeg256 native"
RAW = "ours: raw224 native"
RAW_MAIN = "ours: raw224, 0 workers"
RAW_MAIN_NV = "ours: raw224, 0 workers, no crc"
ENCODED_T = "ours: encoded, threads"
LMDB_T = "ours: jpeg256 lmdb, threads"
NATIVE_T = "ours: jpeg256 native, threads"
NATIVE_T_ACC = "ours: jpeg256 native, threads, accurate IDCT"
NATIVE_T_WHOLE = "ours: jpeg256 native, threads, whole decode"
NATIVE_T_AA = "ours: jpeg256 native, threads (A/A)"  # the same again: the A/A pair of the baseline checks
RAW_T = "ours: raw224 native, threads, epoch 2+"
RAW_T1 = "ours: raw224 native, threads, verify every read"
WDS = "WebDataset jpeg256"
FFCV_JPEG = "FFCV jpeg256"
FFCV_RAW = "FFCV raw224"
CEIL_JPEG = "ceiling: decode+crop"
CEIL_ENC = "ceiling: decode+resize+crop"
CEIL_COPY = "ceiling: memcpy, 1 thread"
CEIL_JPEG_1 = "ceiling: decode+crop, 1 process"  # the threads check: the ceiling on --workers must beat it

#: which ceiling each candidate is compared with (same decoder, same per-image work)
SAME_WORK_CEILING = {
    ENCODED: CEIL_ENC, LMDB: CEIL_JPEG, NATIVE: CEIL_JPEG, WDS: CEIL_JPEG,
    ENCODED_T: CEIL_ENC, LMDB_T: CEIL_JPEG, NATIVE_T: CEIL_JPEG, NATIVE_T_ACC: CEIL_JPEG, NATIVE_T_WHOLE: CEIL_JPEG,
    NATIVE_T_AA: CEIL_JPEG,
    RAW_T: CEIL_COPY, RAW_T1: CEIL_COPY,
    FFCV_JPEG: CEIL_JPEG, RAW: CEIL_COPY, RAW_MAIN: CEIL_COPY, RAW_MAIN_NV: CEIL_COPY, FFCV_RAW: CEIL_COPY,
}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:  # one image at a time per process: opencv's own thread pool only oversubscribes 2 cores
        import cv2

        cv2.setNumThreads(1)  # forked loader workers and ceiling processes inherit it
    except ImportError:
        pass
    torch.set_num_threads(1)
    # what ThreadLoader does when it starts, done here first so that every candidate runs under it alike
    # (FFCV's threads, forked DataLoader workers and ceiling processes included)
    keep_freed_heap()
    cache = Path(args.cache_dir or Path(tempfile.gettempdir()) / "torch-tricks-bench" / "data_loading")
    root = cache / f"images-n{args.images}-seed{args.seed}-v{GEN_VERSION}"
    decoder = dec.fastest_decoder()
    print(f"data: {args.images} JPEGs in {CLASSES} classes under {root}; decoder {decoder}; "
          f"{args.workers} workers, batch {BATCH}, output {CROP}x{CROP} uint8; "
          f"{args.warmup} warm-up + {args.batches} timed batches x {args.repeats} rounds; "
          f"{len(os.sched_getaffinity(0))} usable cores; torch {torch.__version__}", flush=True)
    gen = generate_images(root, args.images, args.seed, args.workers)

    packs = make_packs(root, args)
    peers = make_peers(root, packs, args)
    data_info = {"root": str(root), **gen}

    candidates = build_candidates(root, packs, peers, args)
    ceilings = build_ceilings(root, packs, args)
    if args.only:
        keep = [k.strip().lower() for k in args.only.split(",") if k.strip()]
        candidates = {n: f for n, f in candidates.items() if any(k in n.lower() for k in keep)}
        ceilings = {n: f for n, f in ceilings.items() if any(k in n.lower() for k in keep)}
    _warm_page_cache([root, *(p["path"] for p in packs.values()),
                      *(p["path"] for p in peers.values() if p.get("path"))])

    runs = {**candidates, **ceilings}
    rates: dict[str, list[float | None]] = {name: [] for name in runs}
    cpu: dict[str, list[float | None]] = {name: [] for name in runs}
    loads: dict[str, list[ForeignLoad]] = {name: [] for name in runs}  # foreign load while each ran
    errors: dict[str, str] = {}
    from tqdm.auto import tqdm

    with tqdm(total=args.repeats * len(runs), desc="measure", unit="run", dynamic_ncols=True, file=sys.stderr) as bar:
        for r in range(args.repeats):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]  # ABBA: linear drift hits all alike
            for name in order:
                bar.set_postfix_str(f"round {r + 1}: {name}", refresh=True)
                rate = ms = None
                if name not in errors:
                    try:
                        with LoadMonitor() as window:
                            rate, ms = runs[name]()
                        loads[name].append(window.load)
                    except Exception as exc:  # a peer that breaks must not take the benchmark down
                        errors[name] = _why(exc)
                        if args.verbose:
                            traceback.print_exc()
                rates[name].append(rate)
                cpu[name].append(ms)
                bar.update(1)
    for name, reason in errors.items():
        print(f"{name}: failed: {reason}", file=sys.stderr)

    summary = summarize(rates, cpu, errors, packs, peers, data_info, args, decoder, loads)
    print_report(summary)
    print("\nJSON summary:")
    print(json.dumps(summary, indent=1))
    if args.png:
        plot(summary, args.png)
        print(f"\nplot written to {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


# --------------------------------------------------------------------------- the data set


def synth_image(i: int, seed: int) -> np.ndarray:
    """Image ``i``: smooth multi-scale colour fields, a few anti-aliased shapes, sensor-like noise.

    ~500x375 on average (landscape mostly, some portrait and square), JPEG ~100 KB at
    quality 90 with 4:2:0: close to ImageNet's per-image size, so decode costs are realistic.
    """
    import cv2

    rng = np.random.default_rng([seed, i])
    long = int(rng.integers(420, 600))
    ratio = float(rng.choice([4 / 3, 4 / 3, 4 / 3, 3 / 2, 1.0, 16 / 9, 5 / 4]))
    short = int(round(long / ratio))
    h, w = (short, long) if rng.random() < 0.8 else (long, short)
    img = np.zeros((h, w, 3), np.float32)
    for cells, amp in ((3, 90.0), (8, 40.0), (24, 18.0)):
        grid = rng.normal(0, 1, (cells, max(2, cells * w // h), 3)).astype(np.float32)
        img += amp * cv2.resize(grid, (w, h), interpolation=cv2.INTER_CUBIC)
    img += rng.uniform(60, 190, 3).astype(np.float32)
    for _ in range(int(rng.integers(3, 9))):
        color = tuple(float(c) for c in rng.uniform(0, 255, 3))
        centre = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        if rng.random() < 0.5:
            axes = (int(rng.integers(10, w // 3)), int(rng.integers(10, h // 3)))
            cv2.ellipse(img, centre, axes, float(rng.uniform(0, 180)), 0, 360, color, -1, cv2.LINE_AA)
        else:
            pts = rng.integers(0, [w, h], (int(rng.integers(3, 6)), 2)).astype(np.int32)
            cv2.fillPoly(img, [pts], color, cv2.LINE_AA)
    img = cv2.GaussianBlur(img, (0, 0), 1.2)
    noise = cv2.GaussianBlur(rng.normal(0, 1, (h, w, 3)).astype(np.float32), (0, 0), 0.45)
    noise += 0.5 * cv2.resize(rng.normal(0, 1, (h // 2, w // 2, 3)).astype(np.float32), (w, h))
    img += float(rng.uniform(20, 32)) * noise
    return np.clip(img, 0, 255).astype(np.uint8)


def _write_one(job: tuple[int, int, str]) -> tuple[int, int, int]:
    i, seed, path = job
    img = synth_image(i, seed)
    data = dec.encode_jpeg(img, QUALITY)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data), img.shape[0], img.shape[1]


def generate_images(root: Path, n: int, seed: int, workers: int) -> dict[str, Any]:
    """An ImageFolder tree ``root/class_XX/img_NNNNNN.jpg``, made once (``done.json`` marks it complete)."""
    marker = root / "done.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    from tqdm.auto import tqdm

    jobs = []
    for i in range(n):
        d = root / f"class_{i % CLASSES:02d}"
        d.mkdir(parents=True, exist_ok=True)
        jobs.append((i, seed, str(d / f"img_{i:06d}.jpg")))
    t0 = time.perf_counter()
    sizes, dims = [], []
    with mp.get_context("fork").Pool(max(1, workers)) as pool:
        for nbytes, h, w in tqdm(pool.imap(_write_one, jobs, chunksize=16), total=n, desc="generate", unit="img",
                                 dynamic_ncols=True, file=sys.stderr):
            sizes.append(nbytes)
            dims.append((h, w))
    info = {
        "images": n, "classes": CLASSES, "seed": seed, "generator_version": GEN_VERSION, "quality": QUALITY,
        "bytes": int(sum(sizes)), "mean_kb": round(float(np.mean(sizes)) / 1e3, 1),
        "mean_hw": [round(float(v)) for v in np.mean(dims, axis=0)],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    marker.write_text(json.dumps(info))
    return info


# --------------------------------------------------------------------------- packing (ours)


PACKS = {  # name -> pack() arguments
    "encoded": dict(fmt="native", storage="encoded"),
    "jpeg256-lmdb": dict(fmt="lmdb", storage="jpeg", resize=SHORT, quality=QUALITY, crop_ready=True),
    "jpeg256-native": dict(fmt="native", storage="jpeg", resize=SHORT, quality=QUALITY, crop_ready=True),
    "raw224-native": dict(fmt="native", storage="raw", raw_size=CROP),
}


def make_packs(root: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Pack the folder in every mode (or reuse the cached packs); timings from when each was made."""
    out = {}
    for name, kw in PACKS.items():
        dst = root.parent / f"{root.name}-pack-{name}"
        stamp = root.parent / f"{root.name}-pack-{name}.json"  # beside the pack: a pack dir holds only its files
        cached = json.loads(stamp.read_text()) if stamp.is_file() else None
        if not args.repack and cached is not None and cached.get("kw") == kw and is_complete(dst):
            info = cached
            info["cached"] = True
        else:
            if dst.exists():
                shutil.rmtree(dst)
            rep = pack_images(root, dst, workers=args.workers, progress=True, **kw)
            if rep.skipped:
                raise RuntimeError(f"packing {name} skipped {len(rep.skipped)} images: {rep.skipped[:3]}")
            info = {"path": str(dst), "seconds": round(rep.seconds, 2), "bytes": rep.bytes, "count": rep.count,
                    "what": _pack_what(kw), "workers": args.workers, "kw": kw}
            stamp.write_text(json.dumps(info))
            info["cached"] = False
        out[name] = info
    return out


def _pack_what(kw: dict[str, Any]) -> str:
    if kw["storage"] == "encoded":
        return f"{kw['fmt']}: original JPEG bytes"
    if kw["storage"] == "jpeg":
        ready = ", crop-ready" if kw.get("crop_ready") else ""
        return f"{kw['fmt']}: JPEG q{kw['quality']}, shorter side {kw['resize']}{ready}"
    return f"{kw['fmt']}: raw uint8 {kw['raw_size']}x{kw['raw_size']}"


# --------------------------------------------------------------------------- the peers' formats


class _PeerSource:
    """Items for a peer's writer, made from the originals with our own functions (identical pixels)."""

    def __init__(self, files: list[tuple[str, int]], mode: str) -> None:
        self.files, self.mode = files, mode

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        path, label = self.files[i]
        with open(path, "rb") as f:
            data = f.read()
        if self.mode == "jpeg256":
            img = dec.resize_shorter(dec.decode(data, min_size=SHORT), SHORT)
        else:  # raw224: what pack(storage="raw", raw_size=224) stores
            img = dec.center_crop(dec.resize_shorter(dec.decode(data, min_size=CROP), CROP), CROP)
        return img, label


def _folder_files(root: Path) -> list[tuple[str, int]]:
    """``(path, label)`` for the ImageFolder tree, sorted as ImageFolder does (hand-written)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    files = []
    for label, c in enumerate(classes):
        for fname in sorted(os.listdir(root / c)):
            if fname.lower().endswith((".jpg", ".jpeg")):
                files.append((str(root / c / fname), label))
    return files


def make_peers(root: Path, packs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Write the WebDataset shards and the FFCV files (cached); a missing peer is reported, not fatal."""
    out: dict[str, dict[str, Any]] = {}
    if args.skip_peers:
        for name in (WDS, FFCV_JPEG, FFCV_RAW):
            out[name] = {"missing": "skipped (--skip-peers)"}
        return out
    try:
        import webdataset  # noqa: F401

        out[WDS] = _cached(root, "wds-jpeg256-cr", lambda dst: _write_wds(dst, packs["jpeg256-native"]["path"]),
                           args.repack, "tar shards of our jpeg256 pack's bytes (no re-encode)")
    except Exception as exc:
        out[WDS] = {"missing": _why(exc)}
    try:
        import ffcv  # noqa: F401
    except Exception as exc:
        out[FFCV_JPEG] = out[FFCV_RAW] = {"missing": _why(exc) + " (install: bash benchmarks/setup_peers.sh)"}
        return out
    files = _folder_files(root)
    for name, mode, what in ((FFCV_JPEG, "jpeg256", f"FFCV writer, JPEG q{QUALITY}, shorter side {SHORT}"),
                             (FFCV_RAW, "raw224", f"FFCV writer, raw uint8 {CROP}x{CROP}")):
        try:
            out[name] = _cached(root, f"ffcv-{mode}", functools.partial(_write_ffcv, files=files, mode=mode,
                                                                        workers=args.workers), args.repack, what)
        except Exception as exc:
            out[name] = {"missing": _why(exc)}
    return out


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _cached(root: Path, name: str, write: Callable[[Path], None], repack: bool, what: str) -> dict[str, Any]:
    dst = root.parent / f"{root.name}-{name}"
    stamp = root.parent / f"{root.name}-{name}.json"
    if not repack and stamp.is_file() and dst.exists():
        info = json.loads(stamp.read_text())
        info["cached"] = True
        return info
    if dst.exists():
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
    tmp = dst.with_name(dst.name + ".part")
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    t0 = time.perf_counter()
    write(tmp)
    seconds = time.perf_counter() - t0
    tmp.rename(dst)
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file()) if dst.is_dir() else dst.stat().st_size
    info = {"path": str(dst), "seconds": round(seconds, 2), "bytes": size, "what": what}
    stamp.write_text(json.dumps(info))
    info["cached"] = False
    return info


def _write_wds(dst: Path, jpeg_pack: str) -> None:
    import webdataset as wds
    from tqdm.auto import tqdm

    dst.mkdir(parents=True)
    reader = open_reader(jpeg_pack)
    labels = reader.labels
    with wds.ShardWriter(str(dst / "shard-%05d.tar"), maxcount=200, verbose=0) as sink:
        for i in tqdm(range(len(reader)), desc="webdataset", unit="img", dynamic_ncols=True, file=sys.stderr):
            sink.write({"__key__": f"{i:08d}", "jpg": bytes(reader.read(i)), "cls": str(int(labels[i])).encode()})


def _write_ffcv(dst: Path, files: list[tuple[str, int]], mode: str, workers: int) -> None:
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    dst.mkdir(parents=True)
    field = RGBImageField(write_mode="jpg" if mode == "jpeg256" else "raw", max_resolution=None, jpeg_quality=QUALITY)
    writer = DatasetWriter(str(dst / "data.beton"), {"image": field, "label": IntField()}, num_workers=max(1, workers))
    writer.from_indexed_dataset(_PeerSource(files, mode), chunksize=32)


# --------------------------------------------------------------------------- the loaders


class PILFolder(Dataset):
    """The baseline: a hand-written ImageFolder with torchvision's eval transform, in PIL."""

    def __init__(self, root: Path) -> None:
        self.samples = _folder_files(root)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        w, h = img.size
        nw, nh = (SHORT, int(SHORT * h / w)) if w <= h else (int(SHORT * w / h), SHORT)
        img = img.resize((nw, nh), Image.Resampling.BILINEAR)
        left, top = int(round((nw - CROP) / 2.0)), int(round((nh - CROP) / 2.0))
        img = img.crop((left, top, left + CROP, top + CROP))
        return torch.from_numpy(np.array(img)), label  # a copy, as torchvision's PILToTensor


def _crop_view(img: np.ndarray) -> np.ndarray:
    """The crop as a view: what a loader uses when it copies the crop into its batch anyway."""
    return dec.center_crop(img, CROP, copy=False)


def _resize_crop(img: np.ndarray) -> np.ndarray:
    return dec.center_crop(dec.resize_shorter(img, SHORT), CROP)


def _sampler(ds: Any, n: int, seed: int) -> RandomSampler:
    g = torch.Generator()
    g.manual_seed(seed)
    return RandomSampler(ds, replacement=False, num_samples=n, generator=g)  # > len(ds): whole permutations chained


def _check(batch: Any, name: str) -> None:
    x = batch[0]
    if tuple(x.shape) != (BATCH, CROP, CROP, 3) or x.dtype != torch.uint8:
        raise RuntimeError(f"{name} gave a batch of {tuple(x.shape)} {x.dtype}, not ({BATCH}, {CROP}, {CROP}, 3) uint8")


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) of this process (all its threads) and of the processes ``pids``."""
    total = time.process_time()  # this process, all threads, at high resolution
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except (OSError, IndexError, ValueError):
            pass
    return total


def _worker_pids(it: Any) -> list[int]:
    return [w.pid for w in getattr(it, "_workers", []) if w.pid]


def _time_batches(it: Iterator[Any], warmup: int, batches: int, name: str,
                  pids: Callable[[], list[int]] = list) -> tuple[float, float]:
    """(images/s, CPU ms per image over every process involved) for ``batches`` batches after ``warmup``."""
    for _ in range(warmup):
        b = next(it)
    _check(b, name)
    procs = pids()
    c0, t0 = _cpu_seconds(procs), time.perf_counter()
    for _ in range(batches):
        b = next(it)
    dt, cpu = time.perf_counter() - t0, _cpu_seconds(procs) - c0
    _check(b, name)
    n = batches * BATCH
    return n / dt, cpu * 1e3 / n


def _torch_run(make: Callable[[int], DataLoader], warmup: int, batches: int, name: str,
               counter: list[int]) -> tuple[float, float]:
    counter[0] += 1
    loader = make(counter[0])
    it = iter(loader)
    try:
        return _time_batches(it, warmup, batches, name, functools.partial(_worker_pids, it))
    finally:
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # joins the workers: nothing of this run competes with the next one
        del it


def build_candidates(root: Path, packs: dict[str, dict[str, Any]], peers: dict[str, dict[str, Any]],
                     args: argparse.Namespace) -> dict[str, Callable[[], tuple[float, float]]]:
    """name -> a function that measures one round: (images/s, CPU ms per image)."""
    w, warm = args.workers, args.warmup
    c: dict[str, Callable[[], tuple[float, float]]] = {}

    def torch_candidate(name: str, ds: Dataset, workers: int = w, **loader_kw: Any) -> None:
        counter = [0]
        nb = _timed(name, args)
        need = (warm + nb) * BATCH

        def make(k: int) -> DataLoader:
            sampler = _sampler(ds, need, args.seed + k)
            if isinstance(ds, PILFolder):  # the baseline: a plain DataLoader, as written by hand
                return DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers, drop_last=True)
            if workers == 0:
                return make_loader(ds, BATCH, num_workers=0, sampler=sampler, seed=args.seed + k, **loader_kw)
            return make_loader(ds, BATCH, num_workers=workers, sampler=sampler, seed=args.seed + k,
                               persistent_workers=False, **loader_kw)

        c[name] = functools.partial(_torch_run, make, warm, nb, name, counter)

    torch_candidate(BASELINE, PILFolder(root))
    torch_candidate(ENCODED, PackedDataset(packs["encoded"]["path"], decode_size=SHORT, transform=_resize_crop,
                                           fast_dct=FAST_DCT))
    torch_candidate(LMDB, PackedDataset(packs["jpeg256-lmdb"]["path"], center_crop=CROP, fast_dct=FAST_DCT))
    torch_candidate(NATIVE, PackedDataset(packs["jpeg256-native"]["path"], center_crop=CROP, fast_dct=FAST_DCT))
    torch_candidate(RAW, PackedDataset(packs["raw224-native"]["path"]), collate_fn=collate_packed)
    # a raw batch is one gather-copy: shipping it from a worker process costs more than reading it
    torch_candidate(RAW_MAIN, PackedDataset(packs["raw224-native"]["path"]), collate_fn=collate_packed, workers=0)
    torch_candidate(RAW_MAIN_NV, PackedDataset(packs["raw224-native"]["path"], verify=False),
                    collate_fn=collate_packed, workers=0)

    # the same datasets read by ThreadLoader: w threads of this process decode straight into the batch
    threads = {ENCODED_T: PackedDataset(packs["encoded"]["path"], decode_size=SHORT, transform=_resize_crop,
                                        fast_dct=FAST_DCT),
               LMDB_T: PackedDataset(packs["jpeg256-lmdb"]["path"], center_crop=CROP, fast_dct=FAST_DCT),
               NATIVE_T: PackedDataset(packs["jpeg256-native"]["path"], center_crop=CROP, fast_dct=FAST_DCT),
               NATIVE_T_ACC: PackedDataset(packs["jpeg256-native"]["path"], center_crop=CROP),
               NATIVE_T_WHOLE: PackedDataset(packs["jpeg256-native"]["path"], transform=_crop_view, fast_dct=FAST_DCT),
               NATIVE_T_AA: PackedDataset(packs["jpeg256-native"]["path"], center_crop=CROP, fast_dct=FAST_DCT),
               RAW_T: PackedDataset(packs["raw224-native"]["path"]),
               RAW_T1: PackedDataset(packs["raw224-native"]["path"], verify=True)}
    # steady state: one pass reads (and crc-checks) every sample once, as a first epoch would (FFCV
    # never checks); the "verify every read" row shows what checking costs when it is never skipped
    for name, ds in threads.items():
        if name != RAW_T1:
            for i in range(len(ds)):
                ds.reader.read(i)
    for name, ds in threads.items():
        c[name] = _ThreadCandidate(ds, args, name)

    if "path" in peers.get(WDS, {}):
        c[WDS] = functools.partial(_wds_run, peers[WDS]["path"], args)
    for name in (FFCV_JPEG, FFCV_RAW):
        if "path" in peers.get(name, {}):
            c[name] = _FFCVCandidate(name, str(Path(peers[name]["path"]) / "data.beton"), args)
    return c


class _ThreadCandidate:
    """One ThreadLoader for all rounds, as one loader serves every epoch of a training run (FFCV's
    Loader is kept across rounds too); each round reads on from where the last one stopped."""

    def __init__(self, ds: Dataset, args: argparse.Namespace, name: str) -> None:
        self.ds, self.args, self.name = ds, args, name
        self.loader: ThreadLoader | None = None

    def __call__(self) -> tuple[float, float]:  # the threads are this process's: their CPU time is counted
        if self.loader is None:
            self.loader = ThreadLoader(self.ds, BATCH, num_threads=self.args.workers, seed=self.args.seed)
        loader = self.loader

        def epoch() -> tuple[Iterator[Any], Callable[[], None]]:
            it = iter(loader)
            return it, it.close  # closing ends the epoch: nothing is read ahead while others run

        return _time_epochs(epoch, len(loader), self.args.warmup, _timed(self.name, self.args), self.name)


def _time_epochs(epoch: Callable[[], tuple[Iterator[Any], Callable[[], None]]], per_epoch: int, warmup: int,
                 batches: int, name: str) -> tuple[float, float]:
    """(images/s, CPU ms per image of this process) for ``batches`` batches of loaders that run epochs:
    each epoch's first ``warmup`` batches untimed, then batches up to the epoch's end, over as many
    epochs as it takes. Steady state within an epoch, as on a data set far larger than this one,
    where starting an epoch (FFCV starts threads and plans; ThreadLoader draws a permutation) is rare."""
    if per_epoch <= warmup:
        raise RuntimeError(f"{name}: an epoch of {per_epoch} batches is not longer than the warm-up ({warmup})")
    done, dt, cpu = 0, 0.0, 0.0
    while done < batches:
        it, stop = epoch()
        try:
            for _ in range(warmup):
                b = next(it)
            _check(b, name)
            k = min(batches - done, per_epoch - warmup)
            c0, t0 = _cpu_seconds([]), time.perf_counter()
            for _ in range(k):
                b = next(it)
            dt, cpu = dt + time.perf_counter() - t0, cpu + _cpu_seconds([]) - c0
            _check(b, name)
            done += k
        finally:
            stop()
    n = done * BATCH
    return n / dt, cpu * 1e3 / n


def _timed(name: str, args: argparse.Namespace) -> int:
    """Timed batches for a candidate: raw reading is ~20x faster than decoding, so it gets more batches
    (30 raw batches take ~25 ms: too short to time on a shared machine)."""
    return args.batches * (RAW_BATCH_FACTOR if "raw" in name else 1)


def _wds_decode(sample: dict[str, Any]) -> tuple[np.ndarray, int]:
    return _crop_view(dec.decode(sample["jpg"])), int(sample["cls"])  # default_collate copies it into the batch


def _wds_run(path: str, args: argparse.Namespace) -> tuple[float, float]:
    import webdataset as wds
    from torch.utils.data import default_collate

    urls = sorted(str(p) for p in Path(path).glob("shard-*.tar"))
    ds = (wds.WebDataset(urls, resampled=True, shardshuffle=False, seed=args.seed, empty_check=False)
          .shuffle(500)
          .map(_wds_decode)
          .batched(BATCH, collation_fn=default_collate, partial=False))
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers)
    it = iter(loader)
    try:
        return _time_batches(it, args.warmup, args.batches, WDS, functools.partial(_worker_pids, it))
    finally:
        it._shutdown_workers()
        del it


class _FFCVCandidate:
    """One FFCV Loader for all rounds (its pipeline is JIT-compiled once); each round reads epochs until done."""

    def __init__(self, name: str, path: str, args: argparse.Namespace) -> None:
        self.name, self.path, self.args = name, path, args
        self.loader: Any = None

    def _make(self) -> Any:
        from ffcv.fields.decoders import CenterCropRGBImageDecoder, IntDecoder, SimpleRGBImageDecoder
        from ffcv.loader import Loader, OrderOption
        from ffcv.transforms import ToTensor

        image = (SimpleRGBImageDecoder() if self.name == FFCV_RAW
                 else CenterCropRGBImageDecoder((CROP, CROP), ratio=CROP / SHORT))
        return Loader(self.path, batch_size=BATCH, num_workers=self.args.workers, order=OrderOption.RANDOM,
                      os_cache=True, drop_last=True, seed=self.args.seed,
                      pipelines={"image": [image, ToTensor()], "label": [IntDecoder(), ToTensor()]})

    def __call__(self) -> tuple[float, float]:  # FFCV's workers are threads of this process
        if self.loader is None:
            self.loader = self._make()

        def epoch() -> tuple[Iterator[Any], Callable[[], None]]:
            ep = iter(self.loader)

            def stop() -> None:  # stop the prefetching thread before the next candidate runs
                ep.close()
                ep.join(timeout=10)

            return ep, stop

        return _time_epochs(epoch, len(self.loader), self.args.warmup, _timed(self.name, self.args), self.name)


# --------------------------------------------------------------------------- ceilings


_CEIL: dict[str, Any] = {}


def _ceil_work(task: tuple[str, list[int]]) -> int:
    """Decode (and crop, resize) images from RAM into one reused output row: the per-image work alone."""
    kind, idx = task
    data = _CEIL[kind]
    row = _CEIL.setdefault("row", np.empty((CROP, CROP, 3), dtype=np.uint8))
    if kind == "jpeg256":  # the crop decoded from the MCUs it covers, as the jpeg256 rows do
        for i in idx:
            h, w = dec.jpeg_info(data[i])[:2]
            top, left = int(round((h - CROP) / 2.0)), int(round((w - CROP) / 2.0))
            np.copyto(row, dec.decode_crop(data[i], top, left, CROP, CROP, fast_dct=FAST_DCT, reuse=True))
    else:
        for i in idx:
            np.copyto(row, _resize_crop(dec.decode(data[i], min_size=SHORT, fast_dct=FAST_DCT, reuse=True)))
    return len(idx)


def _ceiling_run(kind: str, args: argparse.Namespace, counter: list[int], workers: int | None = None
                 ) -> tuple[float, float]:
    """The same decode + crop (+ resize) work in a plain loop from RAM on ``workers`` processes
    (default ``--workers``)."""
    workers = workers or args.workers
    counter[0] += 1
    n = len(_CEIL[kind])
    rng = np.random.default_rng(args.seed + counter[0])
    order = rng.permutation(np.resize(np.arange(n), (args.warmup + args.batches) * BATCH)).tolist()
    step = 8  # small tasks: the processes finish together, none idles at the end
    warm, timed = order[: args.warmup * BATCH], order[args.warmup * BATCH :]
    with mp.get_context("fork").Pool(workers) as pool:
        pool.map(_ceil_work, [(kind, warm[s : s + step]) for s in range(0, len(warm), step)], chunksize=1)
        timed = [(kind, timed[s : s + step]) for s in range(0, len(timed), step)]
        pids = [p.pid for p in pool._pool]  # type: ignore[attr-defined]
        c0, t0 = _cpu_seconds(pids), time.perf_counter()
        done = sum(pool.map(_ceil_work, timed, chunksize=1))
        dt, cpu = time.perf_counter() - t0, _cpu_seconds(pids) - c0
    return done / dt, cpu * 1e3 / done


def _memcpy_run(args: argparse.Namespace) -> tuple[float, float]:
    """One batch's bytes copied with one memcpy (a random batch of a raw 224x224 pack held in RAM), one thread."""
    src = _CEIL["raw224"]
    out = np.empty((BATCH, src.shape[1]), dtype=np.uint8)
    rng = np.random.default_rng(args.seed)
    starts = rng.integers(0, len(src) - BATCH + 1, max(100, 3 * args.batches)).tolist()
    np.copyto(out, src[:BATCH])  # fault the destination in once
    times = []
    c0 = _cpu_seconds([])
    for s in starts:
        t0 = time.perf_counter()
        np.copyto(out, src[s : s + BATCH])
        times.append(time.perf_counter() - t0)
    cpu = _cpu_seconds([]) - c0
    return BATCH / statistics.median(times), cpu * 1e3 / (len(starts) * BATCH)


def build_ceilings(root: Path, packs: dict[str, dict[str, Any]],
                   args: argparse.Namespace) -> dict[str, Callable[[], tuple[float, float]]]:
    reader = open_reader(packs["jpeg256-native"]["path"])
    _CEIL["jpeg256"] = [bytes(reader.read(i)) for i in range(len(reader))]
    _CEIL["original"] = [Path(p).read_bytes() for p, _ in _folder_files(root)]
    raw = open_reader(packs["raw224-native"]["path"])
    _CEIL["raw224"] = np.stack([np.array(raw.read(i)) for i in range(min(len(raw), 1024))])
    return {
        CEIL_JPEG: functools.partial(_ceiling_run, "jpeg256", args, [0]),
        **({CEIL_JPEG_1: functools.partial(_ceiling_run, "jpeg256", args, [0], 1)} if args.workers > 1 else {}),
        CEIL_ENC: functools.partial(_ceiling_run, "original", args, [0]),
        CEIL_COPY: functools.partial(_memcpy_run, args),
    }


def _warm_page_cache(paths: list[Any]) -> None:
    """Read every file once, so that every candidate reads from RAM (the page cache), none from disk."""
    for p in paths:
        p = Path(p)
        for f in ([p] if p.is_file() else p.rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass


# --------------------------------------------------------------------------- report


def summarize(rates: dict[str, list[float | None]], cpu: dict[str, list[float | None]], errors: dict[str, str],
              packs: dict[str, Any], peers: dict[str, Any], data: dict[str, Any], args: argparse.Namespace,
              decoder: str, loads: dict[str, list[ForeignLoad]] | None = None) -> dict[str, Any]:
    loads = loads or {}
    got = {k: [x for x in v if x is not None] for k, v in rates.items()}
    med = {k: statistics.median(v) for k, v in got.items() if v}

    def ratio(a: str, b: str) -> float | None:
        """Median over rounds of a / b measured in the same round (so drift between rounds cancels)."""
        pairs = [x / y for x, y in zip(rates.get(a, []), rates.get(b, [])) if x is not None and y is not None]
        return statistics.median(pairs) if pairs else None

    results: dict[str, dict[str, Any]] = {}
    for name in rates:
        if name not in med:
            reason = errors.get(name) or peers.get(name, {}).get("missing", "not run")
            results[name] = {"img_per_s": None, "missing": reason}
            continue
        row: dict[str, Any] = {"img_per_s": round(med[name], 1), "rounds": [round(x, 1) for x in got[name]]}
        ms = [x for x in cpu.get(name, []) if x is not None]
        if ms:
            row["cpu_ms_per_img"] = round(statistics.median(ms), 4)
        fc = [w.foreign_cores for w in loads.get(name, []) if w.foreign_cores is not None]
        if fc:
            row["foreign_cores_max"] = round(max(fc), 3)
        ceil = SAME_WORK_CEILING.get(name)
        if ceil:  # CPU efficiency: the ceiling's CPU per image over this one's (robust to other load)
            pairs = [c / m for c, m in zip(cpu.get(ceil, []), cpu.get(name, [])) if c is not None and m]
            if pairs:
                row["cpu_efficiency_vs_ceiling"] = round(statistics.median(pairs), 3)
        ref = {"baseline": BASELINE, "ceiling": SAME_WORK_CEILING.get(name), "webdataset": WDS,
               "ffcv_jpeg": FFCV_JPEG, "ffcv_raw": FFCV_RAW}
        for key, other in ref.items():
            r = ratio(name, other) if other and other != name else None
            if r is not None:
                row[f"x_{key}"] = round(r, 3)
        results[name] = row
    for name in (WDS, FFCV_JPEG, FFCV_RAW):
        if name not in results:
            results[name] = {"img_per_s": None, "missing": peers.get(name, {}).get("missing", "not run")}

    # the baseline checks (issue 16): every target stands on them
    shared = []  # checks of the method and the machine: every target depends on them
    aa = ratio(NATIVE_T_AA, NATIVE_T)
    if aa is not None:
        shared.append(aa_check(med[NATIVE_T_AA], med[NATIVE_T], what=NATIVE_T.replace(", threads", " (ThreadLoader)"),
                               tolerance=AA_NOISE, ratio=aa, fmt=lambda x: f"{x:,.0f} img/s"))
    if CEIL_JPEG in med and CEIL_JPEG_1 in med:
        shared.append(thread_check(1.0 / med[CEIL_JPEG_1], 1.0 / med[CEIL_JPEG], args.workers,
                                   what="decode+crop ceiling, wall time per image,"))
    targets = []

    def target(what: str, a: str, b: str, need: float) -> None:
        r = ratio(a, b)
        checks = [*shared, load_check([*loads.get(a, []), *loads.get(b, [])], what=f"{a} / {b}")]
        status = verdict(None if r is None else r >= need, checks)
        # the same comparison in CPU time per image (b's over a's): robust to other load on the machine
        pairs = [y / x for x, y in zip(cpu.get(a, []), cpu.get(b, [])) if x and y is not None]
        targets.append({"target": what, "candidate": a, "reference": b, "ratio": None if r is None else round(r, 3),
                        "need": need, "status": status, "unreliable_because": why(checks),
                        "unreliable_brief": why(checks, brief=True),
                        "cpu_ratio": round(statistics.median(pairs), 3) if pairs else None})

    # the claims are for the way the README recommends reading a pack: ThreadLoader (the DataLoader-worker
    # rows and the other variants are in the table for comparison)
    for jp in (NATIVE_T, LMDB_T):
        target(f"{jp} >= {TARGET_VS_BASELINE_JPEG:g}x baseline", jp, BASELINE, TARGET_VS_BASELINE_JPEG)
        target(f"{jp} >= {TARGET_VS_CEILING_JPEG:.0%} of same-decoder ceiling", jp, CEIL_JPEG, TARGET_VS_CEILING_JPEG)
        target(f"{jp} above WebDataset", jp, WDS, 1.0)
        target(f"{jp} above FFCV jpeg", jp, FFCV_JPEG, 1.0)
    for raw in (RAW_T,):
        target(f"{raw} >= {TARGET_VS_BASELINE_RAW:g}x baseline", raw, BASELINE, TARGET_VS_BASELINE_RAW)
        target(f"{raw} above FFCV raw", raw, FFCV_RAW, 1.0)

    storage = {}
    for name, info in packs.items():
        storage[f"ours: {name}"] = {k: info.get(k) for k in ("seconds", "bytes", "what", "cached")}
    for name in (WDS, FFCV_JPEG, FFCV_RAW):
        info = peers.get(name, {})
        storage[name] = ({k: info.get(k) for k in ("seconds", "bytes", "what", "cached")} if "path" in info
                         else {"missing": info.get("missing")})
    return {
        "config": {"images": args.images, "batch": BATCH, "output": [CROP, CROP, 3], "workers": args.workers,
                   "warmup_batches": args.warmup, "timed_batches": args.batches, "rounds": args.repeats,
                   "decoder": decoder, "seed": args.seed, "torch": torch.__version__,
                   "peers": _peer_versions()},
        "data": data,
        "packing": storage,
        "results": results,
        "baseline_checks": [c.to_dict() for c in shared],
        "targets": targets,
    }


def _peer_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("webdataset", "ffcv", "simplejpeg", "lmdb", "pillow", "opencv-python-headless"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


def print_report(s: dict[str, Any]) -> None:
    d = s["data"]
    print(f"\nsource: {d['images']} JPEGs, mean {d['mean_hw'][1]}x{d['mean_hw'][0]} (WxH), {d['mean_kb']} KB each, "
          f"{human_bytes(d['bytes'])} in all")
    rows = []
    for name, p in s["packing"].items():
        if "missing" in p:
            rows.append([name, "-", "-", "-", f"missing: {p['missing']}"])
            continue
        per = p["bytes"] / d["images"]
        rows.append([name, f"{p['seconds']:.1f}" + (" (cached)" if p.get("cached") else ""), human_bytes(p["bytes"]),
                     f"{per / 1e3:.1f} KB", p["what"]])
    print("\npacking (once; timed when made, workers=" f"{s['config']['workers']}):")
    print(table(["pack", "seconds", "on disk", "per image", "what"], rows, "lrrrl"))

    heads = ["candidate", "img/s", "rounds min-max", "x baseline", "x same-work ceiling", "x WebDataset", "x FFCV jpeg",
             "x FFCV raw", "CPU ms/img", "CPU eff.", "foreign"]
    rows = []
    for name, r in s["results"].items():
        if r["img_per_s"] is None:
            rows.append([name, "-", "missing", "", "", "", "", "", "", "", ""])  # why: in the packing table and the JSON
            continue

        def x(key: str) -> str:
            return f"{r[key]:.2f}" if key in r else "-"

        rows.append([name, f"{r['img_per_s']:.0f}", f"{min(r['rounds']):.0f}-{max(r['rounds']):.0f}", x("x_baseline"),
                     x("x_ceiling"), x("x_webdataset"), x("x_ffcv_jpeg"), x("x_ffcv_raw"),
                     f"{r['cpu_ms_per_img']:.3f}" if "cpu_ms_per_img" in r else "-", x("cpu_efficiency_vs_ceiling"),
                     f"{r['foreign_cores_max']:.2f}" if "foreign_cores_max" in r else "-"])
    cfg = s["config"]
    print(f"\nimages/s, {cfg['batch']}x{cfg['output'][0]}x{cfg['output'][1]} uint8 batches, {cfg['workers']} workers, "
          f"median of {cfg['rounds']} rounds of {cfg['timed_batches']} batches:")
    print(table(heads, rows, "lrrrrrrrrrr"))
    print("ratios: median over rounds of the ratio within each round. same-work ceiling: encoded -> "
          "decode+resize+crop, jpeg256 rows (ours and peers) -> decode+crop,\nraw rows -> memcpy. CPU ms/img: CPU "
          "time of every process and thread involved (workers included) per image over the timed batches;\n"
          "CPU eff. = the same-work ceiling's CPU ms/img / this row's: how much of the work is the work itself, "
          "robust to other load on the machine\n(wall-clock img/s is not). foreign: the most cores other processes "
          "used while this row ran (worst round).")
    print(f"\n{rules_text(AA_NOISE)}:")
    for c in s.get("baseline_checks", []):
        print(f"  {'ok  ' if c['ok'] else 'FAIL'}  {c['kind']}: {c['detail']}")
    print("\ntargets (issue 4):")
    for t in s["targets"]:
        r = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}"
        c = "" if t.get("cpu_ratio") is None else f"; in CPU time per image: {t['cpu_ratio']:.2f}"
        bad = f" -- {UNRELIABLE}: {t['unreliable_brief']}" if t["status"] == UNRELIABLE else ""
        if t["ratio"] is not None and t["need"] == 1.0 and abs(t["ratio"] - 1.0) <= AA_NOISE and not bad:
            bad = f" -- within the {AA_NOISE:.0%} A/A noise of 1: a tie this run cannot resolve (see README)"
        print(f"  {t['status']}: {t['target']}: {r} (need >= {t['need']:g}{c}){bad}")


def plot(s: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(n, r) for n, r in s["results"].items() if r["img_per_s"]]

    def colour(n: str) -> str:
        if n == BASELINE:
            return "#888888"
        if n.startswith("ours"):
            return "#1f77b4"
        if n.startswith("ceiling"):
            return "#bbbbbb"
        return "#ff7f0e"

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.8))
    rows = rows[::-1]
    names = [n for n, _ in rows]
    vals = [r["img_per_s"] for _, r in rows]
    ax.barh(names, vals, color=[colour(n) for n in names])
    ax.set_xscale("log")
    for i, (_, r) in enumerate(rows):
        label = f" {r['img_per_s']:,.0f}" + (f"  ({r['x_baseline']:.1f}x)" if "x_baseline" in r else "")
        ax.text(r["img_per_s"], i, label, va="center", fontsize=8)
    ax.set_xlim(right=max(vals) * 6)
    cfg = s["config"]
    ax.set_xlabel(f"images/s, log scale (median of {cfg['rounds']} rounds; in brackets: x baseline)\n"
                  f"{cfg['batch']}x{cfg['output'][0]}x{cfg['output'][1]} uint8 batches, "
                  f"{cfg['workers']} loader workers unless named")
    ax.set_title(f"Image loading, {s['data']['images']} ImageNet-like JPEGs: blue ours, orange peers, grey ceilings",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=3200, help="JPEGs to generate (default 3200)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    ap.add_argument("--batches", type=int, default=45,
                    help="timed batches per candidate and round (default 45: an epoch of 3200 images after warm-up)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed batches first (default 5)")
    ap.add_argument("--workers", type=int, default=2, help="loader workers, packing and ceiling processes (default 2)")
    ap.add_argument("--cache-dir", help="where generated images and packs are kept "
                                        "(default: $TMPDIR/torch-tricks-bench/data_loading)")
    ap.add_argument("--repack", action="store_true", help="redo the packs and the peers' files (not the images)")
    ap.add_argument("--skip-peers", action="store_true", help="leave out WebDataset and FFCV")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", default=str(Path(__file__).with_name("data_loading.png")),
                    help="bar plot path ('' for none; default benchmarks/data_loading.png)")
    ap.add_argument("--json", help="also write the JSON summary here")
    ap.add_argument("--only", help="comma-separated substrings: measure only the candidates whose names contain one")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing candidates")
    args = ap.parse_args(argv)
    for k in ("images", "repeats", "batches", "workers"):
        if getattr(args, k) < 1:
            ap.error(f"--{k} must be >= 1")
    if args.warmup < 1:
        ap.error("--warmup must be >= 1")
    if args.images < BATCH:
        ap.error(f"--images must be at least one batch ({BATCH})")
    return args


if __name__ == "__main__":
    sys.exit(main())
