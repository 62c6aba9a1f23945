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
  the very batches an uninterrupted one would have;
* under ``torchrun`` the same call runs DDP (T18): distributed sampler, rank-0 logging
  and saving, and every skip / stop / out-of-memory retry decided by all ranks together.
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from torch_tricks.errors import UserError
from torch_tricks.outputs import get_loss, primary_output
from torch_tricks.registry import register_trick
from torch_tricks.train.config import TrainConfig

__all__ = ["fit", "History", "TrainingDiverged", "TrainStep", "micro_batches"]


class TrainingDiverged(UserError):
    """A non-finite loss stopped the run; the message names the step and the last good checkpoint."""


@dataclass
class History:
    """What :func:`fit` did: metrics rows, final metrics, and the facts needed to trust them."""

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
    config: dict[str, Any] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)  # tricks that were switched on

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


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

    ``train_data``/``val_data`` are map-style datasets (the loop builds the loaders) or
    iterables of ``(inputs, target)`` batches, e.g. DataLoaders. ``loss_fn(output,
    target)`` must return the *mean* loss of its batch (default: ``--loss auto`` of
    :mod:`torch_tricks.outputs`: the output's own ``.loss``, else cross-entropy of the
    logits against class or token targets, mean squared error against float ones; the
    forward may return a tensor, tuple, dict, dataclass or transformers ``ModelOutput``).
    ``optimizer`` is an optimizer over ``model``'s parameters, a callable ``params ->
    optimizer``, or ``None`` to build ``config.optimizer`` with no-decay groups.
    """
    config = _as_config(config)
    config = (config or TrainConfig()).replace(**overrides).validate()
    return _Trainer(model, train_data, val_data, loss_fn or get_loss("auto"), optimizer, config).run()


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
        config = _as_config(config)
        cfg = (config or TrainConfig()).replace(progress=False, distributed="off", checkpoint_dir="",
                                                log_dir="", resume=False).validate()
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
    def applied(self) -> list[str]:
        """The switches that took effect (as in ``History.applied``)."""
        return list(self._trainer.history.applied)

    def __call__(self, batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch`` (``(inputs, target)``); returns the detached mean loss."""
        return self._trainer._train_step(micro_batches(batch, self.config.accumulate))

    def gradients(self, batch: Any) -> list[torch.Tensor]:
        """The gradients of one forward/backward on ``batch`` (no optimizer step), unscaled, as float32."""
        t = self._trainer
        t.optimizer.zero_grad(set_to_none=True)
        t._accumulate(micro_batches(batch, self.config.accumulate))
        scale = float(t.scaler.get_scale()) if t.scaler.is_enabled() else 1.0
        # the grads are handed over (set_to_none below drops the model's references): no copy when unscaled
        grads = [(p.grad.float() / scale if scale != 1.0 else p.grad.float()) if p.grad is not None
                 else torch.zeros_like(p, dtype=torch.float32) for p in t.raw_model.parameters()]
        t.optimizer.zero_grad(set_to_none=True)
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
    """Split an ``(inputs, target)`` batch into ``parts`` micro-batches along dim 0 (fewer if it is smaller)."""
    return _split(batch, parts)


class _Trainer:
    def __init__(self, model, train_data, val_data, loss_fn, optimizer, cfg: TrainConfig):
        self.cfg = cfg
        self.loss_fn = loss_fn
        self.history = History(config=cfg.to_dict())
        self._setup_runtime()
        self.raw_model = self._prepare_model(model)
        self.train_loader = self._loader(train_data, train=True)
        self.val_loader = self._loader(val_data, train=False) if val_data is not None else None
        self.model = self._wrap_model(self.raw_model)
        self.optimizer = self._build_optimizer(optimizer)
        self.steps_per_epoch = math.ceil(_len(self.train_loader) / cfg.accumulate) if _len(self.train_loader) else 0
        self.total_steps = self._total_steps()
        self.scheduler = self._build_scheduler()
        from torch_tricks.train.precision import make_grad_scaler

        self.scaler = make_grad_scaler(cfg.precision, self.device)
        self.ema = self._build_ema()
        self.swa = None
        self.step = 0
        self.start_epoch = 0
        self.skip_batches = 0
        self.micro = 1
        self.last_good = ""
        self._csv: Any = None
        self._tb: Any = None

    # -- set-up --------------------------------------------------------------------------
    def _setup_runtime(self) -> None:
        from torch_tricks.train.distributed import init_distributed
        from torch_tricks.train.precision import check_precision
        from torch_tricks.train.seed import seed_everything

        cfg = self.cfg
        use_dist = cfg.distributed == "auto" and int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.dist = init_distributed() if use_dist else None
        if self.dist is not None:
            self.device = self.dist.device
        elif cfg.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            try:
                self.device = torch.device(cfg.device)
            except RuntimeError:
                raise UserError(f"unknown device {cfg.device!r}: use auto, cpu, cuda or cuda:N") from None
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise UserError("device cuda asked for, but this torch sees no CUDA device: use device=cpu")
        self.is_main = self.dist is None or self.dist.is_main
        check_precision(cfg.precision, self.device)
        if cfg.precision != "fp32":
            self.history.applied.append(f"precision={cfg.precision}")
        rank = self.dist.rank if self.dist else 0
        seed_everything(cfg.seed + rank, deterministic=cfg.deterministic)
        if cfg.cudnn_benchmark:
            from torch_tricks.train.speed import cudnn_benchmark

            cudnn_benchmark(True, fixed_shapes=True)
            self.history.applied.append("cudnn_benchmark")

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        cfg, applied = self.cfg, self.history.applied
        if cfg.inplace:
            from torch_tricks.train.memory import inplace_activations

            model = inplace_activations(model)
            applied.append("inplace")
        if cfg.memory_efficient_bn:
            from torch_tricks.train.memory import memory_efficient_bn_act

            model = memory_efficient_bn_act(model)
            applied.append("memory_efficient_bn")
        if cfg.checkpointing:
            from torch_tricks.train.memory import checkpoint_blocks, checkpoint_sequential_sqrt

            if cfg.checkpointing == "sqrt":
                if not isinstance(model, nn.Sequential):
                    raise UserError("checkpointing='sqrt' needs an nn.Sequential model: use 'blocks' or a name pattern")
                model = checkpoint_sequential_sqrt(model)
            elif cfg.checkpointing == "blocks":
                model = checkpoint_blocks(model)
            else:
                model = checkpoint_blocks(model, names=[cfg.checkpointing])
            applied.append(f"checkpointing={cfg.checkpointing}")
        if cfg.bn_momentum_adjust and cfg.accumulate > 1:
            _adjust_bn_momentum(model, cfg.accumulate)
            applied.append("bn_momentum_adjust")
        if cfg.sync_bn and self.dist is not None:
            from torch_tricks.train.syncbn import convert_sync_batchnorm

            model = convert_sync_batchnorm(model)
            applied.append("sync_bn")
        model = model.to(self.device)
        if cfg.channels_last:
            from torch_tricks.train.speed import channels_last

            model = channels_last(model)
            applied.append("channels_last")
        return model

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if self.dist is not None:
            from torch_tricks.train.distributed import wrap_ddp

            model = wrap_ddp(model, self.dist)
            self.history.applied.append("ddp")
        if self.cfg.compile:
            from torch_tricks.train.speed import compile_model

            model = compile_model(model)
            self.history.applied.append("compile")
        return model

    def _loader(self, data: Any, *, train: bool) -> Iterable[Any]:
        from torch_tricks.train.seed import seeded_generator, worker_init_fn

        cfg = self.cfg
        if isinstance(data, DataLoader):
            if self.dist is not None and not isinstance(data.sampler, DistributedSampler):
                from torch_tricks.data.loader import rebuild_loader

                data = rebuild_loader(data, sampler=self._sampler(data.dataset, train))
            return data
        if isinstance(data, Dataset) and hasattr(data, "__len__"):
            sampler = self._sampler(data, train) if self.dist is not None else None
            return DataLoader(
                data,
                batch_size=cfg.batch_size,
                shuffle=train and sampler is None,
                sampler=sampler,
                generator=seeded_generator(cfg.seed) if train and sampler is None else None,
                worker_init_fn=worker_init_fn,
                pin_memory=self.device.type == "cuda",
            )
        return data  # any iterable of batches, taken as it is

    def _sampler(self, dataset: Dataset, train: bool) -> DistributedSampler:
        from torch_tricks.train.distributed import distributed_sampler

        return distributed_sampler(dataset, self.dist, shuffle=train, seed=self.cfg.seed)

    def _build_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        cfg = self.cfg
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        params = self.raw_model.parameters()
        if callable(optimizer):
            return optimizer([p for p in params if p.requires_grad])
        from torch_tricks.train.optim import build_optimizer, param_groups

        lr = cfg.lr
        if cfg.scale_lr:
            from torch_tricks.train.schedule import scale_lr

            world = self.dist.world_size if self.dist else 1
            lr = scale_lr(cfg.lr, cfg.batch_size * cfg.accumulate * world, base_batch=cfg.base_batch)
            self.history.applied.append(f"scale_lr={lr:.3g}")
        groups = (
            param_groups(self.raw_model, cfg.weight_decay)
            if cfg.no_decay_norm_bias
            else [{"params": [p for p in params if p.requires_grad], "weight_decay": cfg.weight_decay}]
        )
        opt = build_optimizer(
            groups, cfg.optimizer, lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
            fused=None if cfg.fused_optimizer else False, foreach=None if cfg.fused_optimizer else False,
        )
        if cfg.fused_optimizer:  # say which multi-tensor form PyTorch could give this optimizer here
            kind = "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else ""
            self.history.applied.append(f"{kind}_optimizer" if kind else "fused_optimizer=unavailable")
        return opt

    def _total_steps(self) -> int:
        cfg = self.cfg
        by_epochs = self.steps_per_epoch * cfg.epochs if self.steps_per_epoch else 0
        if cfg.max_steps and by_epochs:
            return min(cfg.max_steps, by_epochs)
        return cfg.max_steps or by_epochs

    def _build_scheduler(self) -> Any:
        cfg = self.cfg
        if cfg.schedule == "constant" and not cfg.warmup_steps:
            return None
        if not self.total_steps:
            raise UserError("a learning-rate schedule needs a known length: give max_steps or sized data")
        from torch_tricks.train.schedule import warmup_schedule

        return warmup_schedule(self.optimizer, cfg.warmup_steps, self.total_steps, kind=cfg.schedule)

    def _build_ema(self) -> Any:
        if not self.cfg.ema:
            return None
        from torch_tricks.train.ema import EMA

        self.history.applied.append("ema")
        return EMA(self.raw_model, decay=self.cfg.ema_decay)

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
            with anomaly:
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
            if self.step == 1 and not self.history.first_step_s:
                _sync(self.device)
                self.history.first_step_s = time.perf_counter() - t_step
            running += loss
            running_n += 1
            if self.step % cfg.log_every == 0:
                _sync(self.device)
                now = time.perf_counter()
                if self.step > cfg.log_every or not cfg.compile:  # the compiling interval is not a step time
                    step_times.append((now - t_log) / running_n)
                self._log({"step": self.step, "epoch": epoch, "split": "train",
                           "loss": float(running) / running_n, "lr": self.optimizer.param_groups[0]["lr"],
                           "elapsed_s": now - self._t_start}, bar)
                running.zero_()
                running_n = 0
                t_log = now
            if bar is not None:
                bar.update(1)
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self._save(epoch, batch_index)
            if self.total_steps and self.step >= self.total_steps:
                self._end_epoch(epoch, batch_index, finished=True)
                return True
        self._end_epoch(epoch, batch_index, finished=False)
        return False

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
        """One optimizer step over a group of loader batches; returns the detached loss."""
        while True:
            try:
                loss = self._accumulate(group)
                break
            except _OutOfMemory:
                self.optimizer.zero_grad(set_to_none=True)
                smallest = min(_batch_size(b) for b in group)
                if not self.cfg.auto_micro_batch or self.micro * 2 > smallest:
                    raise UserError(
                        f"out of memory at step {self.step + 1} with micro-batches of "
                        f"{max(1, smallest // self.micro)}: lower batch_size, or set auto_micro_batch"
                    ) from None
                self.micro *= 2
                self.history.micro_batches = self.micro
        cfg = self.cfg
        finite = self._all_finite(loss)
        if not finite and not self.scaler.is_enabled():
            raise TrainingDiverged(
                f"loss is {float(loss)} at step {self.step + 1} (epoch {self.epoch}); "
                f"last good checkpoint: {self.last_good or 'none saved (set checkpoint_dir)'}"
            )
        if cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.raw_model.parameters(), cfg.grad_clip)
        from torch_tricks.train.precision import scaler_step

        stepped = scaler_step(self.scaler, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if not stepped:
            self.history.skipped_steps += 1
            return torch.zeros((), device=self.device)
        if self.scheduler is not None and not self._swa_active():
            self.scheduler.step()
        if self._swa_active() and self.swa.scheduler is not None:
            self.swa.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.raw_model)
        return loss

    def _accumulate(self, group: list[Any]) -> torch.Tensor:
        """Forward/backward of every micro-batch of ``group``, each loss weighted by its
        share of the group's samples; DDP all-reduces only on the last one."""
        from torch_tricks.train.distributed import any_rank, no_sync_if
        from torch_tricks.train.precision import autocast

        micro = [m for b in group for m in _split(b, self.micro)]
        counts = [_count(m) for m in micro]
        total = sum(counts)
        loss_sum = torch.zeros((), device=self.device)
        for i, (mb, n) in enumerate(zip(micro, counts)):
            last = i == len(micro) - 1
            oom = False
            try:
                x, y = self._to_device(mb)
                with no_sync_if(self.model, not last), autocast(self.cfg.precision, self.device):
                    out = self.model(*x) if isinstance(x, tuple) else self.model(x)
                    loss = self.loss_fn(out, y) * (n / total)
                self.scaler.scale(loss).backward()
                loss_sum += loss.detach().float()
                del out, loss
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                oom = True
            if self.dist is not None:
                oom = any_rank(oom)  # every rank retries together, none waits in an all-reduce
            if oom:
                raise _OutOfMemory()
        return loss_sum

    def _all_finite(self, loss: torch.Tensor) -> bool:
        if not self.cfg.nan_guard:
            return True
        bad = not bool(torch.isfinite(loss))
        if self.dist is not None:
            from torch_tricks.train.distributed import any_rank

            bad = any_rank(bad)
        return not bad

    def _to_device(self, batch: Any) -> tuple[Any, Any]:
        x, y = _xy(batch)
        nb = self.device.type == "cuda"
        if self.cfg.channels_last:
            from torch_tricks.train.speed import to_channels_last

            x = to_channels_last(x)
        move = (lambda t: t.to(self.device, non_blocking=nb) if isinstance(t, torch.Tensor) else t)
        x = tuple(move(t) for t in x) if isinstance(x, (tuple, list)) else move(x)
        return x, move(y)

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
            from torch_tricks.train.ema import SWA

            self.swa = SWA(self.raw_model, self.optimizer, swa_lr=cfg.swa_lr or None)
            self.history.applied.append("swa")

    def _swa_active(self) -> bool:
        return self.swa is not None

    # -- checkpoints ----------------------------------------------------------------------
    def _ckpt_path(self) -> Path | None:
        return Path(self.cfg.checkpoint_dir) / "last.pt" if self.cfg.checkpoint_dir else None

    def _save(self, epoch: int, batch_index: int) -> None:
        path = self._ckpt_path()
        if path is None:
            return
        from torch_tricks.train.checkpoint import save_checkpoint

        save_checkpoint(
            path, model=self.raw_model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, ema=self.ema, step=self.step, epoch=epoch, batch_index=batch_index,
            extra={"micro_batches": self.micro, "skipped_steps": self.history.skipped_steps},
        )
        self.last_good = f"{path} (step {self.step})"
        self.history.checkpoint = str(path)

    def _maybe_resume(self) -> None:
        path = self._ckpt_path()
        if not self.cfg.resume or path is None or not path.exists():
            return
        from torch_tricks.train.checkpoint import load_checkpoint

        report = load_checkpoint(
            path, model=self.raw_model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=self.scaler, ema=self.ema, map_location=self.device,
        )
        self.step = report.step
        self.start_epoch = report.epoch
        self.skip_batches = report.batch_index
        extra = report.extra or {}
        self.micro = int(extra.get("micro_batches", 1))
        self.history.skipped_steps = int(extra.get("skipped_steps", 0))
        self.history.resumed_from_step = report.step
        self.last_good = f"{path} (step {self.step})"

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
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(log_dir / "tensorboard"))
        except Exception:  # tensorboard not installed: CSV only
            self._tb = None

    def _log(self, row: dict[str, Any], bar: Any) -> None:
        self.history.rows.append(row)
        if not self.is_main:
            return
        if self._csv is not None:
            self._csv[1].writerow(row)
            self._csv[0].flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, float) and k not in ("elapsed_s",):
                    self._tb.add_scalar(f"{row['split']}/{k}", v, row["step"])
        if bar is not None:
            bar.set_postfix({k: f"{v:.4g}" for k, v in row.items() if isinstance(v, float) and k != "elapsed_s"})

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
        if step_times:
            h.step_s = sorted(step_times)[len(step_times) // 2]
        if self.cfg.compile and h.first_step_s and h.step_s:
            h.compile_s = max(0.0, h.first_step_s - h.step_s)
        if self.swa is not None:
            self.swa.finalize(self.train_loader, lambda b: self._to_device(b)[0])
            metrics = _evaluate(self.swa.module, self.val_loader, self.loss_fn, self) if self.val_loader else {}
            if metrics:
                self._log_final({f"{k}_swa": v for k, v in metrics.items()})
        for row in reversed(h.rows):
            if row.get("split") == "val":
                h.final = {k: v for k, v in row.items() if isinstance(v, float)}
                break
        if self.dist is not None:
            from torch_tricks.train.distributed import barrier

            barrier()

    def _log_final(self, metrics: dict[str, float]) -> None:
        self.history.rows.append({"step": self.step, "epoch": self.history.epochs - 1, "split": "val", **metrics})


_CSV_FIELDS = ["step", "epoch", "split", "loss", "acc", "loss_ema", "acc_ema", "lr", "elapsed_s"]


class _OutOfMemory(Exception):
    """Internal: a micro-batch ran out of memory (on any rank)."""


def _evaluate(model: nn.Module, loader: Iterable[Any], loss_fn: Callable, trainer: _Trainer) -> dict[str, float]:
    """Mean loss and (for class targets) accuracy, in eval mode under inference_mode (T13)."""
    from torch_tricks.train.precision import autocast

    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
    correct = torch.zeros((), dtype=torch.int64, device=trainer.device)
    n = 0
    classify = True
    with torch.inference_mode():
        for batch in loader:
            x, y = trainer._to_device(batch)
            with autocast(trainer.cfg.precision, trainer.device):
                out = model(*x) if isinstance(x, tuple) else model(x)
            count = _count((x, y))
            loss_sum += loss_fn(out.float() if isinstance(out, torch.Tensor) else out, y).double() * count
            pred = primary_output(out) if classify else None
            if classify and pred.dim() == 2 and isinstance(y, torch.Tensor) and y.dim() == 1 and not y.is_floating_point():
                correct += (pred.argmax(1) == y).sum()
            else:
                classify = False
            n += count
    model.train(was_training)
    if trainer.dist is not None:
        from torch_tricks.train.distributed import all_reduce_sum

        loss_sum, correct, n = all_reduce_sum(loss_sum), all_reduce_sum(correct), int(all_reduce_sum(torch.tensor(n, device=trainer.device)))
    out = {"loss": float(loss_sum) / max(n, 1)}
    if classify:
        out["acc"] = int(correct) / max(n, 1)
    return out


def _as_config(config: Any) -> TrainConfig | None:
    if isinstance(config, (str, os.PathLike)):
        from torch_tricks.train.config import load_config

        return TrainConfig.from_dict(load_config(config))
    if isinstance(config, dict):
        return TrainConfig.from_dict(config)
    return config


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


def _xy(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, dict):
        return batch["input"], batch["target"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise UserError("each batch must be (inputs, target) or a dict with 'input' and 'target'")


def _count(batch: Any) -> int:
    """Samples (class targets) or tokens (sequence targets) in a batch: the target's element count."""
    _, y = _xy(batch)
    return int(y.numel()) if isinstance(y, torch.Tensor) else len(y)


def _batch_size(batch: Any) -> int:
    _, y = _xy(batch)
    return int(y.shape[0]) if isinstance(y, torch.Tensor) else len(y)


def _split(batch: Any, parts: int) -> list[Any]:
    """Split a batch into ``parts`` micro-batches along dim 0 (fewer if it is smaller)."""
    if parts == 1:
        return [batch]
    x, y = _xy(batch)
    n = _batch_size(batch)
    size = math.ceil(n / parts)

    def chunk(t: Any, i: int) -> Any:
        if isinstance(t, torch.Tensor):
            return t[i : i + size]
        if isinstance(t, (tuple, list)):
            return type(t)(chunk(u, i) for u in t)
        return t

    return [(chunk(x, i), chunk(y, i)) for i in range(0, n, size)]


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError if hasattr(torch, "OutOfMemoryError") else torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def _set_epoch(loader: Any, epoch: int, seed: int) -> None:
    """Make this epoch's shuffle a function of (seed, epoch) so a resumed run replays it."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
    elif isinstance(sampler, RandomSampler):
        if sampler.generator is None:
            sampler.generator = torch.Generator()
        sampler.generator.manual_seed(seed * 100_003 + epoch)


def _adjust_bn_momentum(model: nn.Module, k: int) -> None:
    """k updates at m' move the running stats as far as one update at m: m' = 1 - (1 - m)^(1/k)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is not None:
            m.momentum = 1 - (1 - m.momentum) ** (1 / k)


def _len(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:
        return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
