"""Packed data sets on disk (D4): a native memory-mapped shard format, and LMDB.

Millions of small image files are slow to read (one open + seek per sample, metadata
lookups, no readahead) and slow to copy. A pack puts every sample's stored bytes in a few
large files with an index, so a read is a slice of a memory map.

**Why a format of our own** next to LMDB: none of the well-kept containers gives all of
(a) random access by index with zero-copy reads from a plain ``np.memmap`` (LMDB copies out
of a B-tree; HDF5 and TFRecord need a library per read and TFRecord has no index),
(b) safety under many DataLoader workers with nothing to re-open but file maps,
(c) per-sample checksums, and (d) a layout any tool can read with numpy alone. The
format is small enough to write by hand:

``DIR/header.json``
    ``{"format": "torch-tricks-pack", "version": 1, "count", "classes", "storage"
    ("encoded" | "jpeg" | "raw"), "shape" ([H, W, C] when every sample has it, else
    null), "index": {"file", "sha256"}, "shards": [{"file", "bytes", "sha256"}], "meta"}``.
    Written **last**, atomically (temp file + rename): a directory without it is never a
    complete pack, whatever a kill left behind.
``DIR/index.npy``
    one :data:`INDEX_DTYPE` record per sample: shard id, byte offset, length, label,
    crc32 of the stored bytes, and the decoded image's height, width, channels.
``DIR/shard-00000.bin`` ...
    the samples' stored bytes back to back, a new shard when one would pass
    ``shard_bytes`` (1 GiB by default: few files, each small enough to copy and check).
``DIR/names.txt``, ``DIR/skipped.txt``
    the source name of each sample (one a line) and the sources that could not be
    read (``name<TAB>reason``).

While packing, ``progress.json`` plus ``index.part`` / ``names.part`` record the last
durable point (committed every few seconds); a new run with the same source and options
truncates back to it and carries on (resume).

**LMDB** (the ``lmdb`` package) holds the same data in one memory-mapped B-tree file:
named databases ``samples`` (key: the index as 10 ASCII digits; value: a
:data:`RECORD` header ``label, crc32, height, width, channels`` then the bytes),
``names``, ``index`` (the same records as ``index.npy``, as a resume journal) and ``meta``
(``header`` JSON, the whole ``index`` as one blob, ``progress``). The header is written in
the last transaction, so a killed pack is never complete; ``map_size`` doubles whenever
it is full. Readers open the environment ``readonly=True, lock=False, readahead=False``,
lazily in each process: an LMDB handle must never cross a fork.

Both readers open their files on first access in each process and re-open after a fork
(they compare ``os.getpid()``), drop them when pickled (spawn / forkserver workers), and
verify every sample's crc32 on read unless ``verify=False``; ``verify="once"`` checks each
sample the first time this process reads it (a pack's bytes do not change between epochs;
re-checking the same bytes from the page cache every epoch costs more than the copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from torch_tricks._io import atomic_path, fsync_dir
from torch_tricks._optional import require
from torch_tricks.errors import UserError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "STORAGES",
    "INDEX_DTYPE",
    "RECORD",
    "PackError",
    "CorruptSampleError",
    "NativeWriter",
    "NativeReader",
    "LMDBWriter",
    "LMDBReader",
    "detect_format",
    "is_complete",
    "open_reader",
    "verify_pack",
]

FORMAT_NAME = "torch-tricks-pack"
FORMAT_VERSION = 1
STORAGES = ("encoded", "jpeg", "raw")
INDEX_DTYPE = np.dtype(
    [
        ("shard", "<u4"),
        ("offset", "<u8"),
        ("length", "<u8"),
        ("label", "<i8"),
        ("crc32", "<u4"),
        ("height", "<u4"),
        ("width", "<u4"),
        ("channels", "<u4"),
    ]
)
#: LMDB sample record header: label, crc32, height, width, channels (then the bytes).
RECORD = struct.Struct("<qIIII")

HEADER, INDEX, NAMES, SKIPPED, PROGRESS = "header.json", "index.npy", "names.txt", "skipped.txt", "progress.json"
INDEX_PART, NAMES_PART, LOCK = "index.part", "names.part", ".pack.lock"
LMDB_FILES = ("data.mdb", "lock.mdb")
_LMDB_DBS = 4


class PackError(UserError):
    """A pack that is incomplete, damaged, or not a pack at all."""


class CorruptSampleError(PackError):
    """A sample whose stored bytes no longer match their checksum."""


# --------------------------------------------------------------------------- public API


def detect_format(path: str | os.PathLike[str]) -> str:
    """``native`` or ``lmdb`` for a pack directory (complete or not); a :class:`PackError` otherwise."""
    p = Path(path)
    if (p / HEADER).is_file() or (p / PROGRESS).is_file():
        return "native"
    if (p / "data.mdb").is_file():
        return "lmdb"
    if p.is_file() and p.name == "data.mdb":
        return "lmdb"
    if not p.exists():
        raise PackError(f"{str(p)!r} does not exist: give the directory that `torch-tricks pack` wrote")
    raise PackError(f"{str(p)!r} is not a pack (no {HEADER} or data.mdb): create one with `torch-tricks pack SRC {p}`")


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete pack (its header was written); never raises for a missing one."""
    try:
        fmt = detect_format(path)
        if fmt == "native":
            _read_native_header(Path(path))
        else:
            LMDBReader(path)
        return True
    except UserError:
        return False


def open_reader(path: str | os.PathLike[str], *, verify: bool | str = True) -> "NativeReader | LMDBReader":
    """A reader for the pack at ``path``, native or LMDB (detected)."""
    fmt = detect_format(path)
    return NativeReader(path, verify=verify) if fmt == "native" else LMDBReader(path, verify=verify)


def verify_pack(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a whole pack: every sample's crc32, and (native) every shard's and the index's sha256.

    Returns ``{"format", "count", "bytes"}``; raises :class:`CorruptSampleError` /
    :class:`PackError` naming the first damaged sample or file. Reads everything once,
    so it takes as long as reading the data set: run it after copying a pack.
    """
    reader = open_reader(path, verify=True)
    total = 0
    for i in range(len(reader)):  # first, so that an error names the sample
        total += len(reader.read(i))
    if isinstance(reader, NativeReader):
        p = Path(path)
        for entry in [reader.header["index"], *reader.header["shards"]]:
            digest = _sha256_file(p / entry["file"])
            if digest != entry["sha256"]:
                raise PackError(
                    f"{entry['file']} in {p} fails its sha256 check: the pack is damaged; re-pack or restore it"
                )
    return {"format": reader.fmt, "count": len(reader), "bytes": total}


# --------------------------------------------------------------------------- writers


class _WriterBase:
    """What both writers share: the directory lock, resume bookkeeping, skipped samples."""

    fmt = ""

    def __init__(self, path: str | os.PathLike[str], *, storage: str, fingerprint: str, overwrite: bool) -> None:
        if storage not in STORAGES:
            raise UserError(f"unknown storage {storage!r}: choose one of {', '.join(STORAGES)}")
        self.path = Path(path)
        self.storage = storage
        self.fingerprint = fingerprint
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"{str(self.path)!r} is a file: give a directory for the pack")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = _lock_dir(self.path)
        try:
            _check_only_pack_files(self.path)
            if not overwrite and _has_complete(self.path):
                raise UserError(
                    f"{str(self.path)!r} already holds a complete pack: delete it, choose another directory, "
                    "or pass overwrite=True (--overwrite)"
                )
        except BaseException:
            _WriterBase.close(self)
            raise
        self.count = 0  # samples written so far (committed or not)
        self.source_pos = 0  # the next source position to process; where a resumed run starts
        self.resumed_from = 0  # samples already in the pack when this writer opened it
        self.skipped: list[tuple[str, str]] = []
        self._shape: tuple[int, int, int] | None = None  # the one shape all samples share so far
        self._mixed = False  # samples of different shapes were added
        self.max_label = -1  # the largest label written (classes for sources that have no class list)

    def _note(self, label: int, shape: tuple[int, int, int]) -> None:
        self.max_label = max(self.max_label, int(label))
        shape = tuple(int(s) for s in shape)
        if self._shape is None and not self._mixed:
            self._shape = shape
        elif shape != self._shape:
            self._shape, self._mixed = None, True

    def skip(self, name: str, reason: str) -> None:
        """Record a source sample that could not be read (kept in the progress and in skipped.txt)."""
        self.skipped.append((name, " ".join(reason.split())))

    def close(self) -> None:
        """Release the directory lock (files are closed by the subclasses)."""
        if getattr(self, "_lock_fd", None) is not None:
            _unlock_dir(self._lock_fd)
            self._lock_fd = None

    def _progress_state(self, source_pos: int) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "source_pos": source_pos,
            "count": self.count,
            "skipped": self.skipped,
            "shape": self._shape,
            "mixed": self._mixed,
            "max_label": self.max_label,
        }

    def _restore_common(self, state: dict[str, Any]) -> None:
        self.source_pos = int(state["source_pos"])
        self.count = self.resumed_from = int(state["count"])
        self.skipped = [tuple(s) for s in state["skipped"]]
        self._shape = tuple(state["shape"]) if state.get("shape") else None
        self._mixed = bool(state.get("mixed"))
        self.max_label = int(state.get("max_label", -1))

    def _header(self, classes: Sequence[str], meta: dict[str, Any]) -> dict[str, Any]:
        shape = list(self._shape) if self._shape is not None and not self._mixed else None
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "layout": self.fmt,
            "count": self.count,
            "classes": list(classes),
            "storage": self.storage,
            "shape": shape,
            "skipped": len(self.skipped),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "meta": meta,
        }

    def _write_skipped(self) -> None:
        with atomic_path(self.path / SKIPPED) as tmp:
            tmp.write_text("".join(f"{_one_line(n)}\t{r}\n" for n, r in self.skipped), encoding="utf-8")


class NativeWriter(_WriterBase):
    """Append samples to shard files; :meth:`finish` writes the index and, last, the header.

    ``commit(source_pos)`` makes everything added so far durable and resumable. Opening a
    directory that holds a partial pack with the same ``fingerprint`` (source + options)
    resumes it when ``resume`` is true; otherwise the partial pack is discarded.
    """

    fmt = "native"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage: str,
        fingerprint: str = "",
        resume: bool = True,
        overwrite: bool = False,
        shard_bytes: int = 1 << 30,
    ) -> None:
        if shard_bytes < 1:
            raise UserError(f"shard_bytes must be positive, not {shard_bytes}")
        super().__init__(path, storage=storage, fingerprint=fingerprint, overwrite=overwrite)
        self.shard_bytes = int(shard_bytes)
        self._shards: list[dict[str, Any]] = []  # {"file", "bytes", "sha256" (None while open)}
        self._fh: Any = None
        self._hash: Any = None
        state = self._load_progress() if resume else None
        if state is None:
            self._clean()
        self._index_fh = open(self.path / INDEX_PART, "ab")
        self._names_fh = open(self.path / NAMES_PART, "ab")
        if self._shards:
            last = self._shards[-1]
            self._fh = open(self.path / last["file"], "ab")
            self._hash = hashlib.sha256()
            with open(self.path / last["file"], "rb") as f:  # rebuild the open shard's running hash
                for block in iter(lambda: f.read(1 << 24), b""):
                    self._hash.update(block)
        if state is None:
            self.commit(0)  # from now on the directory reads as an incomplete (resumable) pack

    def add(self, data: Any, label: int, shape: tuple[int, int, int], name: str = "") -> int:
        """Append one sample's stored bytes; returns its index in the pack."""
        view = memoryview(data).cast("B")
        n = len(view)
        if self._fh is None or (self._shards[-1]["bytes"] > 0 and self._shards[-1]["bytes"] + n > self.shard_bytes):
            self._next_shard()
        shard = self._shards[-1]
        rec = np.zeros((), dtype=INDEX_DTYPE)
        rec["shard"], rec["offset"], rec["length"], rec["label"] = len(self._shards) - 1, shard["bytes"], n, label
        rec["crc32"] = zlib.crc32(view)
        rec["height"], rec["width"], rec["channels"] = shape
        self._fh.write(view)
        self._hash.update(view)
        shard["bytes"] += n
        self._index_fh.write(rec.tobytes())
        self._names_fh.write((_one_line(name) + "\n").encode("utf-8", "surrogateescape"))
        self._note(label, shape)
        self.count += 1
        return self.count - 1

    def commit(self, source_pos: int) -> None:
        """Make all samples added so far durable; a later run resumes from ``source_pos``."""
        for fh in (self._fh, self._index_fh, self._names_fh):
            if fh is not None:
                fh.flush()
                os.fsync(fh.fileno())
        state = self._progress_state(source_pos)
        state["shards"] = [dict(s) for s in self._shards]
        state["index_bytes"] = self._index_fh.tell()
        state["names_bytes"] = self._names_fh.tell()
        with atomic_path(self.path / PROGRESS) as tmp:
            tmp.write_text(json.dumps(state), encoding="utf-8")
        self.source_pos = source_pos

    def finish(self, classes: Sequence[str], meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write index.npy, names.txt, skipped.txt, then header.json (atomically, last); returns the header."""
        if self._fh is not None:
            self._close_shard()
        for fh in (self._index_fh, self._names_fh):
            fh.flush()
            os.fsync(fh.fileno())
        self._index_fh.close()
        self._names_fh.close()
        index = np.fromfile(self.path / INDEX_PART, dtype=INDEX_DTYPE)
        if len(index) != self.count:
            raise PackError(f"index.part holds {len(index)} records for {self.count} samples: pack again with resume=False")
        with atomic_path(self.path / INDEX) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, index)
                f.flush()
                os.fsync(f.fileno())
        with atomic_path(self.path / NAMES) as tmp:  # a copy: names.part stays resumable until the header exists
            shutil.copyfile(self.path / NAMES_PART, tmp)
        self._write_skipped()
        header = self._header(classes, meta or {})
        header["index"] = {"file": INDEX, "sha256": _sha256_file(self.path / INDEX)}
        header["shards"] = [dict(s) for s in self._shards]
        fsync_dir(self.path)
        with atomic_path(self.path / HEADER) as tmp:  # the commit point of the whole pack
            tmp.write_text(json.dumps(header, indent=1), encoding="utf-8")
        fsync_dir(self.path)
        for leftover in (PROGRESS, INDEX_PART, NAMES_PART):
            (self.path / leftover).unlink(missing_ok=True)
        self.close()
        return header

    def close(self) -> None:
        """Close the files without finishing (what was committed stays resumable)."""
        for fh in (getattr(self, "_fh", None), getattr(self, "_index_fh", None), getattr(self, "_names_fh", None)):
            if fh is not None and not fh.closed:
                fh.close()
        super().close()

    # internals

    def _next_shard(self) -> None:
        if self._fh is not None:
            self._close_shard()
        name = f"shard-{len(self._shards):05d}.bin"
        self._shards.append({"file": name, "bytes": 0, "sha256": None})
        self._fh = open(self.path / name, "wb")
        self._hash = hashlib.sha256()

    def _close_shard(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        self._shards[-1]["sha256"] = self._hash.hexdigest()

    def _load_progress(self) -> dict[str, Any] | None:
        """Truncate back to the last commit and return its state; None if there is nothing to resume."""
        try:
            state = json.loads((self.path / PROGRESS).read_text(encoding="utf-8"))
            if state.get("fingerprint") != self.fingerprint:
                return None
            shards = state["shards"]
            for s in shards:
                if (self.path / s["file"]).stat().st_size < s["bytes"]:
                    return None
            for name, size in ((INDEX_PART, state["index_bytes"]), (NAMES_PART, state["names_bytes"])):
                if (self.path / name).stat().st_size < size:
                    return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        for s in shards:
            os.truncate(self.path / s["file"], s["bytes"])
        for extra in self.path.glob("shard-*.bin"):
            if extra.name not in {s["file"] for s in shards}:
                extra.unlink()
        os.truncate(self.path / INDEX_PART, state["index_bytes"])
        os.truncate(self.path / NAMES_PART, state["names_bytes"])
        self._shards = [dict(s) for s in shards]
        if self._shards:
            self._shards[-1]["sha256"] = None  # still open: appended to
        self._restore_common(state)
        return state

    def _clean(self) -> None:
        _remove_pack_files(self.path)


class LMDBWriter(_WriterBase):
    """The same samples in an LMDB environment (directory with ``data.mdb``).

    Samples are buffered and written in one transaction per :meth:`commit`; the header
    goes in the last transaction. ``map_size`` starts at ``map_size`` and doubles on
    ``MapFullError`` (the transaction is retried), so it never has to be guessed.
    """

    fmt = "lmdb"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage: str,
        fingerprint: str = "",
        resume: bool = True,
        overwrite: bool = False,
        map_size: int = 1 << 30,
    ) -> None:
        lmdb = _require_lmdb()
        super().__init__(path, storage=storage, fingerprint=fingerprint, overwrite=overwrite)
        self._pending: list[tuple[bytes, bytes, bytes, bytes]] = []
        self.pending_bytes = 0
        env = self._open(lmdb, map_size)
        state = None
        if resume:
            with env.begin(db=self._meta) as txn:
                raw = txn.get(b"progress")
            if raw is not None:
                state = json.loads(bytes(raw))
                if state.get("fingerprint") != self.fingerprint:
                    state = None
        if state is None:
            env.close()
            self._clean()
            env = self._open(lmdb, map_size)
        else:
            self._restore_common(state)
        self._env = env
        if state is None:
            self.commit(0)

    def _open(self, lmdb: Any, map_size: int) -> Any:
        _close_reader_env(self.path)
        env = lmdb.open(str(self.path), map_size=map_size, max_dbs=_LMDB_DBS, subdir=True, meminit=False)
        if env.info()["map_size"] < map_size:
            env.set_mapsize(map_size)
        self._samples = env.open_db(b"samples")
        self._names = env.open_db(b"names")
        self._index = env.open_db(b"index")
        self._meta = env.open_db(b"meta")
        return env

    def add(self, data: Any, label: int, shape: tuple[int, int, int], name: str = "") -> int:
        """Buffer one sample (written at the next :meth:`commit`); returns its index in the pack."""
        view = memoryview(data).cast("B")
        crc = zlib.crc32(view)
        key = b"%010d" % self.count
        rec = np.zeros((), dtype=INDEX_DTYPE)
        rec["length"], rec["label"], rec["crc32"] = len(view), label, crc
        rec["height"], rec["width"], rec["channels"] = shape
        value = RECORD.pack(int(label), crc, *(int(s) for s in shape)) + bytes(view)
        self._pending.append((key, value, _one_line(name).encode("utf-8", "surrogateescape"), rec.tobytes()))
        self.pending_bytes += len(value)
        self._note(label, shape)
        self.count += 1
        return self.count - 1

    def commit(self, source_pos: int) -> None:
        """Write the buffered samples and the progress in one transaction."""
        state = json.dumps(self._progress_state(source_pos)).encode()

        def write(txn: Any) -> None:
            for key, value, name, rec in self._pending:
                if not txn.put(key, value, db=self._samples, append=True):
                    raise PackError(f"LMDB refused sample key {key!r} in {self.path}: pack again with resume=False")
                txn.put(key, name, db=self._names, append=True)
                txn.put(key, rec, db=self._index, append=True)
            txn.put(b"progress", state, db=self._meta)

        self._write_txn(write)
        self._pending.clear()
        self.pending_bytes = 0
        self.source_pos = source_pos

    def finish(self, classes: Sequence[str], meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Commit what is buffered, then write the index blob and the header in one last transaction."""
        if self._pending:
            self.commit(self.source_pos)
        with self._env.begin(db=self._index) as txn:
            blob = b"".join(bytes(v) for _, v in txn.cursor())
        index = np.frombuffer(blob, dtype=INDEX_DTYPE)
        if len(index) != self.count:
            raise PackError(f"the LMDB index holds {len(index)} records for {self.count} samples: "
                            "pack again with resume=False")
        self._write_skipped()
        header = self._header(classes, meta or {})

        def write(txn: Any) -> None:
            txn.put(b"index", blob, db=self._meta)
            txn.put(b"header", json.dumps(header).encode(), db=self._meta)  # the commit point of the whole pack
            txn.delete(b"progress", db=self._meta)

        self._write_txn(write)
        self._env.sync(True)
        self.close()
        return header

    def close(self) -> None:
        """Close the environment without finishing (committed samples stay resumable)."""
        env = getattr(self, "_env", None)
        if env is not None:
            env.close()
            self._env = None
        super().close()

    def _write_txn(self, fn: Any) -> None:
        lmdb = _require_lmdb()
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    fn(txn)
                return
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)

    def _clean(self) -> None:
        _remove_pack_files(self.path)


# --------------------------------------------------------------------------- readers


class _ReaderBase:
    """What both readers share: header fields, the index, per-process lazy handles."""

    fmt = ""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool | str) -> None:
        if verify not in (True, False, "once"):
            raise UserError(f"verify must be True, False or 'once', not {verify!r}")
        self.path = Path(path)
        self.verify = verify
        self._verified: np.ndarray | None = None  # verify="once": samples this process has checked
        self.header: dict[str, Any] = {}
        self._pid: int | None = None
        self._handles: dict[str, Any] | None = None

    @property
    def storage(self) -> str:
        return self.header["storage"]

    @property
    def classes(self) -> list[str]:
        return list(self.header["classes"])

    @property
    def shape(self) -> tuple[int, int, int] | None:
        """The shape every sample has (raw packs made with ``raw_size``), else None."""
        s = self.header.get("shape")
        return tuple(s) if s else None

    def __len__(self) -> int:
        return int(self.header["count"])

    @property
    def index(self) -> np.ndarray:
        """The :data:`INDEX_DTYPE` records (memory-mapped for native packs)."""
        return self._state()["index"]

    @property
    def labels(self) -> np.ndarray:
        """Every sample's label, from the index alone (no sample bytes are read)."""
        return np.array(self.index["label"], dtype=np.int64)  # a contiguous copy, detached from the map

    def read_many(self, indices: Iterable[int]) -> list[np.ndarray]:
        """Stored bytes of several samples (each verified like :meth:`read`)."""
        return [self.read(i) for i in indices]

    def read_into(self, indices: Sequence[int], out: np.ndarray) -> None:
        """Copy the stored bytes of ``indices`` into the rows of ``out`` (shape ``(B, nbytes)``)."""
        for k, i in enumerate(indices):
            out[k] = self.read(i)

    def _state(self) -> dict[str, Any]:
        """Handles for this process: opened on first use, re-opened after a fork.

        Opened under a lock: loader threads reach this together, and besides opening
        everything twice, CPython 3.11 fails parsing (``np.load``'s header) in two threads
        at once ("AST constructor recursion depth mismatch").
        """
        pid = os.getpid()
        handles = self._handles
        if self._pid == pid and handles is not None:
            return handles
        with _OPEN_LOCK:
            if self._pid != pid or self._handles is None:
                self._handles = self._open_handles()
                self._pid = pid
            return self._handles

    def _open_handles(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"], state["_pid"] = None, None  # maps and environments never travel to workers
        return state

    def _corrupt(self, i: int, where: str, detail: str) -> CorruptSampleError:
        return CorruptSampleError(
            f"sample {i} ({self.name(i)}) in {where} {detail}: the pack is damaged; "
            "re-pack it or restore it from a copy (verify_pack() checks every sample)"
        )

    def name(self, i: int) -> str:
        raise NotImplementedError

    def _must_check(self, i: int) -> bool:
        """Whether sample ``i``'s checksum is to be checked on this read (then :meth:`_checked`)."""
        if self.verify != "once":
            return bool(self.verify)
        if self._verified is None:
            self._verified = np.zeros(len(self), dtype=bool)
        return not self._verified[i]

    def _checked(self, i: int) -> None:
        if self._verified is not None:
            self._verified[i] = True

    def _check_index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} out of range for a pack of {n}")
        return i + n if i < 0 else i


class NativeReader(_ReaderBase):
    """Random access to a native pack: ``read(i)`` is a zero-copy slice of a memory-mapped shard."""

    fmt = "native"

    def __init__(self, path: str | os.PathLike[str], *, verify: bool | str = True) -> None:
        super().__init__(path, verify=verify)
        self.header = _read_native_header(self.path)
        for s in self.header["shards"]:
            size = (self.path / s["file"]).stat().st_size if (self.path / s["file"]).exists() else -1
            if size != s["bytes"]:
                raise PackError(
                    f"{s['file']} in {self.path} is {size} bytes, the header says {s['bytes']}: "
                    "the pack is damaged or was modified; re-pack it or restore it"
                )
        index = np.load(self.path / INDEX, mmap_mode="r")
        if index.dtype != INDEX_DTYPE or index.shape != (len(self),):
            raise PackError(f"{INDEX} in {self.path} does not match its header: re-pack it")
        del index  # opened again, lazily, in whichever process reads

    def read(self, i: int) -> np.ndarray:
        """Sample ``i``'s stored bytes as a read-only uint8 view; checks its crc32 when ``verify``."""
        i = self._check_index(i)
        st = self._state()
        return self._slice(st, i, st["index"][i].item())

    def read_into(self, indices: Sequence[int], out: np.ndarray) -> None:
        """Copy the stored bytes of ``indices`` into the rows of ``out``, checked as ``verify`` says.

        Releases the GIL while it copies, so loader threads copy in parallel (see :meth:`_take`
        for how fixed-size rows are copied in one call).
        """
        st = self._state()
        idx = np.asarray(indices, dtype=np.int64)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices out of range for a pack of {len(self)}")
        recs = st["index"][idx]
        if self._take(st, idx, recs, out):
            return
        for k, (i, rec) in enumerate(zip(idx.tolist(), recs.tolist())):
            out[k] = self._slice(st, i, rec)  # a numpy copy per row: the GIL is released for each

    def _take(self, st: dict[str, Any], idx: np.ndarray, recs: np.ndarray, out: np.ndarray) -> bool:
        """Copy equal-size samples of one shard in one call: the GIL released once, not once per
        row. In the main thread ``torch.index_select``, whose own threads split the rows (1.5x
        ``np.take`` on 2 cores); in any other thread (ThreadLoader's, each filling a batch of its
        own) one ``np.take`` (1.1-1.3x per-row copies): an index_select there starts an OpenMP
        team per calling thread, and those teams fight over the cores (4x slower, measured).

        Only when no checksum is due on every read (``verify=False`` or ``"once"``: samples
        read for the first time are checked here first), every sample of the pack is ``n``
        bytes at an offset that is a multiple of ``n`` (a raw pack of one shape: a shard is
        then an ``(count, n)`` array) and the samples all lie in one shard. Returns whether it did.
        ``mode="clip"`` matters: numpy's default ``"raise"`` first copies ``out`` to a
        temporary and back (half the speed); the rows are checked to be in range here.
        """
        n = out.shape[1] if out.ndim == 2 else 0
        if not len(idx) or not n or self.verify is True or st["row_bytes"] != n or out.dtype != np.uint8 \
                or not out.flags.c_contiguous:
            return False
        shards = recs["shard"]
        shard = int(shards[0])
        if len(self.header["shards"]) > 1 and (shards != shard).any():
            return False
        if self.verify == "once":
            self._must_check(int(idx[0]))  # creates the bitmap
            for k in np.flatnonzero(~self._verified[idx]).tolist():  # first reads: check just those
                self._slice(st, int(idx[k]), recs[k].tolist())
        table = st["tables"].get(shard)
        if table is None:
            m = self._shard_map(st, shard)
            table = st["tables"][shard] = m[: (len(m) // n) * n].reshape(-1, n)
        rows = (recs["offset"] // n).astype(np.int64)
        if rows.max() >= len(table):
            bad = int(np.argmax(rows >= len(table)))
            raise self._corrupt(int(idx[bad]), self.header["shards"][shard]["file"], "is cut short")
        if threading.current_thread() is threading.main_thread():
            import torch  # here torch's own threads split the rows: 1.5x np.take on 2 cores

            torch.index_select(_as_tensor(table), 0, torch.from_numpy(rows), out=torch.from_numpy(out))
        else:  # a loader thread: an OpenMP team per calling thread would fight the other threads' teams
            np.take(table, rows, axis=0, out=out, mode="clip")
        return True

    def _shard_map(self, st: dict[str, Any], shard: int) -> np.ndarray:
        """Shard ``shard`` memory-mapped as uint8, mapped on first use in this process."""
        m = st["maps"].get(shard)
        if m is None:
            m = st["maps"][shard] = _map_file(self.path / self.header["shards"][shard]["file"])
        return m

    def _slice(self, st: dict[str, Any], i: int, rec: tuple) -> np.ndarray:
        shard, off, n, _, crc = rec[:5]
        m = self._shard_map(st, shard)
        buf = m[off : off + n]
        if len(buf) != n:
            raise self._corrupt(i, self.header["shards"][shard]["file"], "is cut short")
        if self._must_check(i):
            if zlib.crc32(buf) != crc:
                raise self._corrupt(
                    i, self.header["shards"][shard]["file"], f"(bytes {off}-{off + n}) fails its crc32 check"
                )
            self._checked(i)
        return buf

    def name(self, i: int) -> str:
        try:
            with open(self.path / NAMES, encoding="utf-8", errors="surrogateescape") as f:
                for k, line in enumerate(f):
                    if k == i:
                        return line.rstrip("\n")
        except OSError:
            pass
        return f"#{i}"

    def _open_handles(self) -> dict[str, Any]:
        # plain ndarray views of the maps: slicing an np.memmap costs several times more
        index = np.load(self.path / INDEX, mmap_mode="r").view(np.ndarray)
        return {"index": index, "maps": {}, "tables": {}, "row_bytes": _row_bytes(index)}


class LMDBReader(_ReaderBase):
    """Random access to an LMDB pack; the environment is opened lazily in each process."""

    fmt = "lmdb"

    def __init__(self, path: str | os.PathLike[str], *, verify: bool | str = True) -> None:
        super().__init__(path, verify=verify)
        p = self.path.parent if self.path.name == "data.mdb" else self.path
        self.path = p
        env, dbs = _reader_env(p)
        with env.begin(db=dbs["meta"]) as txn:
            header = txn.get(b"header")
            progress = txn.get(b"progress")
            if header is None:
                done = json.loads(bytes(progress))["count"] if progress is not None else 0
                raise PackError(
                    f"{str(p)!r} is an incomplete LMDB pack (interrupted after {done} samples): "
                    "run pack again with the same arguments to resume it"
                )
            self.header = json.loads(bytes(header))
            self._index = np.frombuffer(bytes(txn.get(b"index")), dtype=INDEX_DTYPE)
            self._crcs = self._index["crc32"].copy()
        _check_version(self.header, p)

    def read(self, i: int) -> np.ndarray:
        """Sample ``i``'s stored bytes (a copy); checks its crc32 when ``verify``."""
        return self.read_many([i])[0]

    def read_many(self, indices: Iterable[int]) -> list[np.ndarray]:
        """Several samples in one read transaction."""
        st = self._state()
        out = []
        with st["env"].begin(db=st["samples"], buffers=True) as txn:
            for i in indices:
                out.append(np.frombuffer(self._payload(txn, i), dtype=np.uint8).copy())
        return out

    def read_into(self, indices: Sequence[int], out: np.ndarray) -> None:
        st = self._state()
        with st["env"].begin(db=st["samples"], buffers=True) as txn:
            for k, i in enumerate(indices):
                out[k] = np.frombuffer(self._payload(txn, i), dtype=np.uint8)

    def view(self, i: int) -> memoryview:
        """Sample ``i``'s stored bytes without a copy (checked as ``verify`` says), for a caller that
        decodes them at once (:meth:`~torch_tricks.data.dataset.PackedDataset.load_into`, which
        :class:`~torch_tricks.data.threads.ThreadLoader` calls).

        Read in a transaction this thread keeps open for as long as it lives, instead of one
        transaction and one copy per sample (:meth:`read`: 5.6 us against 1.6 us for a native
        pack's read, on one thread, and more with two loader threads sharing the GIL); measured,
        ThreadLoader read a crop-ready JPEG pack in LMDB at 0.95x the same pack in native shards
        that way, and at 0.99x through this. A pack is never written while it is read, so the
        open snapshot is the pack. The bytes stay valid while this thread's transaction does
        (until the thread ends or the reader is closed).
        """
        st = self._state()
        local = st["local"]
        txn = getattr(local, "txn", None)
        if txn is None:
            txn = local.txn = st["env"].begin(db=st["samples"], buffers=True)
        return self._payload(txn, i)

    def name(self, i: int) -> str:
        st = self._state()
        with st["env"].begin(db=st["names"]) as txn:
            v = txn.get(b"%010d" % i)
        return bytes(v).decode("utf-8", "surrogateescape") if v is not None else f"#{i}"

    def _payload(self, txn: Any, i: int) -> memoryview:
        i = self._check_index(i)
        v = txn.get(b"%010d" % i)
        if v is None:
            raise self._corrupt(i, str(self.path / "data.mdb"), "is missing")
        payload = v[RECORD.size :]
        if self._must_check(i):
            crc = RECORD.unpack_from(v)[1]
            if zlib.crc32(payload) != crc or crc != self._crcs[i]:
                raise self._corrupt(i, str(self.path / "data.mdb"), "fails its crc32 check")
            self._checked(i)
        return payload

    def _open_handles(self) -> dict[str, Any]:
        env, dbs = _reader_env(self.path)
        return {"env": env, "index": self._index, "local": threading.local(), **dbs}  # local: view()'s transactions


# py-lmdb allows one Environment per file per process (and remembers the parent's after a
# fork), so readers of the same pack in a process share one, a writer closes it first, and
# a forked child closes the one it inherited, unused, before opening its own. Closing is
# safe there because reader environments are lock=False: no lock table is shared, and
# closing only unmaps and closes the child's copies of the map and descriptor.
_ENVS: dict[str, tuple[int, Any, dict[str, Any]]] = {}


def _reader_env(path: Path) -> tuple[Any, dict[str, Any]]:
    lmdb = _require_lmdb()
    key, pid = os.path.realpath(path), os.getpid()
    hit = _ENVS.get(key)
    if hit is not None:
        if hit[0] == pid:
            return hit[1], hit[2]
        del _ENVS[key]
        hit[1].close()  # opened before a fork: never used here, only closed
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_dbs=_LMDB_DBS, subdir=True)
    except lmdb.Error as exc:
        raise PackError(f"{str(path)!r} is not a readable LMDB pack ({exc}): re-pack it") from None
    try:
        dbs = {n: env.open_db(n.encode(), create=False) for n in ("samples", "names", "meta")}
    except lmdb.Error:
        env.close()
        raise PackError(f"{str(path)!r} is an incomplete LMDB pack (nothing committed yet): "
                        "run pack again with the same arguments, or delete it") from None
    _ENVS[key] = (pid, env, dbs)
    return env, dbs


def _close_reader_env(path: Path) -> None:
    """Close this process's read-only environment for ``path`` (before writing to it)."""
    hit = _ENVS.pop(os.path.realpath(path), None)
    if hit is not None:
        hit[1].close()


# --------------------------------------------------------------------------- helpers


_OPEN_LOCK = threading.RLock()  # readers open their files one thread at a time (see _ReaderBase._state)


def _as_tensor(a: np.ndarray) -> Any:
    """A read-only array (a memory map) as a tensor, for torch's copy kernels: torch never writes to it."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(a)


def _row_bytes(index: np.ndarray) -> int:
    """``n`` when every sample is ``n`` bytes at an offset that is a multiple of ``n`` (a shard is then a
    table of rows: what raw packs of one shape are), else 0. Read once per process: ~1 ms per 100k samples."""
    if not len(index):
        return 0
    n = int(index["length"][0])
    if n <= 0:
        return 0
    for s in range(0, len(index), 1 << 20):  # in slices: no full-size temporaries for huge packs
        part = index[s : s + (1 << 20)]
        if not ((part["length"] == n).all() and (part["offset"] % n == 0).all()):
            return 0
    return n


def _map_file(path: Path) -> np.ndarray:
    """A read-only uint8 array over the whole file, memory-mapped (the descriptor is closed at once)."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def _read_native_header(path: Path) -> dict[str, Any]:
    hp = path / HEADER
    if not hp.is_file():
        if (path / PROGRESS).is_file():
            try:
                done = json.loads((path / PROGRESS).read_text(encoding="utf-8"))["count"]
            except (OSError, ValueError, KeyError):
                done = "some"
            raise PackError(
                f"{str(path)!r} is an incomplete pack (interrupted after {done} samples): "
                "run pack again with the same arguments to resume it"
            )
        raise PackError(f"{str(path)!r} is not a pack (no {HEADER}): create one with `torch-tricks pack SRC {path}`")
    try:
        header = json.loads(hp.read_text(encoding="utf-8"))
    except ValueError:
        raise PackError(f"{hp} is not valid JSON: the pack is damaged; re-pack it") from None
    _check_version(header, path)
    return header


def _check_version(header: dict[str, Any], path: Path) -> None:
    if header.get("format") != FORMAT_NAME:
        raise PackError(f"{str(path)!r} is not a torch-tricks pack (format {header.get('format')!r})")
    if int(header.get("version", 0)) > FORMAT_VERSION:
        raise PackError(
            f"{str(path)!r} is pack format version {header['version']}, newer than this torch-tricks reads "
            f"({FORMAT_VERSION}): upgrade torch-tricks"
        )


def _has_complete(path: Path) -> bool:
    if (path / HEADER).is_file():
        return True
    if (path / "data.mdb").is_file():
        try:
            LMDBReader(path)
            return True
        except UserError:
            return False
    return False


def _is_ours(name: str) -> bool:
    """Shards, LMDB files and the temp files atomic_path leaves behind when killed."""
    return (
        (name.startswith("shard-") and name.endswith(".bin"))
        or name in LMDB_FILES
        or (name.startswith(".") and name.endswith(".tmp"))
    )


def _remove_pack_files(path: Path) -> None:
    """Delete every file a pack of either format (or an interrupted one) consists of; nothing else."""
    for p in path.iterdir():
        if p.name in (HEADER, INDEX, NAMES, SKIPPED, PROGRESS, INDEX_PART, NAMES_PART) or _is_ours(p.name):
            p.unlink()


def _check_only_pack_files(path: Path) -> None:
    known = {HEADER, INDEX, NAMES, SKIPPED, PROGRESS, INDEX_PART, NAMES_PART, LOCK}
    strangers = sorted(p.name for p in path.iterdir() if p.name not in known and not _is_ours(p.name))
    if strangers:
        raise UserError(
            f"{str(path)!r} holds files that are not part of a pack ({', '.join(strangers[:3])}...): "
            "choose a new or empty directory for the pack"
        )


def _lock_dir(path: Path) -> int:
    """An exclusive lock on the pack directory for this writer (released by the OS if killed).

    Why ``lockf`` (a POSIX record lock) and not ``flock``: a ``flock`` lock belongs to the open
    file, which forked packing workers inherit, so a killed writer's lock outlived it for as
    long as any worker did; a record lock belongs to the process alone. Record locks do not
    exclude the owning process itself, hence the in-process set.
    """
    import fcntl

    key = str(path.resolve())
    if key in _LOCKED:
        raise UserError(f"another writer is packing into {str(path)!r}: close it first or choose another directory")
    fd = os.open(path / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise UserError(f"another process is packing into {str(path)!r}: wait for it or choose another directory") \
            from None
    _LOCKED[key] = fd
    return fd


def _unlock_dir(fd: int) -> None:
    for key, held in list(_LOCKED.items()):
        if held == fd:
            del _LOCKED[key]
    os.close(fd)  # closing releases the record lock


_LOCKED: dict[str, int] = {}  # pack directories this process holds a writer lock on -> the lock's fd


def _require_lmdb() -> Any:
    return require("lmdb", "data", "the LMDB format")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _one_line(text: str) -> str:
    return str(text).replace("\n", " ").replace("\r", " ").replace("\t", " ")
