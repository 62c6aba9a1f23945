"""``fit``: one training loop where every trick is a switch of :class:`TrainConfig`.

Read top-down, it is the ordinary loop — seed, build, for each epoch: for each group of
``accumulate`` batches: forward, backward, step; validate; checkpoint — with each trick
applied at the one place it belongs:

* precision (T1) wraps the forward in autocast; fp16 adds a grad scaler, and a step the
  scaler skips does not step the lr scheduler;
* accumulation (T11) normalises each micro-batch's mean loss by its share of the real
  number of samples (or tokens) in the group, so ``k`` micro-batches give the update of
  one ``k``-times larger batch, a short last group is flushed, and under DDP the
  gradient all-reduce runs only on the group's last micro-batch;
* the host syncs only every ``log_every`` steps for logging (T3); the one per-step sync
  kept is the NaN guard's finiteness check (T25), which can be switched off;
* no tensor that carries a graph outlives its step (T27): logged losses are detached;
* validation runs in ``eval()`` under ``inference_mode`` (T13);
* checkpoints (T20, T26) are atomic and hold the data position, so a resumed run takes
  the very batches an uninterrupted one would have; the last ``keep_checkpoints`` complete
  ones are kept, and a resume over a damaged newest one falls back to the newest that
  loads, saying so in one warning (and in ``History.notes``);
* under ``torchrun`` the same call runs DDP (T18): distributed sampler, rank-0 logging
  and saving, and every skip / stop / out-of-memory retry decided by all ranks together.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.utils.data import Dataset, DistributedSampler, RandomSampler

from torch_tricks import batches as B
from torch_tricks.device import is_oom, synchronize
from torch_tricks.errors import UserError
from torch_tricks.outputs import get_loss, primary_output
from torch_tricks.registry import register_trick
from torch_tricks.train.checkpoint import load_checkpoint, previous_checkpoints, save_checkpoint
from torch_tricks.train.config import TrainConfig
from torch_tricks.train.distributed import all_reduce_sum, any_rank, barrier, watch_ranks
from torch_tricks.train.ema import SWA
from torch_tricks.train.in_backward import paused as paused_in_backward
from torch_tricks.train.precision import autocast
from torch_tricks.train.sharded_checkpoint import POINTER, load_sharded, save_sharded, sharded_to_resume
from torch_tricks.train.tricks import Tricks, TrainingDiverged, _len, as_config, run_length

__all__ = ["fit", "History", "TrainingDiverged", "TrainStep", "micro_batches", "samples_dataset"]


@dataclass
class History:
    """What :func:`fit` did: metrics rows, final metrics, and the facts needed to trust them.

    ``final`` always has ``train_loss``, the mean training loss of the last ``log_every``
    steps (carried across a resume), once any step was taken; with validation data, also
    the last validation metrics (``loss``, ``acc`` for class targets, ``*_ema`` ...).
    ``resumed_from`` is the checkpoint a resume loaded, and ``notes`` holds one-line
    notices, e.g. that the newest checkpoint did not load and an earlier one was used.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    epochs: int = 0
    skipped_steps: int = 0  # fp16 steps the grad scaler skipped (inf/NaN gradients)
    micro_batches: int = 1  # per loader batch, after any out-of-memory halving
    first_step_s: float = 0.0  # includes torch.compile's compilation when compile=True
    step_s: float = 0.0  # median steady-state step time (measured at log points)
    compile_s: float = 0.0  # first_step_s - step_s when compile=True
    wall_s: float = 0.0
    checkpoint: str = ""
    resumed_from_step: int = -1
    resumed_from: str = ""  # the file or folder a resume loaded
    notes: list[str] = field(default_factory=list)  # one line each (also warned): e.g. a resume that fell back
    config: dict[str, Any] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)  # tricks that were switched on

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    def to_text(self, model: str = "model", data: str = "data") -> str:
        """What ``torch-tricks train`` prints: the run's length and switches, the final losses, skipped
        steps, compile time and checkpoint. ``model`` and ``data`` name the run in its first line (the
        history does not know them; the CLI passes ``--model`` and ``--data``)."""
        lines = [f"{model} on {data}: {self.steps} steps, {self.epochs} epochs in {self.wall_s:.1f} s"
                 + (f" (switches: {', '.join(self.applied)})" if self.applied else "")]
        lines.extend(self._final_lines())
        if self.skipped_steps:
            lines.append(f"fp16 steps skipped by the grad scaler: {self.skipped_steps}")
        if self.compile_s:
            lines.append(f"compile: {self.compile_s:.1f} s (apart from the {self.step_s * 1e3:.1f} ms steps)")
        if self.checkpoint:
            lines.append(f"checkpoint: {self.checkpoint}")
        return "\n".join(lines)

    def _final_lines(self) -> list[str]:
        """The final training loss and validation metrics, as far as the run has them."""
        final = self.final
        lines = []
        if "train_loss" in final:
            lines.append(f"final training loss: {final['train_loss']:.4f} (mean of the last logged steps)")
        valid = {k: v for k, v in final.items() if k != "train_loss"}
        if valid:
            lines.append("final validation: " + ", ".join(f"{k} {v:.4f}" for k, v in valid.items()))
        return lines


def fit(
    model: nn.Module,
    train_data: Dataset | Iterable[Any],
    val_data: Dataset | Iterable[Any] | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    config: TrainConfig | dict[str, Any] | str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> History:
    """Train ``model`` on ``train_data`` with the switches of ``config`` (plus ``overrides``).

    ``train_data``/``val_data`` are map-style datasets (the loop builds the loaders),
    iterables of ``(inputs, target)`` batches, e.g. DataLoaders, or a list of per-sample
    dicts as the transformers Trainer takes them (``{"input_ids": ids, "labels": ids}``,
    tensors or lists of equal length; collated into batches of ``batch_size``; rows of ``input_ids`` alone may
    differ in length: batched as ``token_batches`` says, T39-T41). ``loss_fn(output,
    target)`` must return the *mean* loss of its batch (default: ``--loss auto`` of
    :mod:`torch_tricks.outputs`: the output's own ``.loss``, else cross-entropy of the
    logits against class or token targets, mean squared error against float ones; the
    forward may return a tensor, tuple, dict, dataclass or transformers ``ModelOutput``).
    ``optimizer`` is an optimizer over ``model``'s parameters, a callable ``params ->
    optimizer``, or ``None`` to build ``config.optimizer`` with no-decay groups.
    """
    config = as_config(config)
    config = (config or TrainConfig()).replace(**overrides).validate()
    train_data, val_data = samples_dataset(train_data), samples_dataset(val_data)
    return _Trainer(model, train_data, val_data, loss_fn or get_loss("auto"), optimizer, config).run()


def samples_dataset(data: Any) -> Any:
    """A list of per-sample dicts (the transformers Trainer's data) as a Dataset ``fit`` batches; other data as it is.

    Why: ``fit`` takes a list as a list of *batches*; a list of samples would reach the
    forward one sample at a time, without its batch dimension. A per-sample dict is told
    from a batch by its form: a token input (``input_ids``, ``attention_mask`` ...) of one
    dimension, an image (``pixel_values``) of three, or a value that is a number, a 0-d
    tensor or a list (a batch holds tensors with a batch dimension).
    """
    if not isinstance(data, (list, tuple)) or not data or not _is_sample(data[0]):
        return data
    if all(isinstance(s, Mapping) and set(s) == {"input_ids"} for s in data):
        from torch_tricks.data.token_batches import TokenRowList  # here: the data package costs ~85 ms

        return TokenRowList(data)  # token rows, maybe of different lengths: batched as token_batches says
    return _Samples(data)


class _Samples(Dataset):
    """Per-sample dicts as tensors, checked once to collate (same keys, same shapes per key) into batches."""

    def __init__(self, samples: list[Any] | tuple[Any, ...]) -> None:
        first = _sample_tensors(samples[0], 0)
        self.samples = [first] + [_sample_tensors(s, i) for i, s in enumerate(samples[1:], start=1)]
        for i, sample in enumerate(self.samples[1:], start=1):
            _check_like(sample, first, i)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.samples[i]


class TrainStep:
    """One optimizer step of :func:`fit`, exactly as ``fit`` runs it under ``config``, on batches you give.

    Why: the tuner must time and measure the step that ``fit`` will really run with a
    recommended config (the same model preparation, autocast, scaler, accumulation
    split, EMA update, compile), not a re-implementation of it. ``config.accumulate = k``
    splits each batch given into ``k`` micro-batches (the effective batch stays the one
    given). ``model`` is prepared in place (checkpointing, channels_last ... are applied
    to it): pass a copy to keep the original.
    """

    def __init__(self, model: nn.Module, *, loss_fn: Callable[..., torch.Tensor] | None = None,
                 optimizer: Any = None, config: TrainConfig | dict[str, Any] | None = None) -> None:
        config = as_config(config)
        cfg = config or TrainConfig()
        # a mode named explicitly is kept (the tune's distributed rows time it under torchrun); "auto" is one process
        mode = cfg.distributed if cfg.distributed in ("ddp", "zero1", "fsdp") else "off"
        cfg = cfg.replace(progress=False, distributed=mode, checkpoint_dir="", log_dir="", resume=False).validate()
        self._trainer = _Trainer(model, [], None, loss_fn or get_loss("auto"), optimizer, cfg)
        self.config = cfg

    @property
    def model(self) -> nn.Module:
        """The prepared model (before any compile/DDP wrapper): its parameters are trained."""
        return self._trainer.raw_model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._trainer.optimizer

    @property
    def device(self) -> torch.device:
        return self._trainer.device

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The fp16 grad scaler ``fit`` steps with (disabled unless precision is fp16)."""
        return self._trainer.scaler

    def forward_loss(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """``(output, loss)`` of the first micro-batch of ``batch``, as ``fit``'s step computes them
        (moved to the device, channels_last, under the config's autocast; no backward): what the
        tuner measures the activation memory of."""
        t = self._trainer
        mb = t.tricks.to_device(micro_batches(batch, self.config.accumulate)[0])
        with t.tricks.autocast():
            return B.forward(t.model, mb, t.loss_fn)

    @property
    def applied(self) -> list[str]:
        """The switches that took effect (as in ``History.applied``)."""
        return list(self._trainer.history.applied)

    def __call__(self, batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch`` (``(inputs, target)``); returns the detached mean loss."""
        return self._trainer._train_step(micro_batches(batch, self.config.accumulate))

    def gradients(self, batch: Any) -> list[torch.Tensor]:
        """The gradients of one forward/backward on ``batch`` (no optimizer step), unscaled, as float32."""
        t = self._trainer
        t.tricks.zero_grad()
        with paused_in_backward(t.optimizer):  # the step in backward would take and free the gradients
            t._accumulate(micro_batches(batch, self.config.accumulate))
        scale = float(t.scaler.get_scale()) if t.scaler.is_enabled() else 1.0
        # the grads are handed over (set_to_none below drops the model's references): no copy when unscaled
        grads = [(p.grad.float() / scale if scale != 1.0 else p.grad.float()) if p.grad is not None
                 else torch.zeros_like(p, dtype=torch.float32) for p in t.raw_model.parameters()]
        t.tricks.zero_grad()
        return grads


@register_trick(
    "gradient_accumulation",
    ids=("T11",),
    kind="train",
    trades="k micro-batches per step: activation memory of a k-times smaller batch for a little speed "
    "(and BatchNorm statistics over the micro-batch)",
    needs="a loss that is the mean over its batch",
    config_key="accumulate",
)
def micro_batches(batch: Any, parts: int) -> list[Any]:
    """Split a batch (any form of :mod:`torch_tricks.batches`) into ``parts`` micro-batches along dim 0."""
    return B.split(batch, parts)


class _Trainer:
    """``fit``'s loop around one :class:`Tricks`: data, epochs, validation, logging, checkpoints, SWA.

    The step itself (model preparation, autocast, backward, optimizer step) is the Tricks
    object's: the step a user's own loop gets from ``Tricks`` is this one.
    """

    def __init__(self, model, train_data, val_data, loss_fn, optimizer, cfg: TrainConfig):
        self.cfg = cfg
        self.loss_fn = loss_fn
        self.history = History(config=cfg.to_dict())
        self.tricks = Tricks(cfg.replace(detect_anomaly=False))  # fit scopes anomaly mode to its run
        self.history.applied = self.tricks.applied
        self.device, self.dist, self.is_main = self.tricks.device, self.tricks.dist, self.tricks.is_main
        self.train_loader = self.tricks.prepare_data(train_data, train=True)
        self.val_loader = self.tricks.prepare_data(val_data, train=False) if val_data is not None else None
        self.steps_per_epoch, self.total_steps = run_length(cfg, self.train_loader)
        if (cfg.schedule != "constant" or cfg.warmup_steps) and not self.total_steps:
            raise UserError("a learning-rate schedule needs a known length: give max_steps or sized data")
        self.model, self.optimizer = self.tricks.prepare(model, optimizer, total_steps=self.total_steps)
        self.raw_model = self.tricks.unwrapped_model
        self.scheduler, self.scaler, self.ema = self.tricks.scheduler, self.tricks.scaler, self.tricks.ema
        self.swa = None
        self.start_epoch = 0
        self.skip_batches = 0
        self.micro = 1
        self._recent: collections.deque[torch.Tensor] = collections.deque(maxlen=cfg.log_every)  # History.final
        self._csv: Any = None
        self._tb: Any = None

    @property
    def step(self) -> int:
        return self.tricks.step_count

    @step.setter
    def step(self, value: int) -> None:
        self.tricks.step_count = value

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> History:
        cfg = self.cfg
        t0 = time.perf_counter()
        self._maybe_resume()
        self._open_logs()
        bar = self._progress()
        anomaly = torch.autograd.set_detect_anomaly(True) if cfg.detect_anomaly else contextlib.nullcontext()
        step_times: list[float] = []

        try:
            with anomaly, watch_ranks(lambda: self.step, lambda: self.tricks.last_good):
                for epoch in range(self.start_epoch, cfg.epochs):
                    self.epoch = epoch
                    if self._train_epoch(epoch, bar, step_times):
                        break
        finally:
            if bar is not None:
                bar.close()
            self._close_logs()
        self._finish(step_times, time.perf_counter() - t0)
        return self.history

    def _train_epoch(self, epoch: int, bar: Any, step_times: list[float]) -> bool:
        """One epoch; returns True when max_steps is reached."""
        cfg = self.cfg
        _set_epoch(self.train_loader, epoch, cfg.seed)
        self._maybe_start_swa(epoch)
        self.model.train()
        skip, self.skip_batches = self.skip_batches, 0
        running = torch.zeros((), device=self.device)
        running_n = 0
        t_log = time.perf_counter()
        batch_index = 0
        for group in _groups(iter(self.train_loader), cfg.accumulate):
            if batch_index < skip:  # resume mid-epoch: these batches were trained on already
                batch_index += len(group)
                continue
            batch_index += len(group)
            t_step = time.perf_counter()
            loss = self._train_step(group)
            self._recent.append(loss)  # detached, on the device: no sync
            self._time_first_step(t_step)
            running += loss
            running_n += 1
            if self.step % cfg.log_every == 0:
                t_log = self._log_interval(epoch, running, running_n, t_log, step_times, bar)
                running.zero_()
                running_n = 0
            if bar is not None:
                bar.update(1)
            self._save_if_due(epoch, batch_index)
            if self.total_steps and self.step >= self.total_steps:
                self._end_epoch(epoch, batch_index, finished=True)
                return True
        self._end_epoch(epoch, batch_index, finished=False)
        return False

    def _time_first_step(self, t_step: float) -> None:
        """The first step's time (with compile, its compilation too), measured once: one host sync."""
        if self.step == 1 and not self.history.first_step_s:
            synchronize(self.device)
            self.history.first_step_s = time.perf_counter() - t_step

    def _save_if_due(self, epoch: int, batch_index: int) -> None:
        """A mid-epoch checkpoint every ``checkpoint_every`` steps."""
        every = self.cfg.checkpoint_every
        if every and self.step % every == 0:
            self._save(epoch, batch_index)

    def _log_interval(self, epoch: int, running: torch.Tensor, running_n: int, t_log: float,
                      step_times: list[float], bar: Any) -> float:
        """Log the mean training loss of the last ``running_n`` steps (one host sync) and their mean step
        time; returns the time logged at, the start of the next interval."""
        cfg = self.cfg
        synchronize(self.device)
        now = time.perf_counter()
        if self.step > cfg.log_every or not cfg.compile:  # the compiling interval is not a step time
            step_times.append((now - t_log) / running_n)
        self._log({"step": self.step, "epoch": epoch, "split": "train",
                   "loss": float(running) / running_n, "lr": self.optimizer.param_groups[0]["lr"],
                   "elapsed_s": now - self._t_start}, bar)
        return now

    def _end_epoch(self, epoch: int, batch_index: int, finished: bool) -> None:
        if self.swa is not None and epoch >= self._swa_start_epoch:
            self.swa.update(self.raw_model)
        metrics = self._validate()
        if metrics:
            self._log({"step": self.step, "epoch": epoch, "split": "val", **metrics}, None)
        self.history.epochs = epoch + 1
        # Resume point: the next batch of this epoch (stopped early by max_steps), or the next epoch.
        if finished and batch_index < _len(self.train_loader):
            self._save(epoch, batch_index)
        else:
            self._save(epoch + 1, 0)

    def _train_step(self, group: list[Any]) -> torch.Tensor:
        """One optimizer step over a group of loader batches; returns the detached loss (0 if fp16 skipped it)."""
        while True:
            try:
                self._accumulate(group)
                break
            except _OutOfMemory:
                self._halve_micro_batches(group)
        try:
            self.tricks.flush()  # the group is complete: one update
        except TrainingDiverged as exc:
            raise TrainingDiverged(f"{exc} (epoch {getattr(self, 'epoch', 0)})") from None
        self.history.skipped_steps = self.tricks.skipped_steps
        return self.tricks.group_loss

    def _halve_micro_batches(self, group: list[Any]) -> None:
        """After an out-of-memory: drop the group's gradients and split its batches in twice as many
        micro-batches, or, without auto_micro_batch or below one sample, say what to change."""
        self.tricks.zero_grad()
        smallest = min(B.batch_size(b) for b in group)
        if not self.cfg.auto_micro_batch or self.micro * 2 > smallest:
            raise UserError(
                f"out of memory at step {self.step + 1} with micro-batches of "
                f"{max(1, smallest // self.micro)}: lower batch_size, or set auto_micro_batch"
            ) from None
        self.micro *= 2
        self.history.micro_batches = self.micro

    def _accumulate(self, group: list[Any]) -> None:
        """Forward/backward of every micro-batch of ``group``, each loss weighted by its
        share of the group's samples; DDP all-reduces only on the last one."""
        micro = [m for b in group for m in B.split(b, self.micro)]
        counts = [B.count(m) for m in micro]
        total = sum(counts)
        tricks = self.tricks
        tricks._group = len(micro)
        for mb, n in zip(micro, counts):
            oom = self._forward_backward(mb, n / total)
            if self.dist is not None:
                oom = any_rank(oom)  # every rank retries together, none waits in an all-reduce
            if oom:
                raise _OutOfMemory()

    def _forward_backward(self, mb: Any, weight: float) -> bool:
        """One micro-batch's forward and backward, its loss weighted; True if it ran out of memory."""
        tricks = self.tricks
        try:
            mb = tricks.to_device(mb)
            with tricks.autocast():
                out, loss = B.forward(self.model, mb, self.loss_fn)
            tricks.backward(loss, weight=weight)
            del out, loss
        except Exception as exc:
            if not is_oom(exc):
                raise
            return True
        return False

    # -- validation ------------------------------------------------------------------------
    def _validate(self) -> dict[str, float]:
        if self.val_loader is None:
            return {}
        metrics = _evaluate(self.raw_model, self.val_loader, self.loss_fn, self)
        if self.ema is not None:
            ema_metrics = _evaluate(self.ema.module, self.val_loader, self.loss_fn, self)
            metrics.update({f"{k}_ema": v for k, v in ema_metrics.items()})
        return metrics

    # -- SWA ---------------------------------------------------------------------------------
    def _maybe_start_swa(self, epoch: int) -> None:
        cfg = self.cfg
        if not cfg.swa or self.swa is not None:
            return
        self._swa_start_epoch = int(cfg.swa_start * cfg.epochs)
        if epoch >= self._swa_start_epoch:
            self.swa = SWA(self.raw_model, self.optimizer, swa_lr=cfg.swa_lr or None)
            self.tricks.scheduler = self.swa.scheduler  # SWA's lr schedule replaces the main one from here
            self.history.applied.append("swa")

    # -- checkpoints ----------------------------------------------------------------------
    def _ckpt_path(self) -> Path | None:
        return Path(self.cfg.checkpoint_dir) / "last.pt" if self.cfg.checkpoint_dir else None

    def _save(self, epoch: int, batch_index: int) -> None:
        path = self._ckpt_path()
        if path is None:
            return
        extra = {"micro_batches": self.micro, "skipped_steps": self.history.skipped_steps,
                 "recent_losses": torch.stack(list(self._recent)).float().tolist() if self._recent else []}
        keep = self.cfg.keep_checkpoints
        if self.tricks._sharded_mode():  # no rank holds the whole model or optimizer: every rank writes its shards
            folder = save_sharded(self.cfg.checkpoint_dir, model=self.raw_model, optimizer=self.optimizer,
                                  scheduler=self.scheduler, scaler=self.scaler, ema=self.ema, step=self.step,
                                  epoch=epoch, batch_index=batch_index, extra=extra, keep=keep)
            self.tricks.last_good = f"{folder} (step {self.step})"
            self.history.checkpoint = str(folder)
            return

        save_checkpoint(
            path, model=self.raw_model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, ema=self.ema, step=self.step, epoch=epoch, batch_index=batch_index,
            extra=extra, keep=keep,
        )
        self.tricks.last_good = f"{path} (step {self.step})"
        self.history.checkpoint = str(path)

    def _maybe_resume(self) -> None:
        path = self._ckpt_path()
        if not self.cfg.resume or path is None:
            return
        sharded, note = sharded_to_resume(self.cfg.checkpoint_dir)
        whole = path if path.exists() else next(iter(previous_checkpoints(path)), None)  # newest whole-model file
        if _sharded_is_newer(sharded, whole):
            self._resume_sharded(sharded, note)
            return
        if whole is None:
            return
        if self.tricks._fsdp_mode():
            raise UserError(f"{whole} is a whole-model checkpoint; under distributed = fsdp resume from a sharded "
                            f"one ({Path(self.cfg.checkpoint_dir) / POINTER}), or resume under ddp")
        self._resume_whole(path)

    def _resume_sharded(self, folder: Path, note: str) -> None:
        meta = load_sharded(folder, model=self.raw_model, optimizer=self.optimizer, scheduler=self.scheduler,
                            scaler=self.scaler, ema=self.ema)  # written by any number of ranks
        self._resumed(meta["step"], meta["epoch"], meta["batch_index"], meta.get("extra") or {}, folder, note)

    def _resume_whole(self, path: Path) -> None:
        report = load_checkpoint(  # a last.pt that does not load: the newest kept one that does
            path, model=self.raw_model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, ema=self.ema, map_location=self.device, fallback=True,
        )
        note = f"resume: {report.fallback_line()}" if report.unreadable else ""
        self._resumed(report.step, report.epoch, report.batch_index, report.extra or {}, Path(report.path), note)

    def _resumed(self, step: int, epoch: int, batch_index: int, extra: dict[str, Any], path: Path,
                 note: str = "") -> None:
        self.step = step
        self.start_epoch = epoch
        self.skip_batches = batch_index
        self.micro = int(extra.get("micro_batches", 1))
        self.tricks.skipped_steps = self.history.skipped_steps = int(extra.get("skipped_steps", 0))
        self.history.resumed_from_step = step
        self.history.resumed_from = str(path)
        self.tricks.last_good = f"{path} (step {self.step})"
        recent = extra.get("recent_losses") or []
        self._recent.extend(torch.tensor(float(v), device=self.device) for v in recent)
        if note:  # the library does not print: a warning (the CLI shows it) and History.notes
            self.history.notes.append(note)
            if self.is_main:
                warnings.warn(note, UserWarning, stacklevel=6)  # at the call of fit (via run, _maybe_resume, _resume_*)

    # -- logging ---------------------------------------------------------------------------
    def _open_logs(self) -> None:
        self._t_start = time.perf_counter()
        if not self.cfg.log_dir or not self.is_main:
            return
        log_dir = Path(self.cfg.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "metrics.csv"
        new = not path.exists() or not self.cfg.resume
        f = open(path, "w" if new else "a", newline="")
        self._csv = (f, csv.DictWriter(f, fieldnames=_CSV_FIELDS, extrasaction="ignore"))
        if new:
            self._csv[1].writeheader()
        self._tb = _tensorboard_writer(log_dir / "tensorboard")

    def _log(self, row: dict[str, Any], bar: Any) -> None:
        self.history.rows.append(row)
        if not self.is_main:
            return
        self._write_row(row)
        if bar is not None:
            bar.set_postfix({k: f"{v:.4g}" for k, v in _metric_values(row).items()})

    def _write_row(self, row: dict[str, Any]) -> None:
        """``row`` into metrics.csv and TensorBoard, where open."""
        if self._csv is not None:
            self._csv[1].writerow(row)
            self._csv[0].flush()
        if self._tb is not None:
            for k, v in _metric_values(row).items():
                self._tb.add_scalar(f"{row['split']}/{k}", v, row["step"])

    def _close_logs(self) -> None:
        if self._csv is not None:
            self._csv[0].close()
            self._csv = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def _progress(self) -> Any:
        if not self.cfg.progress or not self.is_main:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_steps or None, initial=self.step, desc="train", unit="step", leave=False)

    def _finish(self, step_times: list[float], wall: float) -> None:
        h = self.history
        h.steps = self.step
        h.micro_batches = self.micro
        h.wall_s = wall
        self._record_step_times(step_times)
        if self.swa is not None:
            self._finish_swa()
        self._record_final()
        if self.dist is not None:
            barrier()

    def _record_step_times(self, step_times: list[float]) -> None:
        """The median steady-state step time and, with compile, what the first step took beyond it."""
        h = self.history
        if step_times:
            h.step_s = sorted(step_times)[len(step_times) // 2]
        if self.cfg.compile and h.first_step_s and h.step_s:
            h.compile_s = max(0.0, h.first_step_s - h.step_s)

    def _finish_swa(self) -> None:
        """SWA's BatchNorm statistics, and its validation metrics (``*_swa``)."""
        self.swa.finalize(self.train_loader, lambda b: _model_inputs(self.tricks.to_device(b)))
        metrics = _evaluate(self.swa.module, self.val_loader, self.loss_fn, self) if self.val_loader else {}
        if metrics:
            self._log_final({f"{k}_swa": v for k, v in metrics.items()})

    def _record_final(self) -> None:
        """``History.final``: the last validation row's metrics and the recent training loss."""
        h = self.history
        val_rows = [row for row in h.rows if row.get("split") == "val"]
        if val_rows:
            h.final = {k: v for k, v in val_rows[-1].items() if isinstance(v, float)}
        if self._recent:  # the last training loss, with validation data or without
            h.final["train_loss"] = float(torch.stack(list(self._recent)).float().mean())

    def _log_final(self, metrics: dict[str, float]) -> None:
        self.history.rows.append({"step": self.step, "epoch": self.history.epochs - 1, "split": "val", **metrics})


_CSV_FIELDS = ["step", "epoch", "split", "loss", "acc", "loss_ema", "acc_ema", "lr", "elapsed_s"]


class _OutOfMemory(Exception):
    """Internal: a micro-batch ran out of memory (on any rank)."""


def _evaluate(model: nn.Module, loader: Iterable[Any], loss_fn: Callable, trainer: _Trainer) -> dict[str, float]:
    """Mean loss and (for class targets) accuracy, in eval mode under inference_mode (T13)."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        loss_sum, correct, n, classify = _eval_sums(model, loader, loss_fn, trainer)
    model.train(was_training)
    if trainer.dist is not None:
        loss_sum, correct, n = all_reduce_sum(loss_sum), all_reduce_sum(correct), int(all_reduce_sum(torch.tensor(n, device=trainer.device)))
    out = {"loss": float(loss_sum) / max(n, 1)}
    if classify:
        out["acc"] = int(correct) / max(n, 1)
    return out


def _metric_values(row: dict[str, Any]) -> dict[str, float]:
    """The metrics of a log row worth plotting: its floats, but the elapsed time."""
    return {k: v for k, v in row.items() if isinstance(v, float) and k != "elapsed_s"}


def _eval_sums(model: nn.Module, loader: Iterable[Any], loss_fn: Callable,
               trainer: _Trainer) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """``(loss x samples summed, correct predictions, samples, whether every batch was classification)``."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    correct = torch.zeros((), dtype=torch.int64, device=trainer.device)
    n = 0
    classify = True
    for batch in loader:
        batch = trainer.tricks.to_device(batch)
        y = B.unpack(batch).target
        with autocast(trainer.cfg.precision, trainer.device):
            out = B.call(model, batch, loss_fn)  # the loss below, in fp32
        count = B.count(batch)
        loss_sum += loss_fn(out.float() if isinstance(out, torch.Tensor) else out, y).double() * count
        pred = primary_output(out) if classify else None
        if classify and _class_targets(pred, y):
            correct += (pred.argmax(1) == y).sum()
        else:
            classify = False
        n += count
    return loss_sum, correct, n, classify


def _class_targets(pred: torch.Tensor, y: Any) -> bool:
    """Whether ``y`` holds class indices for the ``(batch, classes)`` scores ``pred``: accuracy applies."""
    return pred.dim() == 2 and isinstance(y, torch.Tensor) and y.dim() == 1 and not y.is_floating_point()


def _sharded_is_newer(sharded: Path | None, whole: Path | None) -> bool:
    """Whether to resume from the sharded checkpoint rather than the whole-model file: the newer one
    (both can be there when a run changed its distributed mode)."""
    if sharded is None:
        return False
    return whole is None or sharded.stat().st_mtime >= whole.stat().st_mtime


def _tensorboard_writer(folder: Path) -> Any:
    """A TensorBoard SummaryWriter into ``folder``; None where tensorboard is not installed (CSV only)."""
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(folder))
    except Exception:  # tensorboard not installed: CSV only
        return None


def _groups(it: Iterator[Any], k: int) -> Iterator[list[Any]]:
    """Consecutive groups of ``k`` batches; the last, shorter group is yielded too (flushed)."""
    group: list[Any] = []
    for batch in it:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def _model_inputs(batch: Any) -> Any:
    """What to call the model with for ``batch``: a dict of keyword inputs (labels left out), else the positional ones."""
    b = B.unpack(batch)
    if b.kwargs:
        return {k: v for k, v in b.kwargs.items() if k != "labels"}
    return b.args[0] if len(b.args) == 1 else b.args


def _set_epoch(loader: Any, epoch: int, seed: int) -> None:
    """Make this epoch's shuffle a function of (seed, epoch) so a resumed run replays it."""
    sampler = getattr(loader, "sampler", None)
    batches = getattr(loader, "batch_sampler", None)
    if hasattr(batches, "set_epoch"):  # token rows grouped by length or packed (T40, T41)
        batches.set_epoch(epoch)
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    elif isinstance(sampler, RandomSampler):
        if sampler.generator is None:
            sampler.generator = torch.Generator()
        sampler.generator.manual_seed(seed * 100_003 + epoch)




_TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")
_COLLATE_FIX = "pad them to one length, or pass a DataLoader with a collate_fn that pads"


def _is_sample(item: Any) -> bool:
    """Whether ``item`` is one sample's dict rather than a batch's (see :func:`samples_dataset`)."""
    if not isinstance(item, Mapping) or set(item) == {"input", "target"}:
        return False
    tensors = {k: v for k, v in item.items() if isinstance(v, torch.Tensor)}
    if any(_per_sample_shape(k, t) for k, t in tensors.items()) or _scalar_label(item.get("labels")):
        return True
    return not any(t.dim() > 0 for t in tensors.values()) and any(isinstance(v, list) for v in item.values())


def _per_sample_shape(key: str, t: torch.Tensor) -> bool:
    """A transformers input without its batch dimension: token ids / masks of 1 dimension, an image of 3."""
    return (key in _TOKEN_KEYS and t.dim() == 1) or (key == "pixel_values" and t.dim() == 3)


def _scalar_label(labels: Any) -> bool:
    """One sample's class label (a batch's labels have a batch dimension)."""
    if isinstance(labels, torch.Tensor):
        return labels.dim() == 0
    return isinstance(labels, (int, float)) and not isinstance(labels, bool)


def _sample_tensors(sample: Any, i: int) -> dict[str, torch.Tensor]:
    """One sample's values as tensors (a list of ids becomes an int64 tensor); a UserError for what cannot."""
    if not isinstance(sample, Mapping):
        raise UserError(f"fit: item {i} of the data is a {type(sample).__name__} while item 0 is a per-sample dict: "
                        "give every sample as a dict of the same keys")
    out = {}
    for key, value in sample.items():
        try:
            out[key] = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise UserError(f"fit: sample {i}'s {key!r} is a {type(value).__name__} that does not make a tensor "
                            f"(ragged or not numbers): {_COLLATE_FIX}, or tokenize it first") from None
    return out


def _check_like(sample: dict[str, torch.Tensor], first: dict[str, torch.Tensor], i: int) -> None:
    """``sample`` stacks with sample 0: the same keys, each of the same shape."""
    if list(sample) != list(first):
        raise UserError(f"fit: sample {i} has the keys {', '.join(sample)}, sample 0 {', '.join(first)}: give every "
                        "sample the same keys")
    for key, t in sample.items():
        if t.shape != first[key].shape:
            raise UserError(f"fit: sample {i}'s {key!r} has shape {tuple(t.shape)}, sample 0's "
                            f"{tuple(first[key].shape)}: samples of unequal length do not stack into a batch; "
                            f"{_COLLATE_FIX}")
