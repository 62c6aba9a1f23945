"""Token rows of different lengths for fine-tuning a causal LM: a saved data set, JSONL or Parquet.

Fine-tuning data comes as rows (a conversation, a document), not as one stream of tokens:
a data set written by Hugging Face ``datasets``' ``save_to_disk`` (a folder; ``FOLDER:SPLIT``
picks a split of a ``DatasetDict``), a ``.jsonl`` file of one JSON object a line, or a
``.parquet`` file, each with an ``input_ids`` column (lists of ids) or a ``text`` column that a
local tokenizer folder turns into ids (``input_ids`` wins where both exist).

:func:`load_token_rows` reads every row once, up front, so that bad data is found before the
first step rather than at the step that reads it, and so that every row's length is known to
the samplers that group rows by length (:mod:`torch_tricks.data.token_batches`). Nothing is
dropped silently: empty rows are left out and counted, rows longer than the model's positions
are refused (or cut, with ``truncate``, and counted), and :meth:`TokenRows.summary` says so.
The ids are kept as one flat array with row offsets: a list of tensors would cost an object
per row.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from torch_tricks._optional import require
from torch_tricks.errors import UserError, one_line

__all__ = ["TokenRows", "TokenStats", "load_token_rows", "is_token_set", "SET_FORM"]

SET_FORM = ("a data set saved with datasets' save_to_disk (a folder; FOLDER:SPLIT picks a split), FILE.jsonl (one "
            "JSON object a line) or FILE.parquet, with an input_ids column (lists of token ids) or a text column and "
            "--tokenizer")
SUFFIXES = (".jsonl", ".parquet")
_BATCH = 4096  # rows read (and tokenized) at a time
_NO_TOKENIZER = "give --tokenizer PATH, a local tokenizer folder (tokenizer= in Python)"


@dataclass(frozen=True)
class TokenStats:
    """What reading a token set found: every row read is kept, or counted as left out or cut."""

    source: str  # the file or folder, its form and the column read
    read: int  # rows read
    kept: int  # rows kept (read minus empty)
    empty: int  # empty rows (no ids, no text, or null), left out
    truncated: int  # rows cut to ``cut_to`` tokens
    tokens: int  # tokens kept
    longest: int  # the longest row kept, in tokens
    cut_to: int | None = None  # the length rows were cut to (``truncate``), else None


class TokenRows(Dataset):
    """Rows of token ids of different lengths: sample ``i`` is ``{"input_ids": 1-D long tensor}``.

    ``lengths`` gives every row's length without reading the rows (for length-grouped batches);
    ``stats`` and :meth:`summary` say what was read, kept, left out and cut. Built by
    :func:`load_token_rows`; ``ids`` holds every row's ids one after another, ``offsets``
    (one more than the rows) where each row starts.
    """

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, stats: TokenStats) -> None:
        self.ids, self.offsets, self.stats = ids, offsets, stats

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        row = self.ids[self.offsets[i]: self.offsets[i + 1]]
        return {"input_ids": torch.from_numpy(row.astype(np.int64))}

    @property
    def lengths(self) -> list[int]:
        """Every row's length in tokens, in order."""
        return np.diff(self.offsets).tolist()

    def summary(self) -> str:
        """One line: rows read and kept, tokens, the longest row, and what was left out or cut."""
        s = self.stats
        text = f"{s.source}: {_many(s.read, 'row')} read, {s.kept:,} kept, {_many(s.tokens, 'token')}, the longest {s.longest:,}"
        if s.empty:
            text += f"; {_many(s.empty, 'empty row')} left out"
        if s.truncated:
            text += f"; {_many(s.truncated, 'row')} cut to {s.cut_to:,} tokens"
        return text


def load_token_rows(ref: str | Path, *, tokenizer: Any = None, max_positions: int | None = None,
                    truncate: bool = False, vocab_size: int | None = None, split: str = "train") -> TokenRows:
    """The token rows of ``ref``: a saved data set folder (``FOLDER:SPLIT``, else ``split`` of a
    DatasetDict), a ``.jsonl`` or a ``.parquet`` file, with ``input_ids`` or ``text``.

    ``tokenizer``: a local tokenizer folder (or a loaded transformers tokenizer) for a ``text`` column.
    ``max_positions``: rows longer are refused, or cut to it with ``truncate``. ``vocab_size``:
    an id at or above it (or a negative one) is refused, naming the row.
    """
    source = _open_source(ref, split)
    column = _pick_column(source, tokenizer)
    encode = _Tokenize(tokenizer) if column == "text" else None
    rows = _Collector(source.name, max_positions, truncate, vocab_size)
    for raw, where in source.chunks(column):
        if encode is None:
            rows.add(source.ids(raw, where))
        else:
            rows.add(encode(source.texts(raw, where), where))
    described = f"{source.name} ({source.form}, {column}" + (f" tokenized by {encode.name})" if encode else ")")
    return rows.finish(described)


def is_token_set(ref: str | Path) -> bool:
    """Whether ``ref`` names a token set (a ``.jsonl`` / ``.parquet`` file, or a folder ``save_to_disk`` wrote,
    ``FOLDER:SPLIT`` too). Another folder (an ImageFolder tree, a pack) is not one."""
    path, _ = _split_ref(ref)
    return path.suffix.lower() in SUFFIXES or (path.is_dir() and any(
        (path / marker).is_file() for marker in _SAVED_MARKERS))


# what datasets' save_to_disk writes at the top of a Dataset's folder, or of a DatasetDict's
_SAVED_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


# -- internals: where the rows come from -----------------------------------------------------------

Where = Callable[[int], str]  # the i-th row of a chunk as the user finds it: "line 7", "row 6"


def _split_ref(ref: str | Path) -> tuple[Path, str | None]:
    """``folder:validation`` -> (folder, "validation") where ``folder`` is a folder and the whole is not."""
    text = str(ref)
    head, sep, tail = text.rpartition(":")
    if sep and head and tail and "/" not in tail and Path(head).is_dir() and not Path(text).exists():
        return Path(head), tail
    return Path(text), None


def _open_source(ref: str | Path, split: str) -> Any:
    path, ref_split = _split_ref(ref)
    if not path.exists():
        raise UserError(f"token set {str(ref)!r} not found")
    if path.is_dir():
        return _SavedSet(path, ref_split, split)
    if path.suffix.lower() == ".jsonl":
        return _JsonLines(path)
    if path.suffix.lower() == ".parquet":
        return _Parquet(path)
    raise UserError(f"{path.name} is not a token set this reads: give {SET_FORM}")


def _pick_column(source: Any, tokenizer: Any) -> str:
    """``input_ids`` where it is there, else ``text`` (which needs a tokenizer)."""
    if "input_ids" in source.columns:
        return "input_ids"
    if "text" not in source.columns:
        have = ", ".join(source.columns) or "none"
        raise UserError(f"{source.name} has no input_ids or text column (its columns: {have}): give token ids as "
                        "input_ids (lists of ints) or text as text with --tokenizer")
    if tokenizer is None:
        raise UserError(f"{source.name} holds text, not token ids: {_NO_TOKENIZER}")
    return "text"


class _JsonLines:
    """A ``.jsonl`` file, read line by line with :mod:`json` (no optional library)."""

    form = "JSONL"

    def __init__(self, path: Path) -> None:
        self.path, self.name = path, path.name
        first = next(self._objects(), None)
        if first is None:
            raise UserError(f"{self.name} holds no lines: give one JSON object a line, e.g. "
                            '{"input_ids": [1, 2, 3]}')
        self.columns = list(first[1])

    def chunks(self, column: str) -> Iterator[tuple[list[Any], Where]]:
        values: list[Any] = []
        lines: list[int] = []
        for n, obj in self._objects():
            if column not in obj:
                raise UserError(f"line {n} of {self.name} has no {column} (the first line has it): give every "
                                f"line an {column}")
            values.append(obj[column])
            lines.append(n)
            if len(values) == _BATCH:
                yield values, _at_lines(lines)
                values, lines = [], []
        if values:
            yield values, _at_lines(lines)

    def ids(self, values: list[Any], where: Where) -> "_Batch":
        return _list_ids(values, where, self.name)

    def texts(self, values: list[Any], where: Where) -> list[str | None]:
        for i, v in enumerate(values):
            if v is not None and not isinstance(v, str):
                raise UserError(f"{where(i)} of {self.name}: text is a JSON {_json_type(v)}, not a string")
        return values

    def _objects(self) -> Iterator[tuple[int, dict[str, Any]]]:
        with self.path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield n, self._parse(line, n)

    def _parse(self, line: str, n: int) -> dict[str, Any]:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"line {n} of {self.name} is not JSON ({exc.msg}): give one JSON object a line, "
                            'e.g. {"input_ids": [1, 2, 3]}') from None
        if not isinstance(obj, dict):
            raise UserError(f"line {n} of {self.name} holds a JSON {_json_type(obj)}, not an object: give one "
                            'JSON object a line, e.g. {"input_ids": [1, 2, 3]}')
        return obj


class _Arrow:
    """What the arrow-backed forms share: a column comes in batches of arrow arrays."""

    name: str

    def ids(self, arr: Any, where: Where) -> "_Batch":
        return _arrow_ids(arr, where, self.name)

    def texts(self, arr: Any, where: Where) -> list[str | None]:
        return _arrow_texts(arr, self.name)


class _Parquet(_Arrow):
    """A ``.parquet`` file, read a batch of rows at a time with pyarrow."""

    form = "Parquet"

    def __init__(self, path: Path) -> None:
        pq = require("pyarrow.parquet", "text", "Parquet token data")
        self.name = path.name
        try:
            self.file = pq.ParquetFile(path)
        except Exception as exc:
            raise UserError(f"{self.name} does not read as Parquet ({one_line(exc)}): give {SET_FORM}") from None
        self.columns = list(self.file.schema_arrow.names)

    def chunks(self, column: str) -> Iterator[tuple[Any, Where]]:
        return _arrow_chunks(self.file.iter_batches(batch_size=_BATCH, columns=[column]), column)


class _SavedSet(_Arrow):
    """A folder ``datasets``' ``save_to_disk`` wrote: one data set, or a DatasetDict of splits."""

    form = "saved data set"

    def __init__(self, path: Path, ref_split: str | None, split: str) -> None:
        self.name = path.name
        if not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
            raise UserError(f"folder {path} is not a data set saved with save_to_disk (no state.json or "
                            f"dataset_dict.json in it): give {SET_FORM}")
        datasets = require("datasets", "text", "a saved data set")
        loaded = _load_from_disk(datasets, path)
        self.data = _one_split(loaded, path, ref_split, split)
        if isinstance(loaded, datasets.DatasetDict):
            self.form = f"saved data set, split {ref_split or split}"
        self.columns = list(self.data.column_names)

    def chunks(self, column: str) -> Iterator[tuple[Any, Where]]:
        tables = self.data.select_columns([column]).with_format("arrow").iter(batch_size=_BATCH)
        return _arrow_chunks(tables, column)


def _load_from_disk(datasets: Any, path: Path) -> Any:
    """``load_from_disk`` without its progress bar (the library does not print)."""
    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:
        raise UserError(f"folder {path} does not load as a saved data set ({one_line(exc)})") from None
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def _one_split(loaded: Any, path: Path, ref_split: str | None, split: str) -> Any:
    """The data set to read: ``loaded`` itself, or its split ``ref_split`` (else ``split``) of a DatasetDict."""
    if not hasattr(loaded, "keys"):  # one Dataset
        if ref_split is not None:
            raise UserError(f"{path} is one data set, not a DatasetDict of splits: give {path} without :{ref_split}")
        return loaded
    want = ref_split or split
    if want not in loaded:
        have = ", ".join(loaded.keys())
        raise UserError(f"{path} has no split {want!r} (its splits: {have}): give {path}:SPLIT, "
                        f"e.g. {path}:{next(iter(loaded.keys()), 'train')}")
    return loaded[want]


def _at_lines(lines: list[int]) -> Where:
    return lambda i: f"line {lines[i]}"


def _at_rows(first: int) -> Where:
    return lambda i: f"row {first + i}"


def _arrow_chunks(tables: Iterator[Any], column: str) -> Iterator[tuple[Any, Where]]:
    """Each batch's ``column`` as one arrow array, with where its rows are (counted from 0)."""
    first = 0
    for table in tables:
        arr = table.column(column)
        if hasattr(arr, "combine_chunks"):
            arr = arr.combine_chunks()
        yield arr, _at_rows(first)
        first += len(arr)


# -- internals: rows to ids ------------------------------------------------------------------------

@dataclass
class _Batch:
    """A chunk's rows: ``values`` the ids one after another (int64), ``lengths`` one per row."""

    values: np.ndarray
    lengths: np.ndarray
    where: Where

    def row_of(self, flat: int) -> str:
        """Where the row holding ``values[flat]`` is."""
        return self.where(int(np.searchsorted(np.cumsum(self.lengths), flat, side="right")))


def _list_ids(values: list[Any], where: Where, name: str) -> _Batch:
    """JSON rows (lists of ints, or null) as a batch; anything else is refused, naming the row."""
    rows = [_list_row(v, i, where, name) for i, v in enumerate(values)]
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    flat = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return _Batch(flat.astype(np.int64, copy=False), lengths, where)


def _list_row(value: Any, i: int, where: Where, name: str) -> np.ndarray:
    if value is None:
        return np.zeros(0, dtype=np.int64)
    if not isinstance(value, list):
        raise UserError(f"{where(i)} of {name}: input_ids is a JSON {_json_type(value)}, not a list of token ids")
    bad = next((v for v in value if type(v) is not int), None)  # bool too: JSON's true is no token id
    if bad is not None:
        raise UserError(f"{where(i)} of {name}: input_ids holds {json.dumps(bad)[:40]}, not an integer token id: "
                        "give lists of whole numbers")
    try:
        return np.array(value, dtype=np.int64)
    except OverflowError:
        raise UserError(f"{where(i)} of {name} holds the id {max(value, key=abs)}, beyond 64 bits: token ids are "
                        "below the model's vocabulary size") from None


def _arrow_ids(arr: Any, where: Where, name: str) -> _Batch:
    """An arrow column of lists of integers as a batch (null lists are empty rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = arr.type
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not listed or not pa.types.is_integer(kind.value_type):
        raise UserError(f"the input_ids column of {name} holds {kind}, not lists of integer token ids: give lists "
                        "of whole numbers (or a text column and --tokenizer)")
    lengths = pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(arr)
    batch = _Batch(np.zeros(0, dtype=np.int64), lengths, where)
    if flat.null_count:
        at = int(np.flatnonzero(pc.is_null(flat).to_numpy(zero_copy_only=False))[0])
        raise UserError(f"{batch.row_of(at)} of {name} holds a missing (null) id in input_ids: give whole numbers")
    batch.values = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    return batch


def _arrow_texts(arr: Any, name: str) -> list[str | None]:
    import pyarrow as pa

    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        raise UserError(f"the text column of {name} holds {arr.type}, not text")
    return arr.to_pylist()


class _Tokenize:
    """Texts to a batch of ids with a tokenizer: a local folder (transformers' AutoTokenizer) or a loaded one."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, (str, Path)):
            self.name, self.tok = Path(tokenizer).name, _load_tokenizer(Path(tokenizer))
        else:
            self.name, self.tok = type(tokenizer).__name__, tokenizer

    def __call__(self, texts: list[str | None], where: Where) -> _Batch:
        at = [i for i, t in enumerate(texts) if t]
        encoded = self.tok([texts[i] for i in at], verbose=False)["input_ids"] if at else []
        lengths = np.zeros(len(texts), dtype=np.int64)
        lengths[at] = [len(ids) for ids in encoded]
        values = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
        return _Batch(values, lengths, where)


def _load_tokenizer(path: Path) -> Any:
    if not path.is_dir():
        raise UserError(f"tokenizer folder {str(path)!r} not found: {_NO_TOKENIZER}")
    transformers = require("transformers", "hf", "a --tokenizer")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise UserError(f"{path} does not load as a tokenizer ({one_line(exc)}): give a folder a tokenizer's "
                        "save_pretrained wrote (tokenizer.json or its vocabulary files)") from None


# -- internals: keep, count, cut -------------------------------------------------------------------

class _Collector:
    """Takes batches of rows: checks their ids, leaves empty rows out, refuses or cuts long ones, counts all."""

    def __init__(self, name: str, max_positions: int | None, truncate: bool, vocab_size: int | None) -> None:
        self.name, self.max_positions, self.truncate, self.vocab_size = name, max_positions, truncate, vocab_size
        self.read = self.empty = self.cut = self.too_long = self.longest_over = 0
        self.chunks: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []

    def add(self, batch: _Batch) -> None:
        self.read += len(batch.lengths)
        self._check_ids(batch)
        lengths = batch.lengths
        self.empty += int((lengths == 0).sum())
        values = batch.values
        over = lengths > self.max_positions if self.max_positions else np.zeros(len(lengths), dtype=bool)
        if over.any() and not self.truncate:
            self.too_long += int(over.sum())
            self.longest_over = max(self.longest_over, int(lengths.max()))
        elif over.any():
            self.cut += int(over.sum())
            values, lengths = _cut(values, lengths, self.max_positions)
        if not self.too_long:  # once the data is refused, the rest is only counted
            self.chunks.append(_narrow(values))
            self.lengths.append(lengths[lengths > 0])

    def finish(self, source: str) -> TokenRows:
        if self.too_long:
            raise UserError(f"{self.name} has {_many(self.too_long, 'row')} longer than the model's {self.max_positions:,} "
                            f"positions (the longest {self.longest_over:,} tokens): give --truncate to cut them to "
                            f"{self.max_positions:,} tokens, or a model with more positions")
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        if not len(lengths):
            raise UserError(f"{self.name} holds no token rows ({_many(self.read, 'row')} read, {self.empty:,} of them "
                            "empty): give rows of token ids or text")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        stats = TokenStats(source, self.read, len(lengths), self.empty, self.cut, int(offsets[-1]),
                           int(lengths.max()), self.max_positions if self.cut else None)
        return TokenRows(np.concatenate(self.chunks), offsets, stats)

    def _check_ids(self, batch: _Batch) -> None:
        """Every id in ``[0, vocab_size)``, the first bad one named with its row."""
        values = batch.values
        if not len(values):
            return
        if values.min() < 0:
            at = int(np.argmax(values < 0))
            raise UserError(f"{batch.row_of(at)} of {self.name} holds the negative id {values[at]}: token ids are 0 "
                            "or more")
        if self.vocab_size is not None and values.max() >= self.vocab_size:
            at = int(np.argmax(values >= self.vocab_size))
            raise UserError(f"{batch.row_of(at)} of {self.name} holds the id {values[at]}, but the model's vocabulary "
                            f"has {self.vocab_size} ids: tokenize with the model's own tokenizer, or give a larger "
                            "vocab_size in --hf-config")


def _cut(values: np.ndarray, lengths: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first ``limit`` ids."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = np.arange(len(values)) - starts < limit
    return values[keep], np.minimum(lengths, limit)


def _many(n: int, noun: str) -> str:
    """``1 row``, ``3 empty rows``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _json_type(value: Any) -> str:
    names = {"str": "string", "dict": "object", "list": "array", "int": "number", "float": "number", "bool": "boolean"}
    return names.get(type(value).__name__, type(value).__name__)


def _narrow(values: np.ndarray) -> np.ndarray:
    """int32 where the ids fit (every vocabulary does): half the memory of int64."""
    if not len(values) or values.max() < 2 ** 31:
        return values.astype(np.int32)
    return values
