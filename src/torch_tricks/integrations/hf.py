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
anomaly detection); at each step's end the EMA (saved as ``ema.pt`` in each checkpoint folder);
the NaN guard as a check of the model's loss; ``metrics.csv`` of the Trainer's logs. The table of
where each key goes is :mod:`torch_tricks.integrations.mapping`.

Written here rather than taken from transformers: the Trainer has arguments for the first group
and nothing for the second; a callback is its own way of adding behaviour.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from torch_tricks._io import atomic_path
from torch_tricks._optional import require
from torch_tricks.errors import UserError
from torch_tricks.integrations.mapping import changed_keys, check_keywords, config_of, keywords, routes
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


def training_args_from(cfg: Any) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords for ``cfg`` (a path to ``tricks.toml``, a ``TrainConfig`` or a dict).

    A value with no place in the Trainer, or a keyword the installed transformers lacks, is one
    line saying which and what to do (``UserError``).
    """
    have = {f.name for f in fields(TrainingArguments)}
    out = {_RENAMED.get(k, k) if _RENAMED.get(k) in have else k: v for k, v in keywords(config_of(cfg), "hf").items()}
    check_keywords(out, have, "hf", _transformers, "TrainingArguments field")
    return out


# Fields a newer transformers renamed (the old name still works there, with a deprecation warning).
_RENAMED = {"gradient_checkpointing": "activation_checkpointing",
            "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}


def trainer_lines(cfg: Any) -> list[str]:
    """The lines of a Trainer script that carry ``cfg``: the arguments, the callback, and any line of your own
    code a key needs (``trainer.train(resume_from_checkpoint=True)``)."""
    config = config_of(cfg)
    args = training_args_from(config)
    extra = [r.line for r in routes(config, "hf").values() if r.how == "code"]
    kw = ",\n    ".join(f"{k}={v!r}" for k, v in args.items())
    return ["from transformers import Trainer, TrainingArguments",
            "from torch_tricks.integrations.hf import TricksCallback",
            "",
            f"args = TrainingArguments(\n    {kw},\n)",
            "trainer = Trainer(model=model, args=args, train_dataset=train_dataset,",
            f"                  callbacks=[TricksCallback({repr(changed_keys(config))})])",
            *extra]


class TricksCallback(TrainerCallback):
    """The switches of a configuration that ``TrainingArguments`` has no field for, applied from the Trainer's hooks.

    After training, :attr:`ema` holds the EMA (``ema.module`` the averaged model) when ``ema`` is on.
    """

    def __init__(self, cfg: Any) -> None:
        self.config = config_of(cfg)
        routes(self.config, "hf")  # a value the Trainer cannot serve is refused here, before any training
        self.applied: list[str] = []
        self.ema: Any = None
        self._model: nn.Module | None = None
        self._step = 0
        self._log_file: Path | None = Path(self.config.log_dir) / "metrics.csv" if self.config.log_dir else None

    # -- the Trainer's hooks -------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        if model is None:
            raise UserError("TricksCallback needs the model: build the Trainer with model=...")
        cfg = self.config
        switches = cfg.replace(checkpointing="" if cfg.checkpointing == "blocks" else cfg.checkpointing)
        changed, self.applied = apply_model_switches(model, switches, distributed=_launched(), channels_last_weights=True)
        if changed is not model:
            raise UserError(f"checkpointing = {cfg.checkpointing!r} wraps the model in a new module, which the "
                            "Trainer would not train: apply it before building the Trainer "
                            "(torch_tricks.train.memory.checkpoint_sequential_sqrt), or use a name pattern")
        self.applied += _process_switches(cfg, model)
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
        if self.config.ema and self.ema is None:
            self.ema = EMA(self._model if self._model is not None else model, decay=self.config.ema_decay)
            self.applied.append("ema")

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




def _process_switches(cfg: TrainConfig, model: nn.Module) -> list[str]:
    """cudnn benchmark, the kept heap (CPU) and anomaly detection: settings of the process."""
    applied = []
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
