"""Pack a data set once, read it fast forever (D1, D3, D4): ``torch-tricks pack SRC DST``.

One pass over an ImageFolder tree, a list file or any map-style ``Dataset`` writes a
packed data set (the native shard format or LMDB, see :mod:`torch_tricks.data.formats`):

* **pre-resize offline** (D1): ``resize=N`` stores every image with its shorter side at
  N (aspect kept), so training never resizes the full-size image again. This is the big
  win: decoding and resizing a 500x375 JPEG costs far more than decoding a 160-pixel one.
* **storage**: ``encoded`` keeps the source's own bytes (smallest, lossless w.r.t. the
  source; no resize possible); ``jpeg`` re-encodes at ``quality`` (after a resize);
  ``raw`` stores decoded uint8 pixels so reading needs no decode at all (D3, the "store
  bmp" tip), at several times the disk space. ``raw_size=N`` makes every raw sample
  N x N (shorter side to N, then a center crop), which lets the reader return a whole
  batch as one array; without it raw samples keep their own shapes.
* **in parallel**: decode / resize / encode run in ``workers`` processes; the main
  process writes in source order, so a pack is the same whatever the worker count.
* **safe**: unreadable sources are skipped and listed (``PackReport.skipped`` and
  ``skipped.txt``), not fatal; progress is committed every few seconds and a re-run with
  the same arguments resumes from there; the header is written last, so a killed pack
  never reads as complete.

Class labels follow torchvision's ``ImageFolder`` exactly (class folders sorted by
name, files with an image extension, walked and sorted the same way), without importing
torchvision: a model trained on the pack uses the same class indices as one trained on
the folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from torch_tricks._format import human_bytes
from torch_tricks._optional import install_hint
from torch_tricks.data import decode as _dec
from torch_tricks.data.formats import STORAGES, LMDBWriter, NativeWriter
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["IMG_EXTENSIONS", "FORMATS", "PackReport", "pack", "find_classes", "make_dataset", "read_list_file"]

#: torchvision's ``IMG_EXTENSIONS``: the files ImageFolder takes (compared case-insensitively).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
FORMATS = ("native", "lmdb")


@dataclass
class PackReport:
    """What :func:`pack` did. ``skipped`` lists ``(source name, reason)`` for unreadable samples."""

    path: str
    fmt: str
    storage: str
    count: int
    skipped: list[tuple[str, str]]
    bytes: int  # on disk, all files of the pack
    seconds: float
    classes: list[str]
    resumed_from: int = 0  # samples already packed by an interrupted earlier run
    decoder: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        """What ``torch-tricks pack`` prints: one summary line, then every skipped source with its reason."""
        lines = [f"packed {self.count:,} samples ({len(self.classes)} classes) into {self.path}: "
                 f"{self.fmt}, {self.storage}, {human_bytes(self.bytes)} on disk, {self.seconds:.1f} s"
                 + (f", resumed after {self.resumed_from:,}" if self.resumed_from else "")]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} unreadable source(s):")
            lines += [f"  {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


@register_trick(
    "pack",
    ids=("D1", "D3", "D4"),
    kind="data",
    trades="a one-off packing pass and a second copy on disk, for no per-file opens, no resize at read "
    "time (--resize) and optionally no decode at all (raw storage)",
    needs="an ImageFolder tree, a list file or a map-style Dataset; lmdb for fmt='lmdb'",
    measured_in="benchmarks/data_loading.py",
    switch_on="torch-tricks pack",
)
def pack(
    source: Any,
    dst: str | os.PathLike[str],
    *,
    fmt: str = "native",
    storage: str = "encoded",
    resize: int | None = None,
    quality: int = 90,
    crop_ready: bool = True,
    workers: int | None = None,
    progress: bool = True,
    resume: bool = True,
    raw_size: int | None = None,
    decoder: str | None = None,
    interpolation: str = "linear",
    shard_bytes: int = 1 << 30,
    overwrite: bool = False,
    commit_every: int = 1000,
) -> PackReport:
    """Pack ``source`` into the directory ``dst``; returns a :class:`PackReport`.

    ``source``: an ImageFolder directory (``root/<class>/<file>``), a text list file
    (``path label`` or ``path,label`` a line, paths relative to the list file, labels all
    integers or all class names, ``#`` comments), or a map-style Dataset whose items are
    ``(image, label)`` with image as encoded bytes, a PIL image, an HWC uint8 array or a
    CHW uint8 tensor.
    ``fmt``: ``native`` (memory-mapped shards) or ``lmdb``.
    ``storage``: ``encoded`` (the source bytes; arrays and PIL images become PNG),
    ``jpeg`` (re-encoded at ``quality``) or ``raw`` (decoded uint8 pixels).
    ``resize``: shorter side to this many pixels (needs ``jpeg`` or ``raw``); the JPEG is
    decoded at the smallest fast DCT scale that is still large enough, then resized with
    ``interpolation`` (linear by default).
    ``crop_ready``: ``jpeg`` storage only: a restart marker after every MCU and the MCUs'
    byte offsets after the image's end (~6% more on disk at quality 90), so that a reader
    with a crop (``PackedDataset(center_crop=...)``) decodes only the MCUs the crop covers
    (:func:`~torch_tricks.data.decode.decode_crop`; same pixels). Any decoder reads them.
    ``raw_size``: raw storage only: shorter side to N then center-crop N x N, so that all
    samples share one shape and batches can be read as one array.
    ``workers``: processes that decode and encode (default: the usable cores; 0 or 1:
    in this process). ``resume``: carry on an interrupted pack made with the same
    arguments (else start over). ``overwrite``: replace a complete pack at ``dst``.
    ``commit_every``: samples between durable progress points (at most ~5 s apart).
    """
    t0 = time.perf_counter()
    _check_pack_args(fmt, storage, quality, resize, raw_size, commit_every)
    src = _resolve_source(source)
    opts = _pack_options(storage, resize, raw_size, quality, decoder, interpolation, crop_ready)
    fingerprint = _fingerprint(src, opts, fmt)
    if fmt == "native":
        writer: NativeWriter | LMDBWriter = NativeWriter(
            dst, storage=storage, fingerprint=fingerprint, resume=resume, overwrite=overwrite, shard_bytes=shard_bytes
        )
    else:
        writer = LMDBWriter(dst, storage=storage, fingerprint=fingerprint, resume=resume, overwrite=overwrite)

    n = len(src.items)
    try:
        _write_samples(src, opts, writer, _n_workers(workers), progress, commit_every)
        if writer.count == 0:
            first = writer.skipped[0] if writer.skipped else ("", "the source is empty")
            raise UserError(f"no sample could be packed from {src.description}: first error: {first[0]}: {first[1]}")
        writer.source_pos = n
        classes = src.classes if src.classes is not None else _classes_from_labels(writer.max_label)
        meta = {**opts, "source": src.description, "source_kind": src.kind}
        writer.finish(classes, meta)
    except BrokenProcessPool as exc:
        raise UserError(f"a packing worker died ({exc}): re-run with workers=1 to find the sample that kills it; "
                        "progress so far is kept and resumed") from None
    finally:
        writer.close()

    dst_path = Path(dst)
    size = sum(p.stat().st_size for p in dst_path.iterdir() if p.is_file())
    return PackReport(
        path=str(dst_path),
        fmt=fmt,
        storage=storage,
        count=writer.count,
        skipped=list(writer.skipped),
        bytes=size,
        seconds=time.perf_counter() - t0,
        classes=list(classes),
        resumed_from=writer.resumed_from,
        decoder=opts["decoder"],
        options=opts,
    )


def find_classes(root: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
    """Class folder names and their indices, exactly as torchvision's ``find_classes``."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    if not classes:
        raise UserError(f"couldn't find any class folder in {str(root)!r}: an ImageFolder tree is root/<class>/<image>")
    return classes, {name: i for i, name in enumerate(classes)}


def make_dataset(root: str | os.PathLike[str], class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """``(path, class index)`` pairs exactly as torchvision's ``make_dataset`` with ``IMG_EXTENSIONS``."""
    directory = os.path.expanduser(str(root))
    instances: list[tuple[str, int]] = []
    available: set[str] = set()
    for target_class in sorted(class_to_idx.keys()):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(directory, target_class)
        if not os.path.isdir(target_dir):
            continue
        for dirpath, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(dirpath, fname)
                if path.lower().endswith(IMG_EXTENSIONS):
                    instances.append((path, class_index))
                    available.add(target_class)
    empty = set(class_to_idx.keys()) - available
    if empty:
        raise UserError(
            f"found no image file for the classes {', '.join(sorted(empty))} in {directory!r} "
            f"(extensions {', '.join(IMG_EXTENSIONS)}): add images or remove those folders"
        )
    return instances


def read_list_file(path: str | os.PathLike[str]) -> tuple[list[str], list[tuple[str, int]]]:
    """``(classes, [(path, label)])`` from a list file of ``path label`` or ``path,label`` lines.

    Paths are relative to the list file's folder. Integer labels are kept as they are
    (classes ``"0"`` .. ``str(max)``); names become indices in sorted order, as ImageFolder.
    """
    p = Path(path)
    rows = _list_file_rows(p)
    if not rows:
        raise UserError(f"{p} lists no samples: write one 'path label' a line")
    labels = [label for _, label in rows]
    if all(_is_int(label) for label in labels):
        ints = [int(label) for label in labels]
        if min(ints) < 0:
            raise UserError(f"{p}: labels must be >= 0, found {min(ints)}")
        return [str(i) for i in range(max(ints) + 1)], [(f, int(label)) for f, label in rows]
    if any(_is_int(label) for label in labels):
        raise UserError(f"{p}: labels are a mix of numbers and names: use one or the other")
    classes = sorted(set(labels))
    idx = {c: i for i, c in enumerate(classes)}
    return classes, [(f, idx[label]) for f, label in rows]


# --------------------------------------------------------------------------- the arguments


def _check_pack_args(fmt: str, storage: str, quality: int, resize: int | None, raw_size: int | None,
                     commit_every: int) -> None:
    """Refuse contradictory or out-of-range ``pack`` arguments before anything is read or written."""
    if fmt not in FORMATS:
        raise UserError(f"unknown pack format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if storage not in STORAGES:
        raise UserError(f"unknown storage {storage!r}: choose one of {', '.join(STORAGES)}")
    if not 1 <= int(quality) <= 100:
        raise UserError(f"JPEG quality must be 1-100, not {quality}")
    for name, value in (("resize", resize), ("raw_size", raw_size)):
        if value is not None and int(value) < 1:
            raise UserError(f"{name} must be a positive number of pixels, not {value}")
    if resize and storage == "encoded":
        raise UserError("resize re-encodes the images: use storage='jpeg' or 'raw' ('encoded' keeps the source bytes)")
    if raw_size and storage != "raw":
        raise UserError(f"raw_size is for storage='raw' (fixed-shape raw pixels), not {storage!r}: use resize")
    if raw_size and resize and resize != raw_size:
        raise UserError("give resize or raw_size, not both: raw_size already resizes the shorter side to N")
    if commit_every < 1:
        raise UserError(f"commit_every must be at least 1, not {commit_every}")


def _pack_options(storage: str, resize: int | None, raw_size: int | None, quality: int, decoder: str | None,
                  interpolation: str, crop_ready: bool) -> dict[str, Any]:
    """The options the workers apply and the fingerprint records (a resumed pack must match them)."""
    dec = _dec._resolve(decoder)
    backend = _dec.resize_backend() if (resize or raw_size) else ""
    opts = {
        "storage": storage,
        "resize": int(resize) if resize else None,
        "raw_size": int(raw_size) if raw_size else None,
        "quality": int(quality) if storage == "jpeg" else None,
        "decoder": dec,
        "resize_backend": backend,
        "interpolation": interpolation if backend else None,
    }
    if storage == "jpeg" and crop_ready:  # recorded for jpeg storage only: other packs keep their fingerprints
        opts["crop_ready"] = True
        # here, once: in the workers a missing encoder would look like every image being unreadable
        _dec.encode_jpeg(np.zeros((16, 16, 3), dtype=np.uint8), int(quality), crop_ready=True)
    return opts


# --------------------------------------------------------------------------- the source


@dataclass
class _Source:
    kind: str  # "folder" | "list" | "dataset"
    description: str
    items: list[tuple[Any, int | None]]  # (path or dataset index, label or None)
    names: list[str] | None  # per item, for skipped.txt / names.txt
    classes: list[str] | None
    dataset: Any = None


def _resolve_source(source: Any) -> _Source:
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            classes, class_to_idx = find_classes(p)
            samples = make_dataset(p, class_to_idx)
            names = [os.path.relpath(path, p) for path, _ in samples]
            return _Source("folder", str(p.resolve()), [(path, label) for path, label in samples], names, classes)
        if p.is_file():
            classes, samples = read_list_file(p)
            names = [os.path.relpath(path, p.parent) for path, _ in samples]
            return _Source("list", str(p.resolve()), samples, names, classes)
        raise UserError(f"{str(p)!r} does not exist: give an ImageFolder directory, a list file or a Dataset")
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        n = len(source)
        classes = getattr(source, "classes", None)
        return _Source("dataset", f"{type(source).__module__}.{type(source).__qualname__}({n})",
                       [(i, None) for i in range(n)], None, list(classes) if classes is not None else None, source)
    raise UserError(f"cannot pack a {type(source).__name__}: give an ImageFolder directory, a list file "
                    "or a map-style Dataset of (image, label)")


def _fingerprint(src: _Source, opts: dict[str, Any], fmt: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([src.kind, src.description, len(src.items), fmt, opts], sort_keys=True).encode())
    for name in src.names or ():
        h.update(name.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


def _classes_from_labels(max_label: int) -> list[str]:
    """Classes for a Dataset without ``.classes``: "0" .. str(max label)."""
    return [str(i) for i in range(max_label + 1)]


def _list_file_rows(p: Path) -> list[tuple[str, str]]:
    """The ``(path, label text)`` rows of a list file, paths made relative to its folder."""
    base = p.parent
    rows: list[tuple[str, str]] = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(",", 1) if "," in line else line.rsplit(None, 1)
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise UserError(f"{p}:{lineno}: expected 'path label' or 'path,label', got {line!r}")
        file, label = parts[0].strip(), parts[1].strip()
        rows.append((str(base / file) if not os.path.isabs(file) else file, label))
    return rows


def _is_int(text: str) -> bool:
    try:
        int(text)
        return True
    except ValueError:
        return False


def _n_workers(workers: int | None) -> int:
    if workers is not None:
        return max(0, int(workers))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- the work


def _write_samples(src: _Source, opts: dict[str, Any], writer: NativeWriter | LMDBWriter, nworkers: int,
                   progress: bool, commit_every: int) -> None:
    """Encode the samples not yet packed and write them in source order, committing progress as it goes."""
    from tqdm.auto import tqdm

    n = len(src.items)
    chunk = max(1, min(64, n // max(1, nworkers * 8)))
    bar = tqdm(total=n, initial=writer.source_pos, disable=not progress, unit="img", desc="pack",
               dynamic_ncols=True)
    try:
        last_commit, since = time.monotonic(), 0
        start = writer.source_pos
        chunks = ([(p, *src.items[p]) for p in range(s, min(s + chunk, n))] for s in range(start, n, chunk))
        for results in _run(chunks, nworkers, (src.dataset, opts)):
            since += _write_results(src, writer, results)
            bar.update(len(results))
            if writer.skipped:
                bar.set_postfix(skipped=len(writer.skipped), refresh=False)
            if (since >= commit_every or time.monotonic() - last_commit > 5.0
                    or getattr(writer, "pending_bytes", 0) > (64 << 20)):
                writer.commit(results[-1][0] + 1)
                last_commit, since = time.monotonic(), 0
    finally:
        bar.close()


def _write_results(src: _Source, writer: NativeWriter | LMDBWriter, results: list) -> int:
    """Add one chunk's payloads to ``writer`` (skips listed as such); returns how many were added."""
    added = 0
    for pos, payload, label, shape, reason in results:
        name = src.names[pos] if src.names is not None else str(pos)
        if payload is None:
            writer.skip(name, reason)
        else:
            writer.add(payload, label, shape, name)
            added += 1
    return added


_STATE: dict[str, Any] = {}


def _init_worker(dataset: Any, opts: dict[str, Any], parent: int | None = None) -> None:
    """Per-process setup: the source Dataset (inherited on fork, pickled once otherwise) and the options.

    In a pool worker (``parent`` given) also arrange to die with the parent: a killed
    ``pack`` must not leave orphaned workers behind, and a pool worker waiting for work
    never notices on its own (it holds both ends of its task pipe).
    """
    _STATE["dataset"] = dataset
    _STATE["opts"] = opts
    if parent is not None:
        _die_with_parent(parent)
        cv2 = _dec._load("cv2")
        if cv2 is not None:  # one image at a time per process: opencv's own threads only oversubscribe
            cv2.setNumThreads(1)


def _die_with_parent(parent: int) -> None:
    import signal
    import threading

    try:  # Linux: the kernel sends SIGKILL when the parent dies
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:  # elsewhere (and as a backstop): poll
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent:  # died before prctl took effect
        os._exit(1)
    threading.Thread(target=watch, name="pack-parent-watch", daemon=True).start()


def _work(chunk: Sequence[tuple[int, Any, int | None]]) -> list[tuple[int, bytes | None, int, tuple, str]]:
    """Turn source items into stored payloads: ``(pos, payload or None, label, shape, skip reason)``."""
    out = []
    for pos, ref, label in chunk:
        try:
            payload, lab, shape = _one(ref, label)
            out.append((pos, payload, lab, shape, ""))
        except Exception as exc:  # an unreadable sample is skipped and listed, never fatal
            if isinstance(exc, _dec.DecodeError):
                reason = exc.reason
            elif isinstance(exc, UserError):
                reason = str(exc)
            else:
                reason = f"{type(exc).__name__}: {exc}"
            out.append((pos, None, -1, (), " ".join(reason.split())[:300]))
    return out


def _one(ref: Any, label: int | None) -> tuple[bytes, int, tuple[int, int, int]]:
    opts = _STATE["opts"]
    storage, dec = opts["storage"], opts["decoder"]
    target = opts["raw_size"] or opts["resize"]
    data: Any = None
    img: np.ndarray | None = None
    if isinstance(ref, str):
        with open(ref, "rb") as f:
            data = f.read()
        name = ref
    else:
        item = _STATE["dataset"][ref]
        obj, label = item[0], int(item[1])
        name = str(ref)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            data = bytes(obj)
        else:
            img = _dec.to_rgb(obj)
    if storage == "encoded":
        if data is None:
            return _encode_png(img), int(label), img.shape
        img = _dec.decode(data, decoder=dec, name=name)  # proves it decodes; gives the shape
        return data, int(label), img.shape
    if img is None:
        img = _dec.decode(data, min_size=target, decoder=dec, name=name)
    if target:
        img = _dec.resize_shorter(img, target, opts["interpolation"], backend=opts["resize_backend"])
    if opts["raw_size"]:
        img = _dec.center_crop(img, opts["raw_size"])
    if storage == "jpeg":
        return _dec.encode_jpeg(img, opts["quality"], crop_ready=opts.get("crop_ready", False)), int(label), img.shape
    img = np.ascontiguousarray(img)
    return img.tobytes(), int(label), img.shape


def _encode_png(img: np.ndarray) -> bytes:
    Image = _dec._load("pil")
    if Image is not None:
        out = io.BytesIO()
        Image.fromarray(img).save(out, format="PNG", compress_level=1)
        return out.getvalue()
    cv2 = _dec._load("cv2")
    if cv2 is None:
        raise UserError(f"storing arrays with storage='encoded' needs Pillow or opencv: {install_hint('data')}")
    ok, buf = cv2.imencode(".png", cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
    return buf.tobytes()


def _run(chunks: Iterator[list], nworkers: int, initargs: tuple) -> Iterator[list]:
    """Results of ``_work`` per chunk, in order; at most a few chunks per worker in flight."""
    if nworkers <= 1:
        _init_worker(*initargs)
        try:
            for c in chunks:
                yield _work(c)
        finally:
            _STATE.clear()  # don't keep the source Dataset alive after packing
        return
    ex = ProcessPoolExecutor(nworkers, initializer=_init_worker, initargs=(*initargs, os.getpid()))
    try:
        pending: deque = deque()
        for c in chunks:
            pending.append(ex.submit(_work, c))
            if len(pending) >= nworkers * 4:
                break
        while pending:
            res = pending.popleft().result()
            nxt = next(chunks, None)
            if nxt is not None:
                pending.append(ex.submit(_work, nxt))
            yield res
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
