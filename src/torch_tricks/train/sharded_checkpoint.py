"""Sharded checkpoints for ``distributed = fsdp | zero1`` with ``torch.distributed.checkpoint`` (DCP, T20).

Under FSDP no rank holds the whole model, and under ZeRO-1 none holds the whole optimizer
state (gathering it on rank 0 to write ``last.pt`` would undo, at every save, the memory
ZeRO saves), so no rank writes ``last.pt``: every rank writes its shards (``dcp.save``; the coordinator writes ``.metadata`` last, so a folder
without it is incomplete) into ``step-NNNNNNNN.dcp/`` under ``checkpoint_dir``, and only
when every rank is done does rank 0 point ``last.dcp.json`` at it (temp file + rename)
and remove older folders (all but the newest ``keep`` complete ones, and any a killed save
left incomplete). A run killed while saving leaves the pointer on the previous, complete
checkpoint; if the folder the pointer names is later found incomplete or gone,
:func:`sharded_to_resume` falls back to the newest complete one kept. DCP reshards on
load, so a checkpoint written by N ranks resumes on any number of ranks, one plain process
included (``dcp.load`` without a process group).

What is saved: the model and optimizer through
:func:`torch.distributed.checkpoint.state_dict.get_state_dict` (sharded under FSDP, whole
otherwise; under ZeRO-1 the replicated model, written once, and each rank's share of the
optimizer state in the same parameter-name-keyed form, so either loads into the other
and into a plain optimizer), the EMA's weights the same way, and as plain objects the scheduler, scaler,
EMA count, every rank's RNG state, the step and the data position (``meta.pt``, written by
rank 0 beside the shards before the pointer moves).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from torch_tricks._format import human_bytes
from torch_tricks.errors import UserError
from torch_tricks.train.checkpoint import _atomic_torch_save, _check_keep, _gather_rng_states, restore_rng_state
from torch_tricks.train.distributed import barrier, get_rank, is_main_process

__all__ = ["POINTER", "last_sharded", "complete_sharded", "sharded_to_resume", "save_sharded", "load_sharded",
           "export_checkpoint", "CheckpointExport"]

POINTER = "last.dcp.json"
META = "meta.pt"  # step, data position, scheduler, scaler, RNG: rank 0 writes it beside the shards


def last_sharded(checkpoint_dir: str | os.PathLike[str]) -> Path | None:
    """The folder ``last.dcp.json`` in ``checkpoint_dir`` points at, if it exists and is complete."""
    pointer = Path(checkpoint_dir) / POINTER
    if not pointer.is_file():
        return None
    try:
        target = Path(checkpoint_dir) / json.loads(pointer.read_text())["dir"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{pointer} is damaged: delete it to start afresh, or restore it from a backup") from None
    if not _is_complete(target):
        raise UserError(f"{pointer} points at {target.name}, which is missing or incomplete (no .metadata or {META})")
    return target


def complete_sharded(checkpoint_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete ``step-N.dcp`` folders in ``checkpoint_dir`` (``.metadata`` and ``meta.pt`` written), newest first.

    Newest is by the time ``meta.pt`` was written (rank 0 writes it last), ties by step.
    """
    found = []
    for folder in Path(checkpoint_dir).glob("step-*.dcp"):
        step = _folder_step(folder) if _is_complete(folder) else None
        if step is not None:
            found.append((((folder / META).stat().st_mtime_ns, step), folder))
    return [f for _, f in sorted(found, key=lambda kf: kf[0], reverse=True)]


def _is_complete(folder: Path) -> bool:
    """Whether every rank's shards (DCP's ``.metadata``, written last) and rank 0's ``meta.pt`` are in ``folder``."""
    return folder.is_dir() and (folder / ".metadata").is_file() and (folder / META).is_file()


def _folder_step(folder: Path) -> int | None:
    """The step in a ``step-NNNNNNNN.dcp`` folder's name; None if it is not a number."""
    try:
        return int(folder.name[len("step-"):-len(".dcp")])
    except ValueError:
        return None


def sharded_to_resume(checkpoint_dir: str | os.PathLike[str]) -> tuple[Path | None, str]:
    """The folder to resume from and, when it is not the one ``last.dcp.json`` names, one line saying why.

    The pointer's folder if it is complete; if that folder is missing or incomplete (deleted or
    damaged after the save), the newest complete folder kept (``keep_checkpoints > 1``). A
    pointer that does not parse, or one naming an incomplete folder with nothing kept to fall
    back on, is the error of :func:`last_sharded`. Reads only names and file presence, so
    every rank decides alike.
    """
    try:
        return last_sharded(checkpoint_dir), ""
    except UserError as exc:
        pointer = Path(checkpoint_dir) / POINTER
        try:
            named = json.loads(pointer.read_text())["dir"]
        except (OSError, ValueError, KeyError, TypeError):
            raise exc from None  # the pointer itself is damaged: say so, as before
        kept = [f for f in complete_sharded(checkpoint_dir) if f.name != named]
        if not kept:
            raise
        return kept[0], (f"{pointer} points at {named}, which is missing or incomplete: resuming from {kept[0]} "
                         f"instead, the newest complete sharded checkpoint")


def save_sharded(checkpoint_dir: str | os.PathLike[str], *, model: nn.Module, optimizer: Any, scheduler: Any = None,
                 scaler: Any = None, ema: Any = None, step: int = 0, epoch: int = 0, batch_index: int = 0,
                 extra: Any = None, keep: int = 1) -> Path:
    """Every rank writes its shards of a resumable checkpoint; returns the new folder (see the module doc).

    ``keep``: complete checkpoint folders kept, this one included (0: all); older ones, and
    any folder a killed save left incomplete, are removed once the pointer names the new one.
    """
    _check_keep(keep)
    import torch.distributed.checkpoint as dcp

    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"step-{int(step):08d}.dcp"
    state = _dcp_state(model, optimizer, ema)
    meta = _meta_to_save(scheduler, scaler, ema, step=step, epoch=epoch, batch_index=batch_index, extra=extra)
    if is_main_process() and target.exists():  # a folder left by a run killed at this very step
        shutil.rmtree(target)
    barrier()
    with _one_process_is_meant():
        dcp.save(state, checkpoint_id=str(target), no_dist=not dist.is_initialized())
    if is_main_process():
        torch.save(meta, target / META)  # before the pointer moves: a folder the pointer names has it
    barrier()  # every rank's shards are written
    if is_main_process():
        _point_at(target, step)
        _remove_old_folders(target, keep)
    barrier()
    return target


def _dcp_state(model: nn.Module, optimizer: Any, ema: Any) -> dict[str, Any]:
    """What DCP saves, or loads into in place: the model, the optimizer (under ZeRO-1 this rank's share,
    materialised) and the EMA's weights."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if _is_zero(optimizer):
        model_sd, optim_sd = model.state_dict(), _zero_optimizer_state(model, optimizer)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema.module)
    return state


def _meta_to_save(scheduler: Any, scaler: Any, ema: Any, *, step: int, epoch: int, batch_index: int,
                  extra: Any) -> dict[str, Any]:
    """``meta.pt``'s content; gathers every rank's RNG state, so a collective."""
    return {"step": int(step), "epoch": int(epoch), "batch_index": int(batch_index),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "ema_updates": ema.num_updates if ema is not None else None,
            "rng": _gather_rng_states(), "extra": extra}


def _point_at(target: Path, step: int) -> None:
    """Point ``last.dcp.json`` at ``target`` (temp file + rename: the pointer is never half written)."""
    root = target.parent
    tmp = root / (POINTER + ".tmp")
    tmp.write_text(json.dumps({"dir": target.name, "step": int(step)}))
    os.replace(tmp, root / POINTER)


def _remove_old_folders(target: Path, keep: int) -> None:
    """Remove the complete folders beyond ``keep`` (``target`` is one; 0 keeps all) and every incomplete one."""
    root = target.parent
    complete = [f for f in complete_sharded(root) if f != target]
    stay = set(complete[: keep - 1]) if keep else set(complete)
    for old in root.glob("step-*.dcp"):
        if old != target and old not in stay:
            shutil.rmtree(old, ignore_errors=True)


def load_sharded(path: str | os.PathLike[str], *, model: nn.Module, optimizer: Any, scheduler: Any = None,
                 scaler: Any = None, ema: Any = None) -> dict[str, Any]:
    """Load a :func:`save_sharded` folder into this run's objects, on any world size; its ``meta``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    zero = _is_zero(optimizer)
    state = _dcp_state(model, optimizer, ema)  # under ZeRO-1 this rank's share, materialised to load into in place
    _dcp_load(state, path)
    if zero:
        _load_zero(model, optimizer, state)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    meta = torch.load(Path(path) / META, weights_only=True)
    if ema is not None and "ema" in state:
        set_model_state_dict(ema.module, state["ema"])
        ema.num_updates = int(meta.get("ema_updates") or 0)
    _restore_from_meta(meta, scheduler, scaler)
    return meta


def _dcp_load(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``dcp.load`` into ``state`` in place; what does not fit is a :class:`UserError` with DCP's last line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as exc:  # a BaseException holding each rank's traceback: its last line
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        first = lines[-1][:200] if lines else type(exc).__name__
        raise UserError(f"the sharded checkpoint {str(path)!r} does not fit this model and optimizer ({first}): "
                        "resume with the model and config that wrote it, or start without resume") from None


def _load_zero(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    """Under ZeRO-1 the loaded state is already in the optimizer (in place); the model and group settings are not."""
    model.load_state_dict(state["model"])
    for group, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})  # lr and the rest (a schedule moved them)


def _restore_from_meta(meta: dict[str, Any], scheduler: Any, scaler: Any) -> None:
    """The scheduler, scaler and this rank's RNG state, as far as ``meta.pt`` has them."""
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    per_rank = meta.get("rng") or []
    if get_rank() < len(per_rank):
        restore_rng_state(per_rank[get_rank()])


def _is_zero(optimizer: Any) -> bool:
    # not imported here: torch.distributed.optim's import scripts functions (deprecation warnings); a ZeRO
    # optimizer exists only once its module was imported
    mod = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return mod is not None and isinstance(optimizer, mod.ZeroRedundancyOptimizer)


def _zero_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """A ZeroRedundancyOptimizer's state in torch's parameter-name-keyed form: this rank's share of the
    per-parameter state (its local optimizer's, materialised if it has not stepped), every group whole.

    Written here: ZeRO's own ``state_dict`` gathers everything on one rank, and
    ``get_state_dict`` does not know it; this is the form ``get_state_dict`` gives a plain
    optimizer, so one checkpoint loads under zero1, fsdp, ddp or one process alike.
    """
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer.optim)  # a zero-gradient step at lr 0: the state tensors to load into
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: per for p, per in optimizer.optim.state.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """DCP warns that it "assumes" one process whenever no group exists; here one process is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def export_checkpoint(src: str | os.PathLike[str], out: str | os.PathLike[str]) -> CheckpointExport:
    """The model's weights of a training checkpoint as one plain ``state_dict`` file, for inference.

    ``src``: a ``checkpoint_dir`` (its ``last.dcp.json``, else its ``last.pt``), a ``step-N.dcp``
    folder, or a ``last.pt`` file. DCP shards are joined by
    :func:`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` in this one process.
    ``out`` is written atomically; ``torch.load(out, weights_only=True)`` gives the state_dict
    that ``model.load_state_dict`` takes. Returns what was written (a :class:`CheckpointExport`).
    """
    p = Path(src)
    if not p.exists():
        raise UserError(f"no checkpoint at {str(p)!r}: give a checkpoint_dir, a step-N.dcp folder or a last.pt file")
    folder, p = _export_source(p)
    if folder is not None:
        state, source = _joined_model_state(folder), str(folder)
    else:
        state, source = _file_model_state(p), str(p)
    state = _tensors_to_export(state, source)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save(state, target)
    return CheckpointExport(source=source, out=str(target), tensors=len(state),
                            numel=sum(t.numel() for t in state.values()), bytes=target.stat().st_size)


def _export_source(p: Path) -> tuple[Path | None, Path]:
    """``(DCP folder, None)`` or ``(None, checkpoint file)`` for what :func:`export_checkpoint` was given."""
    folder = None
    if p.is_dir():
        folder = p if (p / ".metadata").is_file() else last_sharded(p)
        if folder is None:
            if not (p / "last.pt").is_file():
                raise UserError(f"{str(p)!r} holds no checkpoint ({POINTER}, .metadata or last.pt)")
            p = p / "last.pt"
    return folder, p


def _joined_model_state(folder: Path) -> Any:
    """The model's entry of a DCP folder, its shards joined into one state_dict in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, _one_process_is_meant():
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(folder), str(whole))
        return torch.load(whole, weights_only=True).get("model")


def _file_model_state(p: Path) -> Any:
    """The model's entry of a ``last.pt`` file, or the whole file if it is a bare state_dict."""
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"{str(p)!r} is not a readable checkpoint ({type(exc).__name__})") from None
    return state.get("model") if isinstance(state, dict) and "model" in state else state


def _tensors_to_export(state: Any, source: str) -> dict[str, torch.Tensor]:
    """The tensors of the model's state_dict ``state`` (extra state left out); a UserError if it is no state_dict."""
    if not isinstance(state, dict) or not state:
        raise UserError(f"{source!r} has no model weights to export")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


class CheckpointExport(dict):
    """What :func:`export_checkpoint` wrote: ``source``, ``out``, ``tensors``, ``numel``, ``bytes``.

    A dict (as it always was, so ``info["out"]`` and JSON keep working) that renders itself
    like the other results: ``to_text()`` is what ``torch-tricks ckpt export`` prints.
    """

    def to_dict(self) -> dict[str, Any]:
        return dict(self)

    def to_text(self) -> str:
        """One line: what was written from where, and how to load it."""
        return (f"wrote {self['out']}: {self['tensors']} tensors, {self['numel']:,} values, "
                f"{human_bytes(self['bytes'])}, from {self['source']}; load it with "
                f"model.load_state_dict(torch.load({self['out']!r}, weights_only=True))")
