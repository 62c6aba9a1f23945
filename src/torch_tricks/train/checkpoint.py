"""Checkpoints that survive a kill, resume mid-epoch, and load whatever was saved (catalogue T20, T26).

Saving (:func:`save_checkpoint`):

* one file holds everything a resume needs: model, optimizer, scheduler, grad scaler,
  EMA, step counters, the data position (epoch, batches done in it, sampler epoch) and
  the RNG states, so the resumed run takes the very steps the uninterrupted one would;
* the model is saved unwrapped (no ``module.`` from DDP, no ``_orig_mod.`` from
  ``torch.compile``), so a plain model loads it with plain ``load_state_dict``;
* the write is atomic: temp file in the same directory, flush + fsync, ``os.replace``.
  A kill at any moment leaves the previous complete checkpoint or the new complete one,
  never a truncated file under the real name;
* ``keep=k`` keeps the last ``k`` complete checkpoints: the newest under the name given
  (``last.pt``), the ones it replaced as ``last.step-NNNNNNNN.pt`` beside it (their step,
  zero-padded). Once the new one is complete, and only then, the file it replaces gets a
  second name (a hard link, so nothing is copied), the new one is renamed over ``last.pt``
  and the kept copies beyond ``k`` are deleted. ``load_checkpoint(..., fallback=True)``
  (what ``fit``'s resume uses) loads the newest of these that loads, so a ``last.pt``
  damaged after it was written costs the steps since the previous checkpoint, not the run;
* under DDP only rank 0 writes (every rank holds the same weights, and N writers of one
  file is N times the I/O and a race), then every rank waits for it, so no rank reads a
  checkpoint before it exists.

Loading (:func:`load_checkpoint`, :func:`load_state_dict_flexible`) handles the pitfalls
the seeds list: ``module.`` / ``_orig_mod.`` prefixes on either side, shape-mismatched
keys (skipped and reported, e.g. a new classifier head), Python 2 pickles
(``encoding="latin1"``), ``map_location="cpu"`` by default (tensors saved on cuda:0 would
otherwise all land on device 0 of every process), and optimizer / scheduler / scaler /
RNG resume. ``torch.load`` runs with ``weights_only=True`` unless the caller opts out,
since unpickling arbitrary objects can run arbitrary code.
"""

from __future__ import annotations

import glob
import os
import pickle
import random
import re
import time
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from torch_tricks._io import atomic_path, fsync_dir
from torch_tricks._optional import available
from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import register_trick
from torch_tricks.train.distributed import any_rank, get_rank, get_world_size, is_dist, is_main_process, unwrap_model

__all__ = [
    "LoadReport",
    "save_checkpoint",
    "load_checkpoint",
    "load_state_dict_flexible",
    "latest_checkpoint",
    "previous_checkpoints",
    "capture_rng_state",
    "restore_rng_state",
]

FORMAT = "torch-tricks-checkpoint"
FORMAT_VERSION = 1


@dataclass
class LoadReport:
    """What a load did: keys loaded / skipped / missing / unexpected, what was restored, where to resume.

    Keys are reported without wrapper prefixes (``module.``, ``_orig_mod.``).
    ``skipped_shape`` holds ``(key, checkpoint_shape, model_shape)``. ``missing`` leaves out
    ``num_batches_tracked`` buffers (checkpoints from before PyTorch 0.4.1 lack them;
    BatchNorm works without). ``step``, ``epoch`` and ``batch_index`` are 0 when the file
    does not record them (e.g. a bare state_dict).
    """

    path: str | None = None
    loaded: list[str] = field(default_factory=list)
    skipped_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)  # "model", "optimizer", "scheduler", "scaler", "ema", "rng"
    not_in_checkpoint: list[str] = field(default_factory=list)  # asked for, but the file has none
    step: int = 0
    epoch: int = 0
    batch_index: int = 0
    sampler_epoch: int | None = None
    extra: Any = None
    notes: list[str] = field(default_factory=list)
    # fallback=True: the newer checkpoints that did not load, (path, why), newest first; ``path`` is the one that did
    unreadable: list[tuple[str, str]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether every model key matched: nothing skipped, missing or unexpected."""
        return not (self.skipped_shape or self.missing or self.unexpected)

    def summary(self) -> str:
        """One paragraph for a log: what loaded, what did not, what was restored, where to resume."""
        src = f" from {self.path}" if self.path else ""
        parts = [f"Loaded {len(self.loaded)} model entries{src}."]
        if self.unreadable:
            parts.append(self.fallback_line() + ".")
        parts.extend(self._mismatch_lines())
        parts.extend(self._component_lines())
        parts.extend(self.notes)
        parts.append(self._position_line())
        return " ".join(parts)

    def _mismatch_lines(self) -> list[str]:
        """The model keys skipped for their shape, missing and unexpected, each with the first few names."""
        lines = []
        if self.skipped_shape:
            shown = _few([f"{k} (checkpoint {tuple(a)} vs model {tuple(b)})" for k, a, b in self.skipped_shape])
            lines.append(f"Skipped {len(self.skipped_shape)} with a different shape: {shown}.")
        if self.missing:
            n = len(self.missing)
            lines.append(f"{n} model entries not in the checkpoint (left as they were): {_few(self.missing)}.")
        if self.unexpected:
            n = len(self.unexpected)
            lines.append(f"{n} checkpoint entries not in the model (ignored): {_few(self.unexpected)}.")
        return lines

    def _component_lines(self) -> list[str]:
        """What was restored besides the model, and what was asked for but is not in the file."""
        lines = []
        others = [r for r in self.restored if r != "model"]
        if others:
            lines.append(f"Restored {', '.join(others)}.")
        if self.not_in_checkpoint:
            lines.append(f"Not in the checkpoint: {', '.join(self.not_in_checkpoint)}.")
        return lines

    def _position_line(self) -> str:
        pos = f"Resume at epoch {self.epoch}, batch {self.batch_index}, step {self.step}"
        if self.sampler_epoch is not None:
            pos += f" (sampler epoch {self.sampler_epoch})"
        return pos + "."

    def fallback_line(self) -> str:
        """One line saying which newer checkpoints did not load and which one did ("" when none was skipped)."""
        if not self.unreadable:
            return ""
        (bad, why), more = self.unreadable[0], len(self.unreadable) - 1
        also = f" (and {more} newer kept one{'s' if more > 1 else ''} did not load either)" if more else ""
        return (f"checkpoint {bad} {why}{also}: loaded {self.path} (step {self.step}) instead, "
                "the newest checkpoint that loads")


@register_trick(
    "safe_checkpoint",
    ids=("T20", "T26"),
    kind="train",
    trades="one file write per save (rank 0 only) for exact resume and no corrupt checkpoints after a kill",
    needs="a writable directory; under DDP every rank calls save (it synchronises)",
    config_key="checkpoint_dir",
)
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    ema: Any = None,
    step: int = 0,
    epoch: int = 0,
    batch_index: int = 0,
    sampler_epoch: int | None = None,
    extra: Any = None,
    rng: bool = True,
    keep: int = 1,
) -> Path:
    """Write a resumable checkpoint to ``path`` atomically; returns ``path``.

    ``epoch`` and ``batch_index`` give the data position: ``batch_index`` batches of
    ``epoch`` are done, so a resume calls ``sampler.set_epoch(sampler_epoch)`` and skips that
    many batches. ``optimizer``, ``scheduler``, ``scaler`` (GradScaler) and ``ema`` are
    anything with ``state_dict()``. ``extra`` is yours (loading it with ``weights_only=True``
    needs it to be tensors and plain containers). ``rng=True`` stores the python, numpy,
    torch and CUDA generator states. For a bit-exact resume give each DataLoader its own
    ``generator``: creating a DataLoader iterator draws a seed from the global torch RNG
    otherwise, and the resumed run creates one iterator more than the uninterrupted one.

    ``keep``: how many complete checkpoints to keep, this one included (0: all). With
    ``keep > 1`` the checkpoint ``path`` held before (if it loads, and is of another step)
    stays as ``<stem>.step-NNNNNNNN<suffix>`` beside it (``last.step-00000040.pt``), and
    the oldest such copies beyond ``keep`` are deleted, both only once the new checkpoint
    is complete under ``path``. :func:`previous_checkpoints` lists them, newest first.

    Under torch.distributed every rank must call it: each rank's RNG state is gathered (so
    each rank resumes its own dropout / augmentation stream), rank 0 writes, and all ranks
    then agree on success, which doubles as the barrier. Only the CUDA generator of each
    rank's current device is saved under DDP: asking for all devices would create a CUDA
    context, and its memory, on every GPU from every rank.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be an nn.Module, not {type(model).__name__}")
    _check_keep(keep)
    target = Path(path)
    if target.is_dir():
        example = str(target / "last.pt")
        raise UserError(f"{str(target)!r} is a directory: give a checkpoint file name such as {example!r}")
    components = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "ema": ema}
    _check_components(components)

    rng_states = _gather_rng_states() if rng else None  # collective under DDP: before the rank-0 branch

    error: BaseException | None = None
    if is_main_process():
        try:
            ckpt = _checkpoint_dict(model, components, rng_states, extra, step=step, epoch=epoch,
                                    batch_index=batch_index, sampler_epoch=sampler_epoch)
            _atomic_torch_save(ckpt, target, keep_previous=keep != 1, step=int(step))
            _prune_kept(target, keep)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = exc
    _raise_if_rank0_failed(error, target)
    return target


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: Any = None,
    ema: Any = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
    strict: bool = False,
    encoding: str | None = None,
    restore_rng: bool = True,
    fallback: bool = False,
) -> LoadReport:
    """Load ``path`` into whatever is given and report what happened.

    The file may be a :func:`save_checkpoint` file, a common training checkpoint dict
    (``model`` / ``state_dict`` / ``model_state_dict`` ... keys), or a bare state_dict, from
    DDP / DataParallel / ``torch.compile`` models or not. Model keys are matched through
    :func:`load_state_dict_flexible`. ``strict=True`` raises instead of loading a partial
    match. ``weights_only=False`` allows arbitrary pickled objects (only for files you
    trust); ``encoding="latin1"`` reads Python 2 pickles. Components given but absent
    from the file are listed in ``report.not_in_checkpoint``. RNG states are restored when
    the file has them and ``restore_rng`` (each rank its own, under DDP).

    ``fallback=True``: when ``path`` is missing or does not load (truncated, corrupt,
    empty), load the newest of the checkpoints :func:`save_checkpoint` kept beside it
    (``keep > 1``) that does; ``report.path`` is the one loaded and ``report.unreadable``
    lists the newer ones skipped, with why (``report.fallback_line()`` says it in one line).
    If none loads, the error is ``path``'s. Only reading falls back: a checkpoint that
    reads but does not fit the model or optimizer is an error, as without fallback.
    """
    read = dict(map_location=map_location, weights_only=weights_only, encoding=encoding)
    if fallback:
        obj, p, unreadable = _read_with_fallback(Path(path), read)
    else:
        obj, p, unreadable = _torch_load(Path(path), **read), Path(path), []
    ckpt = _as_checkpoint(obj)
    report = LoadReport(path=str(p), unreadable=unreadable)
    if model is not None:
        _restore_model(model, ckpt, obj, p, strict, report)
    components = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "ema": ema}
    for name, target in components.items():
        if target is not None:
            _restore_component(name, target, ckpt, p, report)
    _read_position(ckpt, report)
    if restore_rng and isinstance(ckpt.get("rng"), Mapping):
        _restore_rank_rng(ckpt["rng"], report)
    return report


def load_state_dict_flexible(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = False) -> LoadReport:
    """Load what fits of ``state_dict`` into ``model``; report the rest.

    Keys match exactly or after removing wrapper prefixes on both sides: leading
    ``module.`` (DDP / DataParallel, possibly repeated) and ``_orig_mod.`` anywhere
    (``torch.compile``, also on submodules). So a DDP-saved file loads into a plain model,
    and a plain file into a DDP or compiled one. Tensors whose shape differs from the
    model's are skipped and reported (e.g. a classifier head with another class count)
    rather than failing the whole load. ``strict=True`` raises a :class:`UserError` before
    touching the model if anything is skipped, missing or unexpected.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"model must be an nn.Module, not {type(model).__name__}")
    state_dict = _as_state_dict(state_dict)

    own = model.state_dict()
    report, to_load = _match_state_dict(own, state_dict)
    if strict and not report.complete:
        raise UserError(f"state_dict does not match the model: {_mismatch(report)}: "
                        "pass strict=False to load what fits")

    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:  # per-module versions (e.g. BatchNorm's) drive _load_from_state_dict
        to_load._metadata = _remap_metadata(model, meta)  # type: ignore[attr-defined]
    model.load_state_dict(to_load, strict=False)
    return report


def latest_checkpoint(directory: str | os.PathLike[str], pattern: str = "*.pt") -> Path | None:
    """The newest complete checkpoint in ``directory`` matching ``pattern``; None if none (or no directory).

    Temp files of interrupted saves (``.<name>.*.tmp``), other hidden files and empty files
    are never candidates. Newest is by modification time, ties broken by natural name
    order (``step_10`` after ``step_9``), except that a copy :func:`save_checkpoint` kept
    (``last.step-NNNNNNNN.pt``) never wins a tie against another file: file times are coarse
    (a few ms), and the copy is the older checkpoint.
    """
    d = Path(directory)
    if not d.exists():
        return None
    if not d.is_dir():
        raise UserError(f"{str(d)!r} is not a directory: give the directory holding the checkpoints")
    found = [((st.st_mtime_ns, _KEPT.fullmatch(p.name) is None, _natural_key(p.name)), p)
             for p, st in _nonempty_files(d.glob(pattern))]
    return max(found, key=lambda kp: kp[0])[1] if found else None  # the first of equal keys, as found


def previous_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The earlier checkpoints :func:`save_checkpoint` kept beside ``path`` (``keep > 1``), newest first.

    For ``ckpt/last.pt`` these are ``ckpt/last.step-NNNNNNNN.pt``; newest is by
    modification time (when the checkpoint was written), ties by step. Temp files and empty
    files are never listed; ``path`` itself is not.
    """
    target = Path(path)
    if not target.parent.is_dir():
        return []
    name = re.compile(re.escape(target.stem) + r"\.step-(\d+)" + re.escape(target.suffix))
    found = []
    for p, st in _nonempty_files(target.parent.glob(f"{glob.escape(target.stem)}.step-*{glob.escape(target.suffix)}")):
        m = name.fullmatch(p.name)
        if m is not None:
            found.append(((st.st_mtime_ns, int(m.group(1))), p))
    return [p for _, p in sorted(found, key=lambda kp: kp[0], reverse=True)]


def capture_rng_state() -> dict[str, Any]:
    """This process's python / numpy / torch / CUDA generator states, in a weights_only-loadable form."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if available("numpy"):  # numpy is optional at runtime
        numpy_state = _numpy_rng_state()
        if numpy_state is not None:
            state["numpy"] = numpy_state
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = _rng_devices()
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in devices]
        state["cuda_devices"] = devices
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the generators from :func:`capture_rng_state`'s dict (parts it lacks are left alone)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        _set_numpy_rng_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        _set_cuda_rng_states(state)


def _numpy_rng_state() -> dict[str, Any] | None:
    """numpy's global MT19937 state with the key as a tensor (weights_only loads it); None for another generator."""
    import numpy as np

    s = np.random.get_state(legacy=False)
    if not (isinstance(s, dict) and isinstance(s.get("state"), dict) and "key" in s["state"]):  # MT19937
        return None
    return {
        "bit_generator": str(s["bit_generator"]),
        "key": torch.from_numpy(np.asarray(s["state"]["key"], dtype=np.int64)),
        "pos": int(s["state"]["pos"]),
        "has_gauss": int(s["has_gauss"]),
        "gauss": float(s["gauss"]),
    }


def _rng_devices() -> list[int]:
    """The CUDA devices whose generators to save: every one, but under DDP only this rank's own
    (touching the others would allocate a context on each)."""
    if is_dist():
        return [torch.cuda.current_device()]
    return list(range(torch.cuda.device_count()))


def _set_numpy_rng_state(s: Mapping[str, Any]) -> None:
    import numpy as np

    np.random.set_state(
        {
            "bit_generator": s["bit_generator"],
            "state": {"key": s["key"].cpu().numpy().astype(np.uint32), "pos": int(s["pos"])},
            "has_gauss": int(s["has_gauss"]),
            "gauss": float(s["gauss"]),
        }
    )


def _set_cuda_rng_states(state: Mapping[str, Any]) -> None:
    """The saved CUDA generators back on their devices; those of devices this machine lacks are skipped."""
    devices = state.get("cuda_devices") or list(range(len(state["cuda"])))
    for idx, s in zip(devices, state["cuda"]):
        if idx < torch.cuda.device_count():
            torch.cuda.set_rng_state(s.cpu(), idx)


# --- saving, part by part ----------------------------------------------------------------


def _check_keep(keep: Any) -> None:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise UserError(f"keep must be a whole number >= 0 (0 keeps every checkpoint), not {keep!r}")


def _check_components(components: Mapping[str, Any]) -> None:
    for name, obj in components.items():
        if obj is not None and not callable(getattr(obj, "state_dict", None)):
            raise UserError(f"{name} has no state_dict(): pass the {name} object itself (or None)")


def _checkpoint_dict(model: nn.Module, components: Mapping[str, Any], rng_states: list[dict[str, Any]] | None,
                     extra: Any, *, step: int, epoch: int, batch_index: int,
                     sampler_epoch: int | None) -> dict[str, Any]:
    """What :func:`save_checkpoint` writes: format, counters, data position, and the state of what was given."""
    ckpt: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),  # TorchVersion is a str subclass weights_only refuses
        "world_size": get_world_size(),
        "model": _clean_state_dict(unwrap_model(model).state_dict()),
        "step": int(step),
        "epoch": int(epoch),
        "batch_index": int(batch_index),
        "sampler_epoch": None if sampler_epoch is None else int(sampler_epoch),
    }
    for name, obj in components.items():
        if obj is not None:
            ckpt[name] = obj.state_dict()
    if rng_states is not None:
        ckpt["rng"] = {"per_rank": rng_states}
    if extra is not None:
        ckpt["extra"] = extra
    return ckpt


def _raise_if_rank0_failed(error: BaseException | None, target: Path) -> None:
    """Every rank learns whether rank 0 wrote the checkpoint (also the barrier); rank 0 re-raises its error."""
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise UserError(f"rank 0 failed to write the checkpoint {str(target)!r}: see rank 0's error")


# --- loading, part by part ---------------------------------------------------------------


def _read_with_fallback(p: Path, read: dict[str, Any]) -> tuple[Any, Path, list[tuple[str, str]]]:
    """``(object, path read, unreadable)``: ``p``, or the newest kept checkpoint beside it that loads."""
    unreadable: list[tuple[str, str]] = []
    kept = previous_checkpoints(p)
    first: UserError | None = None
    for c in [p] + kept:  # a missing path falls back too (deleted by hand: the kept ones are still the run's)
        try:
            return _torch_load(c, **read), c, unreadable
        except UserError as exc:
            first = first or exc
            unreadable.append((str(c), getattr(exc, "reason", None) or f"does not load ({exc})"))
    assert first is not None
    if not kept:
        raise first
    raise _none_loads(first, len(kept)) from None


def _none_loads(first: UserError, n: int) -> UserError:
    """``path``'s error, saying that the ``n`` kept checkpoints do not load either."""
    return UserError(f"{first}; the {n} earlier checkpoint{'s' if n > 1 else ''} kept beside it "
                     f"do{'' if n > 1 else 'es'} not load either")


def _restore_model(model: nn.Module, ckpt: Mapping[str, Any], obj: Any, p: Path, strict: bool,
                   report: LoadReport) -> None:
    state = ckpt.get("model")
    if state is None:
        keys = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, Mapping) else type(obj).__name__
        raise UserError(
            f"no model state found in {str(p)!r} (it holds: {keys}): pass a checkpoint or a state_dict file"
        )
    sub = load_state_dict_flexible(model, state, strict=strict)
    for name in ("loaded", "skipped_shape", "missing", "unexpected", "notes"):
        setattr(report, name, getattr(sub, name))
    report.restored.append("model")


def _restore_component(name: str, target: Any, ckpt: Mapping[str, Any], p: Path, report: LoadReport) -> None:
    """Load the optimizer / scheduler / scaler / EMA state ``name`` into ``target``; absent: listed, not an error."""
    state = ckpt.get(name)
    if state is None or (isinstance(state, Mapping) and not state):  # {}: e.g. a disabled GradScaler's
        report.not_in_checkpoint.append(name)
        return
    try:
        target.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as exc:
        raise UserError(
            f"the {name} state in {str(p)!r} does not fit the {name} given ({one_line(exc, 160)}): "
            f"build it as when saving, or pass {name}=None to skip it"
        ) from None
    report.restored.append(name)


def _read_position(ckpt: Mapping[str, Any], report: LoadReport) -> None:
    """The step counters, the data position and the caller's ``extra``, as far as the file has them."""
    for name in ("step", "epoch", "batch_index"):
        value = ckpt.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(report, name, int(value))
    if isinstance(ckpt.get("sampler_epoch"), int):
        report.sampler_epoch = int(ckpt["sampler_epoch"])
    report.extra = ckpt.get("extra")


def _restore_rank_rng(rng: Mapping[str, Any], report: LoadReport) -> None:
    """This rank's own saved RNG state; a note when the checkpoint was saved by fewer ranks."""
    per_rank = rng.get("per_rank") or []
    rank = get_rank()
    if rank < len(per_rank):
        restore_rng_state(per_rank[rank])
        report.restored.append("rng")
    else:
        report.notes.append(f"RNG state not restored on rank {rank}: the checkpoint has {len(per_rank)} rank(s).")


def _as_state_dict(state_dict: Any) -> Mapping[str, Any]:
    """A model's state_dict, or the mapping given; anything else is a UserError."""
    if isinstance(state_dict, nn.Module):
        state_dict = state_dict.state_dict()
    if not isinstance(state_dict, Mapping):
        raise UserError(f"expected a state_dict (a mapping of names to tensors), got {type(state_dict).__name__}")
    return state_dict


def _match_state_dict(
    own: Mapping[str, Any], state_dict: Mapping[str, Any]
) -> tuple[LoadReport, OrderedDict[str, Any]]:
    """Pair the keys of ``state_dict`` with the model's (``own``), exactly or with wrapper prefixes removed:
    the report (loaded, skipped for their shape, missing, unexpected) and what to load under the model's names."""
    by_clean = _by_clean_key(own)
    report = LoadReport()
    to_load: OrderedDict[str, Any] = OrderedDict()
    used: set[str] = set()
    for k in _exact_matches_first(state_dict, own):
        v = state_dict[k]
        if not isinstance(k, str):
            report.unexpected.append(repr(k))
            continue
        tgt = k if k in own else by_clean.get(_clean_key(k))
        if tgt is None or tgt in used:
            report.unexpected.append(_clean_key(k))
            continue
        used.add(tgt)
        mine = own[tgt]
        if _shapes_differ(v, mine):
            report.skipped_shape.append((_clean_key(k), tuple(v.shape), tuple(mine.shape)))
            continue
        to_load[tgt] = v
        report.loaded.append(_clean_key(tgt))
    report.missing = _missing_keys(own, used)
    return report, to_load


def _exact_matches_first(state_dict: Mapping[Any, Any], own: Mapping[str, Any]) -> list[Any]:
    """The keys of ``state_dict``, those that name a model key exactly (and non-strings) first."""
    return sorted(state_dict, key=lambda k: isinstance(k, str) and k not in own)  # a stable sort: False first


def _shapes_differ(v: Any, mine: Any) -> bool:
    return isinstance(v, torch.Tensor) and isinstance(mine, torch.Tensor) and v.shape != mine.shape


def _missing_keys(own: Mapping[str, Any], used: set[str]) -> list[str]:
    """The model keys nothing loads into, cleaned, but for ``num_batches_tracked`` (old checkpoints lack it)."""
    return [_clean_key(k) for k in own if k not in used and not k.rsplit(".", 1)[-1] == "num_batches_tracked"]


def _by_clean_key(own: Mapping[str, Any]) -> dict[str, str | None]:
    """The model's keys by their name without wrapper prefixes; None where two clean to one name."""
    by_clean: dict[str, str | None] = {}
    for k in own:
        ck = _clean_key(k)
        by_clean[ck] = k if ck not in by_clean else None  # None: ambiguous after cleaning
    return by_clean


def _mismatch(report: LoadReport) -> str:
    """What does not match, counted, with the first few names, for a strict load's error."""
    bits = []
    if report.missing:
        bits.append(f"{len(report.missing)} missing ({_few(report.missing)})")
    if report.unexpected:
        bits.append(f"{len(report.unexpected)} unexpected ({_few(report.unexpected)})")
    if report.skipped_shape:
        bits.append(f"{len(report.skipped_shape)} of another shape ({_few([s[0] for s in report.skipped_shape])})")
    return "; ".join(bits)


# --------------------------------------------------------------------------- internals

_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "model_state", "net", "network")
_ALIASES = {
    "optimizer": ("optimizer", "optimizer_state_dict", "optimizer_state", "optim"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict"),
    "scaler": ("scaler", "grad_scaler", "scaler_state_dict"),
    "ema": ("ema", "model_ema", "ema_state_dict"),
    "step": ("step", "global_step", "iteration"),
    "epoch": ("epoch",),
    "batch_index": ("batch_index",),
    "sampler_epoch": ("sampler_epoch",),
    "extra": ("extra",),
    "rng": ("rng",),
}


def _as_checkpoint(obj: Any) -> dict[str, Any]:
    """Normalise what torch.load returned into our checkpoint layout."""
    if isinstance(obj, nn.Module):  # a whole pickled model (weights_only=False)
        return {"model": obj.state_dict()}
    if not isinstance(obj, Mapping):
        return {}
    if obj.get("format") == FORMAT:
        return dict(obj)
    return _from_other_layout(obj)


def _from_other_layout(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A common training checkpoint dict (``state_dict``, ``optimizer_state_dict``, ...) or a bare state_dict."""
    model = _model_entry(obj)
    if model is None and _looks_like_state_dict(obj):
        return {"model": obj}
    out: dict[str, Any] = {} if model is None else {"model": model}
    for name, aliases in _ALIASES.items():
        value = _first_given(obj, aliases)
        if value is not None:
            out[name] = value
    return out


def _model_entry(obj: Mapping[str, Any]) -> Any:
    """The model's state_dict under the first of the usual keys that holds one (or a model); None if none does."""
    for key in _MODEL_KEYS:
        v = obj.get(key)
        if isinstance(v, nn.Module):
            v = v.state_dict()
        if _looks_like_state_dict(v):
            return v
    return None


def _first_given(obj: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    """The value under the first of ``keys`` that ``obj`` holds and is not None; None if none."""
    for key in keys:
        if obj.get(key) is not None:
            return obj[key]
    return None


def _looks_like_state_dict(v: Any) -> bool:
    if not isinstance(v, Mapping) or not v:
        return False
    tensors = 0
    for k, x in v.items():
        if not isinstance(k, str):
            return False
        if isinstance(x, torch.Tensor):
            tensors += 1
        elif not k.endswith("_extra_state"):
            return False
    return tensors > 0


def _clean_key(key: str) -> str:
    """Drop wrapper prefixes: leading ``module.`` (DDP / DataParallel) and ``_orig_mod.`` (torch.compile)."""
    while key.startswith("module."):
        key = key[len("module.") :]
    return key.replace("_orig_mod.", "")


def _clean_module_name(name: str) -> str:
    if name in ("module", "_orig_mod"):
        return ""
    return _clean_key(name + ".")[:-1] if name else ""


def _clean_state_dict(sd: Mapping[str, Any]) -> Mapping[str, Any]:
    """``_orig_mod.`` removed from keys (compiled submodules), unless that would merge two keys."""
    cleaned = OrderedDict((_clean_key(k), v) for k, v in sd.items())
    if len(cleaned) != len(sd):
        return sd
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        new_meta = OrderedDict((_clean_module_name(k), v) for k, v in meta.items())
        cleaned._metadata = new_meta  # type: ignore[attr-defined]
    return cleaned


def _remap_metadata(model: nn.Module, meta: Mapping[str, Any]) -> OrderedDict[str, Any]:
    names = {name for name, _ in model.named_modules()}
    by_clean: dict[str, str] = {}
    for name in sorted(names, key=len):  # the shortest name wins: "" over "module"
        by_clean.setdefault(_clean_module_name(name), name)
    out: OrderedDict[str, Any] = OrderedDict()
    for prefix, value in meta.items():
        tgt = prefix if prefix in names else by_clean.get(_clean_module_name(prefix))
        if tgt is not None:
            out[tgt] = value
    return out


def _atomic_torch_save(obj: Any, target: Path, *, keep_previous: bool = False, step: int = 0) -> None:
    started = time.time()
    with atomic_path(target, suffix=".tmp") as tmp:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous:  # the new one is complete: the one it replaces gets its kept name first
            _keep_previous(target, step)
    fsync_dir(target.parent)
    # Temp files of earlier saves that were killed (SIGKILL skips cleanup) would pile up,
    # each the size of a checkpoint; remove ours that predate this save.
    for stale in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        try:
            if stale.stat().st_mtime < started - 1:
                stale.unlink()
        except OSError:
            pass


_KEPT = re.compile(r".+\.step-\d+(\.[^.]*)?")  # a kept copy's name: <stem>.step-NNNNNNNN<suffix>


def _kept_name(target: Path, step: int) -> Path:
    return target.with_name(f"{target.stem}.step-{int(step):08d}{target.suffix}")


def _keep_previous(target: Path, new_step: int) -> None:
    """Give the checkpoint now under ``target`` its kept name too, before the new one replaces it.

    A hard link (no copy; ``target`` never goes missing), made under a temp name and renamed
    into place. Not kept: a file that does not load (nothing to fall back to) or one of the
    step being saved (the same training state). Where hard links are not supported the file
    is renamed, leaving ``target`` missing until the rename that follows.
    """
    if not target.is_file():
        return
    old_step = _peek_step(target)
    if old_step is None or old_step == new_step:
        return
    kept = _kept_name(target, old_step)
    link = target.with_name(f".{target.name}.{os.getpid()}-{time.monotonic_ns()}.tmp")  # a stale temp if killed
    try:
        os.link(target, link)
    except OSError:
        os.replace(target, kept)
        return
    try:
        os.replace(link, kept)
    except BaseException:
        link.unlink(missing_ok=True)
        raise


def _peek_step(path: Path) -> int | None:
    """The step a checkpoint file records, read without its tensors (mmap); None if it does not load."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable: not worth keeping
        return None
    if not isinstance(obj, Mapping):
        return None
    step = _as_checkpoint(obj).get("step", 0)
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else 0


def _prune_kept(target: Path, keep: int) -> None:
    """Delete the kept copies beyond ``keep`` (``target`` is one of the ``keep``); 0 keeps all."""
    if keep == 0:
        return
    for old in previous_checkpoints(target)[keep - 1:]:
        try:
            old.unlink()
        except OSError:
            pass


class _Unreadable(UserError):
    """A checkpoint file that cannot be read (missing, empty, truncated, corrupt); ``reason`` says why, short."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _torch_load(path: Path, *, map_location: Any, weights_only: bool, encoding: str | None) -> Any:
    name = repr(str(path))
    _check_checkpoint_file(path, name)
    kwargs: dict[str, Any] = {"map_location": map_location, "weights_only": weights_only}
    if encoding is not None:
        kwargs["encoding"] = encoding
    try:
        with warnings.catch_warnings():
            # torch warns that encoding is ignored with weights_only=True, yet its weights-only
            # unpickler does use it (Python 2 strings decode): the warning would only mislead.
            warnings.filterwarnings("ignore", message="pickle_load_args only works")
            return torch.load(path, **kwargs)
    except UnicodeDecodeError:
        raise UserError(_not_utf8(name, encoding, weights_only)) from None
    except (ModuleNotFoundError, AttributeError) as exc:
        why = one_line(exc, 160)
        raise UserError(f"checkpoint {name} refers to code not importable here ({why}): import it first") from None
    except pickle.UnpicklingError as exc:
        raise _unpickling_error(name, exc, encoding, weights_only) from None
    except RuntimeError as exc:
        raise _runtime_load_error(name, exc) from None
    except (EOFError, zipfile.BadZipFile, ValueError, OSError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise _unreadable(name, exc) from None


def _check_checkpoint_file(path: Path, name: str) -> None:
    """Missing, a directory, or empty: said before torch.load would say it less clearly."""
    if not path.exists():
        raise _Unreadable(f"checkpoint {name} does not exist: check the path (latest_checkpoint(dir) finds the newest)",
                          "is missing")
    if path.is_dir():
        raise UserError(f"{name} is a directory: give a checkpoint file (latest_checkpoint(dir) finds the newest)")
    if path.stat().st_size == 0:
        raise _Unreadable(f"checkpoint {name} is empty (0 bytes): an interrupted save? use another checkpoint",
                          "is empty (0 bytes)")


def _unpickling_error(name: str, exc: pickle.UnpicklingError, encoding: str | None, weights_only: bool) -> UserError:
    """The error to raise for an unpickling failure: corrupt, or what weights_only=True refused and why."""
    text = str(exc)
    if not weights_only or "Weights only load failed" not in text:
        return _unreadable(name, exc)
    why = _weights_only_reason(text)
    if "codec can't decode" in text:
        return UserError(_not_utf8(name, encoding, weights_only))
    if "Unsupported global" in text:
        return UserError(
            f"checkpoint {name} holds more than tensors and plain containers ({why}), which weights_only=True "
            "refuses: if you trust the file, pass weights_only=False"
        )
    return UserError(
        f"checkpoint {name} is corrupt, or uses pickle features weights_only=True refuses ({why}): "
        "if you trust the file, try weights_only=False"
    )


def _runtime_load_error(name: str, exc: RuntimeError) -> UserError:
    """Tensors of a device this machine lacks (map_location would fix it), or a corrupt file."""
    text = str(exc)
    if "deserialize object on" in text or "torch.cuda.is_available() is False" in text:
        return UserError(f"checkpoint {name} holds tensors of a device not available here: pass map_location='cpu'")
    return _unreadable(name, exc)


def _unreadable(name: str, exc: BaseException) -> _Unreadable:
    return _Unreadable(_corrupt(name, exc), _corrupt_reason(exc))


def _not_utf8(name: str, encoding: str | None, weights_only: bool) -> str:
    if encoding is None:
        hint = "pass encoding='latin1'"
    elif weights_only:
        hint = f"encoding={encoding!r} did not help: try 'latin1', and weights_only=False if you trust the file"
    else:
        hint = f"encoding={encoding!r} does not fit: try 'latin1'"
    return f"checkpoint {name} has strings that are not UTF-8: if Python 2 saved it, {hint}; if not, it is corrupt"


def _corrupt(name: str, exc: BaseException) -> str:
    return f"checkpoint {name} {_corrupt_reason(exc)}: use another checkpoint"


def _corrupt_reason(exc: BaseException) -> str:
    return f"is corrupt or truncated ({one_line(exc, 160)})"


def _weights_only_reason(text: str) -> str:
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it refers to {m.group(1)}"
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()[:160]
    return "objects weights_only does not allow"


def _few(keys: list[str], n: int = 3) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _is_temp(p: Path) -> bool:
    return p.name.startswith(".") or p.name.endswith(".tmp")


def _nonempty_files(paths: Iterable[Path]) -> Iterator[tuple[Path, os.stat_result]]:
    """The candidate checkpoints among ``paths``, with their stat: files, not empty, not temp or hidden."""
    for p in paths:
        if _is_temp(p) or not p.is_file():
            continue
        st = p.stat()
        if st.st_size:
            yield p, st


def _natural_key(name: str) -> list[Any]:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t]


def _gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective under DDP; one entry otherwise)."""
    mine = capture_rng_state()
    if not is_dist():
        return [mine]
    import torch.distributed as dist

    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states
