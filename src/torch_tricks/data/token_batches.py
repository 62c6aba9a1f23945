"""Tokens, not padding: batches of token rows of different lengths (T39 - T41).

With lengths spread from tens to a thousand, a batch padded to the longest row the model
takes computes mostly padding. Three cures, each a collate function or a batch sampler for
a plain ``DataLoader`` over examples ``{"input_ids": 1-D ids}`` (a list or tensor):

* :func:`pad_collate` (T39): pad each batch to its own longest row, rounded up to a multiple
  of 8 (tensor-core tiles, and fewer distinct shapes for the allocator and compile);
* :class:`LengthGroupedBatchSampler` (T40): batches of rows of similar length (sorted
  within random chunks of the data, the batches then shuffled, the longest batch first so
  that memory runs out at once or never);
* :func:`pack_collate` (T41, with :class:`PackedBatchSampler` choosing rows that fill a fixed number of
  packed rows): several rows in one, each keeping its own positions
  (``position_ids`` restart at 0) and attending only to itself, its first token left out of
  the loss (``labels`` -100: no row predicts another's first token). transformers models
  read such a batch as packed when ``position_ids`` restart and no ``attention_mask`` is
  given (its ``masking_utils`` then builds the block-diagonal causal mask; flash-attention
  2 uses the variable-length kernel); a model of your own builds its mask with
  :func:`packed_attention_mask`.

Every batch is a transformers-style dict whose ``labels`` are the ids with -100 where no
token is to be predicted, so the model's own loss, the mean over the tokens predicted, is the
same number whichever of the three built the batch. Written here because transformers'
``DataCollatorWithFlattening`` packs a whole batch into a single row (fine for flash
attention's variable-length kernel, quadratic for a dense mask on a CPU), and
``DataCollatorWithPadding`` / ``group_by_length`` live inside the ``Trainer``: these work
in any loop and the ``Trainer`` gets the same through :mod:`torch_tricks.integrations`.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from torch_tricks.batches import IGNORE_INDEX  # the label of a token no loss counts
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["IGNORE_INDEX", "PadCollate", "PackCollate", "PackedBatchSampler", "LengthGroupedBatchSampler",
           "pad_collate", "pack_collate", "length_grouped", "packed_attention_mask", "packing_keywords",
           "packing_leak", "row_lengths", "real_tokens", "first_fit_decreasing", "token_loader", "is_token_rows",
           "max_positions", "TokenRowList", "longest_batch"]


@register_trick(
    "dynamic_padding",
    ids=("T39",),
    kind="data",
    trades="batch shapes that change from step to step (a compiled model recompiles per shape; rounding to 8 "
           "bounds them) for padding only to the batch's own longest row",
    needs="token rows of different lengths; a model that takes attention_mask",
    measured_in="benchmarks/token_data.py",
)
def pad_collate(*, multiple: int = 8, pad_id: int = 0, pad_to: int | None = None) -> "PadCollate":
    """A collate function padding each batch to its longest row rounded up to ``multiple``
    (``pad_to``: to that fixed length instead, the padded-to-max baseline)."""
    return PadCollate(multiple=multiple, pad_id=pad_id, pad_to=pad_to)


@register_trick(
    "packing",
    ids=("T41",),
    kind="data",
    trades="a block-diagonal attention mask (a dense one costs attention over the whole row on a CPU; flash "
           "attention's variable-length kernel skips it) for rows with almost no padding",
    needs="a causal LM whose attention follows position_ids (transformers) or packed_attention_mask (own models)",
    measured_in="benchmarks/token_data.py",
)
def pack_collate(row_len: int, *, pad_id: int = 0, keywords: dict[str, Any] | None = None) -> "PackCollate":
    """A collate function packing a batch's rows into rows of ``row_len`` tokens (first fit, longest first);
    ``keywords`` go into every batch (:func:`packing_keywords` gives a model's)."""
    return PackCollate(row_len, pad_id=pad_id, keywords=keywords)


@register_trick(
    "length_grouped",
    ids=("T40",),
    kind="data",
    trades="batches less random in their lengths (each holds rows of similar length; the order of the batches "
           "is still shuffled) for little padding without changing the rows",
    needs="the length of every row up front (row_lengths)",
    measured_in="benchmarks/token_data.py",
)
def length_grouped(lengths: Sequence[int], batch_size: int, *, seed: int = 0,
                   drop_last: bool = False) -> "LengthGroupedBatchSampler":
    """A batch sampler (``DataLoader(data, batch_sampler=...)``) of rows of similar length."""
    return LengthGroupedBatchSampler(lengths, batch_size, seed=seed, drop_last=drop_last)


class PadCollate:
    """Pads ``input_ids`` with ``pad_id``; ``attention_mask`` 1 on the row's tokens; ``labels`` -100 on padding
    and on each row's first token (as packed rows have it: every label left counts in the loss, so a
    micro-batch's weight under accumulation, its labels counted, is exact)."""

    def __init__(self, *, multiple: int = 8, pad_id: int = 0, pad_to: int | None = None) -> None:
        if multiple < 1 or (pad_to is not None and pad_to < 1):
            raise UserError(f"pad_collate: multiple and pad_to must be >= 1, got {multiple} and {pad_to}")
        self.multiple, self.pad_id, self.pad_to = multiple, pad_id, pad_to

    def __call__(self, examples: list[Any]) -> dict[str, torch.Tensor]:
        rows = [_ids(e) for e in examples]
        longest = max(len(r) for r in rows)
        width = self.pad_to if self.pad_to is not None else math.ceil(longest / self.multiple) * self.multiple
        if longest > width:
            raise UserError(f"a row of {longest} tokens does not fit pad_to={width}: truncate the data or pad "
                            "to more")
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        labels[:, 0] = IGNORE_INDEX  # no token predicts a row's first (a causal LM shifts it out anyway)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PackCollate:
    """Packs a batch's rows into as few rows of ``row_len`` tokens as first fit finds (longest first).

    ``position_ids`` count from 0 in each packed sequence (and in the padding at a row's end);
    ``labels`` are the ids, -100 at each sequence's first token and on padding; no
    ``attention_mask``: the positions tell where each sequence starts.
    """

    def __init__(self, row_len: int, *, pad_id: int = 0, keywords: dict[str, Any] | None = None) -> None:
        if row_len < 1:
            raise UserError(f"pack_collate: row_len must be >= 1, got {row_len}")
        self.row_len, self.pad_id, self.keywords = row_len, pad_id, dict(keywords or {})

    def __call__(self, examples: list[Any]) -> dict[str, torch.Tensor]:
        bins = self.bins([_ids(e) for e in examples])
        ids = torch.full((len(bins), self.row_len), self.pad_id, dtype=torch.long)
        positions = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for i, rows in enumerate(bins):
            at = 0
            for r in rows:
                n = len(r)
                ids[i, at:at + n] = r
                positions[i, at:at + n] = torch.arange(n)
                labels[i, at + 1:at + n] = r[1:]
                at += n
            positions[i, at:] = torch.arange(self.row_len - at)
        return {"input_ids": ids, "position_ids": positions, "labels": labels, **self.keywords}

    def bins(self, rows: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """First fit decreasing: each row, longest first, into the first packed row with room."""
        too_long = [len(r) for r in rows if len(r) > self.row_len]
        if too_long:
            raise UserError(f"{len(too_long)} row(s) longer than the packed row of {self.row_len} tokens (the "
                            f"longest {max(too_long)}): truncate the data or pack into longer rows")
        return [[rows[i] for i in b] for b in first_fit_decreasing([len(r) for r in rows], self.row_len)]


class PackedBatchSampler(Sampler[list[int]]):
    """Batches of indices (in shuffled order) whose rows :class:`PackCollate` packs into exactly ``rows`` rows
    of ``row_len`` tokens (fewer only for the last batch): every step the same shape, nearly no padding.

    Each pass reshuffles (``set_epoch``: as :class:`LengthGroupedBatchSampler`); ``len`` is the coming pass's.
    """

    def __init__(self, lengths: Sequence[int], row_len: int, rows: int, *, seed: int = 0) -> None:
        self.lengths = [int(n) for n in lengths]
        if rows < 1 or row_len < 1:
            raise UserError(f"packed batches: rows and row_len must be >= 1, got {rows} and {row_len}")
        too_long = [n for n in self.lengths if n > row_len]
        if too_long:
            raise UserError(f"{len(too_long)} row(s) longer than the packed row of {row_len} tokens (the longest "
                            f"{max(too_long)}): truncate the data or pack into longer rows")
        self.row_len, self.rows, self.seed, self.epoch = row_len, rows, seed, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self._batches(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches(self.epoch)
        self.epoch += 1  # the next pass reshuffles unless set_epoch says otherwise
        return iter(batches)

    def _batches(self, epoch: int) -> list[list[int]]:
        """The pass of ``epoch``: indices in a shuffled order, a batch closed when the next row would need one
        packed row more (computed once per epoch: ``len`` and the pass agree)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        out: list[list[int]] = []
        batch: list[int] = []
        for i in torch.randperm(len(self.lengths), generator=gen).tolist():
            if batch and len(first_fit_decreasing([self.lengths[j] for j in batch + [i]], self.row_len)) > self.rows:
                out.append(batch)
                batch = []
            batch.append(i)
        if batch:
            out.append(batch)
        self._cache = (epoch, out)
        return out


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of ``capacity``: each, longest first, into the first bin with room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        b = next((j for j, free in enumerate(room) if free >= lengths[i]), None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of indices whose rows have similar lengths.

    Each epoch: the indices are shuffled, cut into chunks of ``chunk`` batches, each chunk
    sorted by length and cut into batches; the batches are shuffled and the one holding the
    longest row goes first (memory peaks at the first step, not at an unlucky step later).
    Each pass reshuffles; ``set_epoch`` makes a pass's order a function of (seed, epoch), as
    ``DistributedSampler``'s (a resumed run replays it).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, seed: int = 0, chunk: int = 50,
                 drop_last: bool = False) -> None:
        if batch_size < 1 or chunk < 1:
            raise UserError(f"length_grouped: batch_size and chunk must be >= 1, got {batch_size} and {chunk}")
        self.lengths = [int(n) for n in lengths]
        self.batch_size, self.seed, self.chunk, self.drop_last = batch_size, seed, chunk, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        self.epoch += 1  # the next pass reshuffles unless set_epoch says otherwise
        order = torch.randperm(len(self.lengths), generator=gen).tolist()
        span = self.batch_size * self.chunk
        batches = []
        for start in range(0, len(order), span):
            part = sorted(order[start:start + span], key=lambda i: -self.lengths[i])
            batches += [part[i:i + self.batch_size] for i in range(0, len(part), self.batch_size)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        if not batches:
            return iter([])
        batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
        first = max(range(len(batches)), key=lambda i: max(self.lengths[j] for j in batches[i]))
        batches.insert(0, batches.pop(first))
        return iter(batches)


def token_loader(data: Any, *, batch_size: int, mode: str = "padded", row_len: int | None = None, pad_id: int = 0,
                 seed: int = 0, shuffle: bool = True, keywords: dict[str, Any] | None = None,
                 **loader_kw: Any) -> DataLoader:
    """A DataLoader over token rows of different lengths (``data[i]["input_ids"]``, ``data.lengths`` where known),
    batched as ``mode`` says: ``padded`` (T39), ``grouped`` (T40, padded likewise), ``packed`` (T41: rows of
    ``row_len`` tokens, as many per batch as ``batch_size`` rows of the data's mean length fill, so a step
    sees about as many tokens as before) or ``max`` (every batch padded to ``row_len``: the baseline).
    ``row_len``: the model's positions (needed for ``packed`` and ``max``; else the longest row, rounded up
    to 8). Not shuffled (``shuffle=False``): grouped and packed batches keep the data's order of rows."""
    lengths = row_lengths(data)
    if not lengths:
        raise UserError("token_loader: the data set holds no rows")
    width = row_len or math.ceil(max(lengths) / 8) * 8
    seed = seed if shuffle else -1
    if mode in ("padded", "max"):
        collate = pad_collate(pad_id=pad_id, pad_to=width if mode == "max" else None)
        gen = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(data, batch_size=batch_size, shuffle=shuffle, generator=gen, collate_fn=collate,
                          **loader_kw)
    if mode == "grouped":
        sampler: Sampler = LengthGroupedBatchSampler(lengths, batch_size, seed=max(seed, 0))
        collate = pad_collate(pad_id=pad_id)
    elif mode == "packed":
        rows = max(1, round(batch_size * sum(lengths) / len(lengths) / width))
        sampler = PackedBatchSampler(lengths, width, rows, seed=max(seed, 0))
        collate = pack_collate(width, pad_id=pad_id, keywords=keywords)
    else:
        raise UserError(f"token batches must be padded, grouped, packed or max, not {mode!r}")
    return DataLoader(data, batch_sampler=sampler, collate_fn=collate, **loader_kw)


class TokenRowList(Dataset):
    """Token rows held in memory (``[{"input_ids": ids}, ...]`` of different lengths) as a data set with ``lengths``."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = [_ids(r) for r in rows]
        self.lengths = [len(r) for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


def longest_batch(data: Any, batch_size: int, *, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The ``batch_size`` longest rows of ``data`` padded to the longest (x8): the largest batch any sampler of
    ``data`` forms. A batch size searched on it fits every batch of the epoch; one searched on a typical batch
    runs out of memory at the first long one (Lightning's batch-size finder, Unsloth users at step 120)."""
    lengths = row_lengths(data)
    longest = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:batch_size]
    return pad_collate(pad_id=pad_id)([data[i] for i in longest])


def is_token_rows(data: Any) -> bool:
    """``data`` is a data set of token rows of different lengths (it says so with ``lengths``)."""
    return isinstance(data, Dataset) and getattr(data, "lengths", None) is not None


def max_positions(model: Any) -> int | None:
    """The longest sequence a transformers model takes (its config's positions), None if it says none."""
    cfg = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def packed_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The boolean mask (rows, 1, L, L), True where a token may attend, for a packed batch: causal,
    and only within the sequence the token belongs to (a sequence starts where its position is 0).
    For ``F.scaled_dot_product_attention(q, k, v, attn_mask=...)`` in a model of your own."""
    seq = (position_ids == 0).cumsum(-1)
    same = seq.unsqueeze(-1) == seq.unsqueeze(-2)
    n = position_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


def packing_keywords(model: Any) -> dict[str, Any]:
    """What a packed batch must also pass ``model``: ``use_cache=False`` for a transformers model (its
    ``masking_utils`` reads restarting ``position_ids`` as packed sequences only without a cache, and a
    model in train mode still builds one unless told not to: the sequences would attend to each other)."""
    import inspect

    inner = getattr(model, "_orig_mod", model)  # under torch.compile
    if callable(getattr(type(inner), "get_base_model", None)):  # a peft model: forward(..., **kwargs) passes it on
        inner = inner.get_base_model()
    forward = getattr(inner, "forward", None)
    try:
        takes = "use_cache" in inspect.signature(forward).parameters if forward is not None else False
    except (TypeError, ValueError):
        takes = False
    return {"use_cache": False} if takes else {}


def packing_leak(model: Any, *, vocab_size: int, lengths: tuple[int, ...] = (7, 5), seed: int = 0,
                 keywords: dict[str, Any] | None = None) -> float:
    """How far ``model``'s logits for sequences packed into one row are from the same sequences run alone
    (the largest absolute difference, 0 up to rounding where nothing leaks). A model that ignores
    ``position_ids`` (or builds a cache) lets the second sequence attend to the first: packing would
    change what it learns. Runs in eval mode without gradients; the model's mode is restored."""
    gen = torch.Generator().manual_seed(seed)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    rows = sorted((torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths), key=len, reverse=True)
    kw = packing_keywords(model) if keywords is None else keywords
    packed = PackCollate(sum(lengths), keywords=kw)([{"input_ids": r} for r in rows])
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            together = _logits(model(input_ids=packed["input_ids"].to(device),
                                     position_ids=packed["position_ids"].to(device), **kw))[0]
            alone = torch.cat([_logits(model(input_ids=r[None].to(device), **kw))[0]
                               for r in rows])
    finally:
        model.train(was)
    return float((together.float() - alone.float()).abs().max())


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out["logits"] if isinstance(out, dict) else out.logits


def row_lengths(data: Any) -> list[int]:
    """The length of every row of a data set of examples ``{"input_ids": ...}`` (its ``lengths`` where it has them)."""
    given = getattr(data, "lengths", None)
    if given is not None:
        return [int(n) for n in given]
    return [len(_ids(data[i])) for i in range(len(data))]


def real_tokens(examples: list[Any]) -> int:
    """The tokens of the data in these examples: what a batch computes that is not padding."""
    return sum(len(_ids(e)) for e in examples)


def _ids(example: Any) -> torch.Tensor:
    ids = example["input_ids"] if isinstance(example, dict) else example
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 1 or len(ids) == 0:
        raise UserError(f"a token row must be a non-empty 1-D list of ids, got shape {tuple(ids.shape)}")
    return ids
