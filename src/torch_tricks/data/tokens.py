"""Token data for a causal language model: one 1-D file of token ids, read by memory map.

The form nanoGPT's ``prepare.py`` writes: ``train.bin`` holds raw ``uint16`` ids one after
another (``tokens.bin:uint32`` reads ``uint32`` ids, for vocabularies over 65,536); a
``.npy`` file holds a 1-D integer array and carries its own dtype. The file is memory-mapped,
so one larger than RAM costs only the windows the steps read.

Sample ``i`` is the ``i``-th non-overlapping window of ``seq`` tokens as a transformers-style
dict ``{"input_ids": ids, "labels": ids}``: the model shifts the labels itself (as
transformers' ``run_clm`` groups texts into blocks), so ``fit`` trains it with its own loss
and :mod:`torch_tricks.batches` passes the labels in. A trailing part shorter than ``seq`` is
left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from torch_tricks.errors import UserError, one_line

__all__ = ["TokenDataset", "is_token_file", "parse_token_ref", "BIN_DTYPES", "FORM"]

BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SUFFIXES = (".bin", ".npy")
FORM = ("a 1-D token file: FILE.bin of uint16 ids as nanoGPT writes them (FILE.bin:uint32 for uint32 ids), "
        "or a 1-D integer FILE.npy")
_SCAN = 1 << 24  # tokens per chunk of the vocabulary check: bounded memory on a file of any size


class TokenDataset(Dataset):
    """Windows of ``seq`` tokens from the token file ``ref`` (``path``, or ``path.bin:uint32``).

    ``vocab_size``: refuse a file holding an id the model has no embedding for (checked
    once, over the whole file, in chunks), rather than fail at the step that reads it.
    """

    def __init__(self, ref: str | Path, seq: int, *, vocab_size: int | None = None) -> None:
        self.path, self.dtype = parse_token_ref(ref)
        if seq < 1:
            raise UserError(f"--seq must be >= 1, got {seq}")
        self.seq = seq
        self._tokens: np.ndarray | None = None
        tokens = self.tokens
        if len(tokens) < seq:
            raise UserError(f"token file {self.path.name} holds {len(tokens)} tokens, fewer than one sequence of "
                            f"--seq {seq}: give more tokens or a shorter --seq")
        if vocab_size is not None:
            _check_ids(tokens, vocab_size, self.path.name)

    @property
    def tokens(self) -> np.ndarray:
        """The 1-D memory map (opened on first use in each process: a pickled copy reopens it)."""
        if self._tokens is None:
            self._tokens = _open(self.path, self.dtype)
        return self._tokens

    def __len__(self) -> int:
        return len(self.tokens) // self.seq

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of {n}")
        start = (i % n) * self.seq
        ids = torch.from_numpy(np.asarray(self.tokens[start: start + self.seq], dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a DataLoader worker under spawn) without the map: a memmap would pickle its whole data."""
        return {**self.__dict__, "_tokens": None}


def is_token_file(ref: str | Path) -> bool:
    """Whether ``ref`` names a token file (``.bin`` / ``.npy``, with or without ``:DTYPE``), not a data set name."""
    text = str(ref)
    path, sep, _ = text.rpartition(":")
    return Path(text).suffix.lower() in SUFFIXES or (bool(sep) and Path(path).suffix.lower() in SUFFIXES)


def parse_token_ref(ref: str | Path) -> tuple[Path, str | None]:
    """``tokens.bin:uint32`` -> (path, "uint32"); a ``.bin`` without a dtype is uint16; a ``.npy``'s dtype is its own."""
    text = str(ref)
    path, sep, tail = text.rpartition(":")
    dtype = None
    if sep and Path(path).suffix.lower() in SUFFIXES:
        dtype = tail.lower()
        text = path
    p = Path(text)
    if p.suffix.lower() not in SUFFIXES:
        raise UserError(f"{text!r} is not a token file: give {FORM}")
    if dtype is not None and p.suffix.lower() == ".npy":
        raise UserError(f"{ref!r}: an .npy file carries its own dtype: give {p.name} without :{dtype}")
    if dtype is not None and dtype not in BIN_DTYPES:
        raise UserError(f"unknown token dtype {dtype!r} in {str(ref)!r}: a .bin file holds uint16 ids (the default, "
                        f"as nanoGPT writes them) or uint32 ({p.name}:uint32)")
    if not p.is_file():
        raise UserError(f"token file {text!r} not found")
    return p, dtype


# -- internals -------------------------------------------------------------------------------------

def _open(path: Path, dtype: str | None) -> np.ndarray:
    """The file's ids as a read-only 1-D memory map, or a UserError saying what is wrong with its form."""
    if path.suffix.lower() == ".npy":
        return _open_npy(path)
    name = dtype or "uint16"
    item = np.dtype(BIN_DTYPES[name]).itemsize
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, dtype=BIN_DTYPES[name])
    if size % item:
        fix = "are they uint16 (drop :uint32)?" if name == "uint32" else f"give {FORM}"
        raise UserError(f"token file {path.name} is {size} bytes, not a whole number of {name} ids ({item} bytes "
                        f"each): {fix}")
    return np.memmap(path, dtype=BIN_DTYPES[name], mode="r")


def _open_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:
        raise UserError(f"token file {path.name} does not load as .npy ({one_line(exc)}): give {FORM}") from None
    if tokens.ndim != 1:
        raise UserError(f"token file {path.name} holds a {tokens.ndim}-D array of shape {tokens.shape}: token ids "
                        f"must be 1-D, one after another (flatten it: np.save(path, ids.reshape(-1)))")
    if tokens.dtype.kind not in "ui":
        raise UserError(f"token file {path.name} holds {tokens.dtype} values: token ids are integers "
                        "(uint16, uint32, int32 or int64)")
    return tokens


def _check_ids(tokens: np.ndarray, vocab_size: int, name: str) -> None:
    """Every id in ``[0, vocab_size)``, scanned in chunks."""
    high, low = -1, 0
    for start in range(0, len(tokens), _SCAN):
        chunk = np.asarray(tokens[start: start + _SCAN])
        high, low = max(high, int(chunk.max())), min(low, int(chunk.min()))
    if low < 0:
        raise UserError(f"token file {name} holds the negative id {low}: token ids are 0 or more")
    if high >= vocab_size:
        raise UserError(f"token file {name} holds the id {high}, but the model's vocabulary has {vocab_size} ids: "
                        "tokenize with the model's own tokenizer, or give a larger vocab_size in --hf-config")
