"""The tune's configuration in transformers' ``Trainer`` (issue 22)::

    from torch_tricks.integrations.hf import TricksCallback, training_args_from

    cfg = "tune-report/tricks.toml"                      # or a TrainConfig, or a dict of its keys
    args = TrainingArguments(output_dir="out", **training_args_from(cfg))
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TricksCallback(cfg)])
    trainer.train()

:func:`training_args_from` gives the ``TrainingArguments`` keywords that carry the configuration
(precision, gradient checkpointing, the optimizer and its fused or 8/4-bit form, compile,
accumulation, batch, clipping, schedule, seed and determinism, saving, logging); every keyword is
checked against the installed transformers. :class:`TricksCallback` applies, from the Trainer's own
hooks, the switches ``TrainingArguments`` has no field for: in ``on_init_end`` (before the
Trainer builds its optimizer and wraps the model) the model changes of ``Tricks.prepare``
(in-place activations, memory-efficient BN, checkpointing by name pattern, the chunked LM loss,
BN momentum, channels_last, SyncBN) and the process settings (cudnn benchmark, the kept heap,
intra-op threads, anomaly detection); at each step's end the EMA (saved as ``ema.pt`` in each
checkpoint folder); the NaN guard as a check of the model's loss; ``metrics.csv`` of the
Trainer's logs. The table of where each key goes is :mod:`torch_tricks.integrations.mapping`.

Written here rather than taken from transformers: the Trainer has arguments for the first group
and nothing for the second; a callback is its own way of adding behaviour.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from torch_tricks._io import atomic_path
from torch_tricks._optional import require
from torch_tricks.errors import UserError, one_line
from torch_tricks.integrations.mapping import (
    changed_keys,
    check_keywords,
    code_lines,
    config_of,
    routes,
    sourced_keywords,
)
from torch_tricks.integrations.merge import check_prefer, merge, same
from torch_tricks.machine import set_threads
from torch_tricks.train.compile_modes import check_compile_mode
from torch_tricks.train.liger import liger_support
from torch_tricks.train.matmul_mode import set_fp32_matmul
from torch_tricks.train.config import TrainConfig
from torch_tricks.train.ema import EMA
from torch_tricks.train.offload import check_device as check_offload_device
from torch_tricks.train.offload import offload_activations
from torch_tricks.train.speed import cudnn_benchmark, keep_heap
from torch_tricks.train.tricks import TrainingDiverged, apply_model_switches

_transformers = require("transformers", "hf", "the transformers Trainer integration")
require("accelerate", "hf", "the transformers Trainer")
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

__all__ = ["training_args_from", "trainer_lines", "TricksCallback"]


def training_args_from(cfg: Any, base: Any = None, *, prefer: str | None = None) -> Any:
    """The ``TrainingArguments`` keywords of the keys ``cfg`` was given (a path to ``tricks.toml``, a
    ``TrainConfig`` or a dict): no default of torch-tricks replaces one of the Trainer's.

    With ``base`` (your ``TrainingArguments``, or a dict of their keywords), your arguments with those keywords
    set: a new ``TrainingArguments`` (or dict) whose ``tricks_changes`` maps each field changed to ``(old, new)``.
    A field you set to another value than the configuration's is one line naming both, unless ``prefer`` is
    ``"tuned"`` or ``"yours"`` (see :mod:`torch_tricks.integrations.merge`). A value with no place in the Trainer,
    or a field the installed transformers lacks, is one line too (``UserError``).
    """
    config = config_of(cfg)
    check_prefer(prefer)
    have = {f.name: f for f in fields(TrainingArguments)}
    tuned = training_args_sources(config)
    check_keywords(tuned, set(have), "hf", _transformers, "TrainingArguments field")
    if base is None:
        return {k: v for k, (v, _) in tuned.items()}
    if isinstance(base, dict):
        merged = merge(tuned, base, explicit=set(base), defaults=_defaults(base), prefer=prefer,
                       where="your arguments")
        return merged
    if not isinstance(base, TrainingArguments):
        raise UserError(f"base must be your TrainingArguments or a dict of their keywords, not {type(base).__name__}")
    yours = {k: getattr(base, k) for k, f in have.items() if f.init}
    defaults = _defaults(yours)
    explicit = {k for k, v in yours.items() if k in defaults and not same(v, defaults[k])}
    merged = merge(tuned, yours, explicit=explicit, defaults=defaults, prefer=prefer, where="your TrainingArguments")
    try:
        out = dataclasses.replace(base, **{k: merged[k] for k in merged.tricks_changes})
    except ValueError as exc:  # TrainingArguments' own checks (bf16 on a machine without a GPU needs use_cpu)
        raise UserError(f"TrainingArguments refuse the merged arguments: {one_line(exc)}") from None
    out.tricks_changes = merged.tricks_changes
    return out


def _defaults(yours: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's own value of each field, as ``TrainingArguments`` holds it after its own checks (enums)."""
    plain = TrainingArguments(output_dir=yours.get("output_dir") or "trainer_output",
                              use_cpu=bool(yours.get("use_cpu", False)))
    return {f.name: getattr(plain, f.name) for f in fields(TrainingArguments) if f.init}


# Fields a newer transformers renamed (the old name still works there, with a deprecation warning).
_RENAMED = {"gradient_checkpointing": "activation_checkpointing",
            "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}


def trainer_lines(cfg: Any, source: str | None = None) -> list[str]:
    """The lines of a Trainer script that carry ``cfg``: your arguments with the configuration's fields set, the
    callback, and any line of your own code a key needs (``trainer.train(resume_from_checkpoint=True)``).
    ``source``: how the script names the configuration (a path to tricks.toml); default: its given keys."""
    config = config_of(cfg)
    args = training_args_from(config)
    extra = code_lines(config, "hf")
    train = extra.pop("resume", "trainer.train()")
    sets = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "nothing"
    return ["from transformers import Trainer, TrainingArguments",
            "from torch_tricks.integrations.hf import TricksCallback, training_args_from",
            "",
            f"cfg = {source!r}" if source else f"cfg = {changed_keys(config)!r}",
            f"args = TrainingArguments(output_dir=\"out\"{_cpu_note(config)})  # your own arguments",
            f"args = training_args_from(cfg, base=args)  # sets {sets}",
            *extra.values(),
            "trainer = Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[TricksCallback(cfg)])",
            train]


class TricksCallback(TrainerCallback):
    """The switches of a configuration that ``TrainingArguments`` has no field for, applied from the Trainer's hooks.

    At the Trainer's start it checks that the Trainer's own arguments carry the keys of the configuration that
    belong to them (precision, accumulation, optimizer, clipping, schedule ...): one line naming the field
    otherwise (build them with :func:`training_args_from`). :attr:`applied` lists every switch in effect, the
    Trainer's own included. After training, :attr:`ema` holds the EMA (``ema.module`` the averaged model) when
    ``ema`` is on; it is saved as ``ema.pt`` in each checkpoint folder and restored from the checkpoint a run
    resumes (``ema_checkpoint``: that folder, where it is not ``output_dir/checkpoint-<step>``). With
    ``ema_weights_at_end`` the model holds the EMA weights when training ends, so ``trainer.evaluate()`` and
    ``trainer.save_model()`` use them; :meth:`ema_weights` does it for one block of your code.
    """

    def __init__(self, cfg: Any, *, ema_weights_at_end: bool = False, ema_checkpoint: str | None = None) -> None:
        self.config = config_of(cfg)
        routes(self.config, "hf")  # a value the Trainer cannot serve is refused here, before any training
        self.applied: list[str] = []
        self.ema: Any = None
        self.ema_weights_at_end = ema_weights_at_end
        self.ema_checkpoint = ema_checkpoint
        self._model: nn.Module | None = None
        self._step = 0
        self._log_file: Path | None = Path(self.config.log_dir) / "metrics.csv" if self.config.log_dir else None

    # -- the Trainer's hooks -------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        if model is None:
            raise UserError("TricksCallback needs the model: build the Trainer with model=...")
        self.applied = _check_arguments(self.config, args)
        cfg = self.config
        if cfg.compile:  # the Trainer compiles; its device is checked here, before the model changes
            check_compile_mode(cfg.compile, args.device)
        if cfg.liger:  # the Trainer applies Liger (use_liger_kernel); the model and device are checked here
            ok, why = liger_support(model, args.device)
            if not ok:
                raise UserError(f"liger: {why}")
        switches = cfg.replace(checkpointing="" if cfg.checkpointing == "blocks" else cfg.checkpointing, liger=False)
        changed, applied = apply_model_switches(model, switches, distributed=_launched(), channels_last_weights=True,
                                                device=args.device)
        if changed is not model:
            raise UserError(f"checkpointing = {cfg.checkpointing!r} wraps the model in a new module, which the "
                            "Trainer would not train: apply it before building the Trainer "
                            "(torch_tricks.train.memory.checkpoint_sequential_sqrt), or use a name pattern")
        self.applied += applied + _process_switches(cfg, model)
        if cfg.offload_activations:
            check_offload_device(next(model.parameters()).device)
            _offload_in_forward(model)
            self.applied.append("offload_activations")
        if cfg.nan_guard:
            model.register_forward_hook(self._check_loss)
            self.applied.append("nan_guard")
        self._model = model

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if not self.config.ema:
            return
        if self.ema is None:
            self.ema = EMA(self._model if self._model is not None else model, decay=self.config.ema_decay)
            self.applied.append("ema")
        if state.global_step > 0:  # resumed: the average goes on from the checkpoint's, not from the weights
            self._restore_ema(args, state.global_step)

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        self._step = state.global_step
        if self.ema is not None:
            self.ema.update(self._model if self._model is not None else model)

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ema is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_save(self.ema.state_dict(), folder / "ema.pt")

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None,
                     **kwargs: Any) -> None:
        if self.ema is not None and self.ema_weights_at_end:
            _copy_weights(self.ema.module, self._model if self._model is not None else model)

    @contextlib.contextmanager
    def ema_weights(self, model: nn.Module | None = None) -> Iterator[nn.Module]:
        """The model holding the EMA weights inside the block (``trainer.evaluate()``, ``trainer.save_model()``),
        its own weights back after it."""
        if self.ema is None:
            raise UserError("ema_weights() needs ema = true in the configuration")
        target = model if model is not None else self._model
        own = {k: v.detach().clone() for k, v in target.state_dict().items()}
        _copy_weights(self.ema.module, target)
        try:
            yield target
        finally:
            target.load_state_dict(own)

    def _restore_ema(self, args: TrainingArguments, step: int) -> None:
        folder = Path(self.ema_checkpoint) if self.ema_checkpoint else Path(args.output_dir) / f"checkpoint-{step}"
        path = folder / "ema.pt"
        if not path.is_file():
            raise UserError(f"resumed at step {step} with ema = true, but {path} does not exist: give "
                            "TricksCallback(cfg, ema_checkpoint='<the checkpoint folder resumed>'), or switch ema off")
        self.ema.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.applied.append(f"ema restored from {path} ({self.ema.num_updates} updates)")

    def on_log(self, args: TrainingArguments, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self._log_file is None or not logs or not state.is_world_process_zero:
            return
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        new = not self._log_file.exists()
        with self._log_file.open("a", newline="") as f:
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            writer = csv.writer(f)
            if new:
                writer.writerow(row)
            writer.writerow(row.values())

    # -- the NaN guard ---------------------------------------------------------------------------------
    def _check_loss(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """After a training forward: a non-finite loss stops the run, naming the step (one host sync a step,
        as the guard of ``Tricks``)."""
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not module.training or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        if not math.isfinite(float(loss.detach())):
            raise TrainingDiverged(f"loss is {float(loss.detach())} at step {self._step + 1} (the Trainer's "
                                   f"optimizer steps so far: {self._step}); lower the learning rate or check the data")


# -- helpers ----------------------------------------------------------------------------------------------

def _cpu_note(config: TrainConfig) -> str:
    """``, use_cpu=True`` where mixed precision runs on a machine without a GPU: the Trainer refuses bf16 there
    otherwise."""
    if config.precision == "fp32" or torch.cuda.is_available() or "use_cpu" in training_args_sources(config):
        return ""
    return ", use_cpu=True"


def _check_arguments(config: TrainConfig, args: TrainingArguments) -> list[str]:
    """The configuration's keys that belong to ``TrainingArguments``, checked against the Trainer's: the switches
    in effect (``key=value (field=...)``), or one line naming a field that does not carry its key."""
    carried: dict[str, list[str]] = {}
    for name, (value, key) in training_args_sources(config).items():
        have = getattr(args, name, None)
        if not same(have, value):
            raise UserError(f"{key} = {getattr(config, key)!r} in the configuration needs {name}={value!r}, but the "
                            f"Trainer's arguments have {name}={have!r}: build them with "
                            "training_args_from(cfg, base=your_args)")
        carried.setdefault(key, []).append(f"{name}={value!r}")
    return [f"{key}={getattr(config, key)} ({', '.join(fields_)})" for key, fields_ in carried.items()]


def training_args_sources(config: TrainConfig) -> dict[str, tuple[Any, str]]:
    """Each ``TrainingArguments`` field the configuration sets: its value and the key that sets it."""
    have = {f.name for f in fields(TrainingArguments)}
    return {_RENAMED.get(k, k) if _RENAMED.get(k) in have else k: v for k, v in sourced_keywords(config, "hf").items()}


def _copy_weights(src: nn.Module, dst: nn.Module) -> None:
    with torch.no_grad():
        for (_, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
            b.copy_(a)





def _process_switches(cfg: TrainConfig, model: nn.Module) -> list[str]:
    """cudnn benchmark, the kept heap (CPU), intra-op threads and anomaly detection: settings of the process."""
    applied = []
    if cfg.threads:  # checked against this machine's cores here, as Tricks does
        set_threads(cfg.threads)
        applied.append(f"threads={cfg.threads}")
    if cfg.fp32_matmul:  # for the device the model is on, checked there (tf32 on a CPU: one line)
        set_fp32_matmul(cfg.fp32_matmul, next(model.parameters(), torch.empty(0)).device)
        applied.append(f"fp32_matmul={cfg.fp32_matmul}")
    if cfg.cudnn_benchmark:
        cudnn_benchmark(True, fixed_shapes=True)
        applied.append("cudnn_benchmark")
    on_cpu = next(model.parameters(), torch.empty(0)).device.type == "cpu"
    if cfg.keep_heap and on_cpu and keep_heap():
        applied.append("keep_heap")
    if cfg.detect_anomaly:
        torch.autograd.set_detect_anomaly(True)
        applied.append("detect_anomaly")
    return applied


def _launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _atomic_save(obj: Any, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def _offload_in_forward(model: nn.Module) -> None:
    """Saved activations to pinned host memory during each forward of ``model`` (what ``Tricks.autocast`` does
    around the forward of your own loop): entered by a pre-hook, left by a hook that runs even on an error."""
    stack: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        ctx = offload_activations()
        ctx.__enter__()
        stack.append(ctx)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
