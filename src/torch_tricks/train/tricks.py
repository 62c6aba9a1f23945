"""``Tricks``: a tuned configuration carried into a training loop you keep.

::

    tricks = torch_tricks.Tricks("tune-report/tricks.toml")   # or a TrainConfig / dict
    model, optimizer = tricks.prepare(model, optimizer)       # channels_last, checkpointing, compile, fused optim, EMA ...
    for batch in loader:
        batch = tricks.to_device(batch)                       # the config's device; auto is CUDA where there is one
        with tricks.autocast():
            loss = model(**batch).loss
        tricks.backward(loss)      # grad scaler, accumulation scaling, no DDP sync on non-final micro-batches
        tricks.step()              # NaN guard, clip, step, scheduler, EMA, zero_grad; a no-op between boundaries

This is *the* step of torch-tricks: :func:`torch_tricks.fit` and :class:`TrainStep` (which
the tuner times) are built on it, so a switch measured by ``tune`` is the switch your
loop gets. Each switch of :class:`TrainConfig` is applied at the one place it belongs:

* ``Tricks(...)``: device, ``torchrun`` process group, seeding (the same seed ``fit``
  uses), cudnn benchmark, a kept heap on CPU, the intra-op thread count (process-wide, as
  in the tune that timed the step);
* :meth:`prepare`: the model changes (in-place activations, memory-efficient BN,
  activation checkpointing, a causal LM's chunked loss, BN momentum for accumulation, SyncBN under DDP, device,
  channels_last), then the wrappers (DDP, FSDP2 per block under ``distributed = fsdp``,
  compile); the optimizer (a ZeroRedundancyOptimizer under ``zero1``; built from the config
  with no-decay groups when you pass none; yours switched to its fused step in place, so
  your own scheduler stays bound to it, or, under ``optimizer_state`` / ``optimizer_in_backward``,
  rebuilt with the same groups and settings, your scheduler moved onto the new one and the
  old one's ``step`` retired); the lr schedule (warm-up/cosine) when the config asks for one;
  the grad scaler (fp16) and the EMA;
* :meth:`autocast`: the forward's precision, and ``no_sync`` under DDP on every
  micro-batch but a group's last;
* :meth:`backward`: the loss divided by ``accumulate`` (``fit`` passes each micro-batch's
  share of samples instead), scaled for fp16;
* :meth:`step`: on the ``accumulate``-th backward: the NaN guard (one host sync),
  unscale + clip, the optimizer step through the scaler, zero_grad(set_to_none), the
  scheduler (not after a step the fp16 scaler skipped), the EMA update.

:meth:`state_dict` holds what a resume needs: model, optimizer, scheduler, scaler, EMA,
the step count and the accumulation position (with the gradients of a half-done group).
In an Accelerate loop (``Tricks(..., accelerator=accelerator)``, the Accelerator stepping
the optimizer), :meth:`after_step` follows the Accelerator's real steps only, and
:meth:`checkpointable` is the part of the state the Accelerator does not save itself, for
``accelerator.register_for_checkpointing``.

Written here rather than taken from Accelerate: Accelerate has no activation
checkpointing, channels_last, EMA, NaN guard or fused-optimizer switches, and the same
object must also be the step ``fit`` and the tuner run.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from torch_tricks.batches import to_device as batch_to_device
from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError
from torch_tricks.machine import set_threads
from torch_tricks.train.attention import set_attention
from torch_tricks.train.compile_modes import check_compile_mode, compile_kwargs
from torch_tricks.train.float8 import float8_available, float8_linears, float8_training
from torch_tricks.train.liger import apply_liger, liger_support
from torch_tricks.train.matmul_mode import set_fp32_matmul
from torch_tricks.seed import seed_everything, seeded_generator, worker_init_fn
from torch_tricks.train.checkpoint import _atomic_torch_save
from torch_tricks.train.config import TrainConfig, load_config, why_not_in_backward
from torch_tricks.train.distributed import (
    any_rank,
    barrier,
    distributed_sampler,
    init_distributed,
    no_sync_if,
    wrap_ddp,
)
from torch_tricks.train.ema import EMA
from torch_tricks.train.in_backward import optimizer_in_backward
from torch_tricks.train.lm_loss import chunk_lm_loss
from torch_tricks.train.offload import check_device as check_offload_device
from torch_tricks.train.offload import offload_activations
from torch_tricks.train.optim_state import already_on, low_precision_state
from torch_tricks.train.memory import (
    checkpoint_blocks,
    checkpoint_sequential_sqrt,
    inplace_activations,
    memory_efficient_bn_act,
)
from torch_tricks.train.optim import _fused_devices, build_optimizer, param_groups
from torch_tricks.train.precision import autocast as precision_autocast
from torch_tricks.train.precision import check_precision, make_grad_scaler, scaler_step
from torch_tricks.train.rebuild import check_scheduler, move_scheduler, retire
from torch_tricks.train.schedule import scale_lr, warmup_schedule
from torch_tricks.train.sharded_checkpoint import last_sharded, load_sharded, save_sharded
from torch_tricks.train.sharding import shard_fsdp, zero1_optimizer
from torch_tricks.train.speed import channels_last, compile_model, cudnn_benchmark, keep_heap
from torch_tricks.train.syncbn import convert_sync_batchnorm

__all__ = ["Tricks", "TricksState", "TrainingDiverged", "apply_model_switches", "config_optimizer", "config_scheduler"]


class TrainingDiverged(UserError):
    """A non-finite loss stopped the run; the message names the step and the last good checkpoint."""


class Tricks:
    """The step of a :class:`TrainConfig` (a path to its TOML/YAML file, a dict, or keyword overrides).

    ``accelerator``: the Accelerate ``Accelerator`` of a loop where it steps the optimizer (not a
    config key): :meth:`after_step` then does nothing on a micro-batch it did not step on.
    """

    def __init__(self, config: TrainConfig | dict[str, Any] | str | os.PathLike[str] | None = None, *,
                 accelerator: Any = None, **overrides: Any) -> None:
        self.config = (as_config(config) or TrainConfig()).replace(**overrides).validate()
        self.accelerator = accelerator
        self.applied: list[str] = []  # the switches that took effect, in order
        self.model: nn.Module | None = None  # what to call: the prepared model under its wrappers
        self.unwrapped_model: nn.Module | None = None  # the prepared module whose parameters train
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.ema: Any = None
        self.step_count = 0  # optimizer steps taken, fp16-skipped ones included
        self.skipped_steps = 0  # fp16 steps the grad scaler skipped (inf/NaN gradients)
        self.group_loss = torch.zeros(())  # the summed (weighted) loss of the last finished group, detached
        self.last_good = ""  # the last checkpoint, named when the NaN guard stops a run
        self._micro = 0  # backward calls in the group under way
        self._group = 0  # this group's size when set by fit (micro-batch splits); 0 = config.accumulate
        self._ddp: nn.Module | None = None
        self._fsdp: nn.Module | None = None
        self._setup_runtime()
        self.scaler = make_grad_scaler(self.config.precision, self.device)
        self._loss_sum = torch.zeros((), device=self.device)

    # -- the five calls ------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Any = None, *extra: Any, total_steps: int | None = None) -> Any:
        """``(model, optimizer, *extra)`` ready for the loop.

        ``optimizer``: yours (switched to its fused step in place when the config asks and
        PyTorch has one; under ``optimizer_state`` or ``optimizer_in_backward`` rebuilt with
        its groups and settings: use the one returned, the old one's ``step`` raises), a
        callable ``params -> optimizer``, or None to build ``config.optimizer`` with no-decay
        groups. ``extra``: your lr scheduler, built on your optimizer (stepped by :meth:`step`;
        moved onto a rebuilt optimizer), and/or DataLoaders (given a DistributedSampler under
        ``torchrun``), returned in the order given. A schedule of the config (warm-up, cosine)
        is built when you pass no scheduler; its length is ``total_steps``, else ``max_steps``,
        else ``epochs`` x the steps of the first DataLoader given.
        """
        self._check_can_prepare(model)
        out = [self._prepare_extra(obj) for obj in extra]
        if self.scheduler is not None:  # before anything changes: a scheduler that cannot follow is refused first
            check_scheduler(self.scheduler, optimizer, self._rebuilt_by(optimizer))
        self.unwrapped_model = self._prepare_model(model)
        fsdp_ema = self._fsdp_mode() and self.config.ema
        if fsdp_ema:  # the average is copied from the whole model, then sharded as the model is
            self.ema = self._build_ema()
        self.model = self._wrap_model(self.unwrapped_model)
        if fsdp_ema:
            self._shard(self.ema.module)
        self.optimizer = self._build_optimizer(optimizer)
        if isinstance(optimizer, torch.optim.Optimizer) and self.optimizer is not optimizer:
            self._hand_over(optimizer)
        if self.scheduler is None:
            self.scheduler = self._build_scheduler(total_steps, _first_loader(out))
        if not fsdp_ema:
            self.ema = self._build_ema()
        return (self.model, self.optimizer, *out)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's context: the config's precision, DDP's ``no_sync`` unless this micro-batch ends its group,
        and the activation offload when switched on."""
        stack = contextlib.ExitStack()
        if self._ddp is not None:
            stack.enter_context(no_sync_if(self._ddp, not self.sync_gradients))
        if self._fsdp is not None:  # no reduce-scatter before a group's last micro-batch
            self._fsdp.set_requires_gradient_sync(self.sync_gradients)
        stack.enter_context(precision_autocast(self.config.precision, self.device))
        if self.config.offload_activations:
            stack.enter_context(offload_activations())
        return stack

    def backward(self, loss: torch.Tensor, *, weight: float | None = None) -> torch.Tensor:
        """Backward of ``loss`` x ``weight`` (default ``1 / accumulate``), through the fp16 scaler; returns it detached."""
        self._need_prepare()
        _check_loss(loss)
        w = 1.0 / self.config.accumulate if weight is None else weight
        loss = loss.reshape(()) * w if w != 1.0 else loss.reshape(())
        self.scaler.scale(loss).backward()
        done = loss.detach().float()
        self._loss_sum += done
        self._micro += 1
        return done

    def step(self) -> bool:
        """The optimizer step at a group's end (see the module doc); True if the weights changed."""
        self._need_prepare()
        if self._micro == 0 or self._micro < (self._group or self.config.accumulate):
            return False
        return self._optimizer_step()

    # -- a step your own code takes (an Accelerate loop: the Accelerator steps the optimizer) -----
    def guard(self, loss: torch.Tensor) -> None:
        """The NaN guard on ``loss`` before an optimizer step your code takes: a non-finite loss drops the gradients
        and stops the run (:class:`TrainingDiverged`, naming the step). One host sync; nothing when nan_guard is off."""
        self._need_prepare()
        if not self._all_finite(loss.detach().float()):
            self._diverged(loss.detach())

    def after_step(self) -> bool:
        """After an optimizer step your code took: the config's lr schedule and EMA follow it, and it is counted
        (``step_count``); True. With an ``accelerator``: nothing on a micro-batch it did not step on
        (``sync_gradients`` false), and a step its fp16 scaler skipped is counted (``skipped_steps``) but moves
        neither the schedule nor the EMA; False for both."""
        self._need_prepare()
        acc = self.accelerator
        if acc is not None and not acc.sync_gradients:
            return False
        self.step_count += 1
        if acc is not None and getattr(acc, "optimizer_step_was_skipped", False):
            self.skipped_steps += 1
            return False
        self._after_step()
        return True

    def checkpointable(self) -> "TricksState":
        """The part of the state an Accelerator does not save itself (step count, lr schedule, EMA with its update
        count, grad scaler; not the model or optimizer): ``accelerator.register_for_checkpointing(
        tricks.checkpointable())`` saves and restores it with ``save_state`` / ``load_state``."""
        self._need_prepare()
        return TricksState(self)

    # -- around the loop -----------------------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        """True when the next backward ends an accumulation group (the step after it is real)."""
        return self._micro + 1 >= (self._group or self.config.accumulate)

    def flush(self) -> bool:
        """Step on a short last group (an epoch's end): what accumulated so far, as one update."""
        return self._optimizer_step() if self._micro else False

    def zero_grad(self) -> None:
        """Drop a half-done group (its gradients and loss), e.g. to retry it in smaller micro-batches."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        self._loss_sum.zero_()

    def to_device(self, batch: Any) -> Any:
        """``batch`` (any form of :mod:`torch_tricks.batches`) on the device; images channels_last if switched on."""
        return batch_to_device(batch, self.device, channels_last=self.config.channels_last)

    def prepare_data(self, data: Any, *, train: bool = True) -> Any:
        """A loader for ``data``: a Dataset gets a seeded DataLoader of ``batch_size``; under ``torchrun``
        a DataLoader is rebuilt with a DistributedSampler; any other iterable is kept as it is."""
        if isinstance(data, DataLoader):
            if self.dist is not None and not isinstance(data.sampler, DistributedSampler):
                # here, not at the top: torch_tricks.data's __init__ imports the whole data package (~85 ms)
                from torch_tricks.data.loader import rebuild_loader

                data = rebuild_loader(data, sampler=self._sampler(data.dataset, train))
            return data
        if isinstance(data, Dataset) and hasattr(data, "__len__"):
            return self._new_loader(data, train)
        return data

    @property
    def ema_model(self) -> nn.Module | None:
        """The EMA weights' model (eval mode), or None without ``ema``."""
        return self.ema.module if self.ema is not None else None

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: model, optimizer, scheduler, scaler, EMA, step count, accumulation position."""
        self._need_prepare()
        if self._sharded_mode():
            raise UserError(f"under distributed = {self.config.distributed} the state is sharded across ranks: "
                            "save it with tricks.save(folder) on every rank (a DCP checkpoint every rank writes its "
                            "shards of), not tricks.state_dict()")
        return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": self.unwrapped_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "micro": self._micro,
            "loss_sum": self._loss_sum.detach().cpu(),
            "config": self.config.to_dict(),
        }
        if self._micro:  # a half-done group: its gradients are part of the state
            state["grads"] = self._grads_copy()
        return state

    def _grads_copy(self) -> list[torch.Tensor | None]:
        return [p.grad.detach().clone() if p.grad is not None else None for p in self.unwrapped_model.parameters()]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into the prepared model, optimizer, scheduler, scaler and EMA."""
        self._need_prepare()
        missing = [k for k in ("model", "optimizer", "scaler", "step_count") if k not in state]
        if missing:
            raise UserError(f"not a Tricks state (no {', '.join(missing)}): pass what tricks.state_dict() returned")
        self._load_components(state)
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._micro = int(state.get("micro", 0))
        self._loss_sum = torch.as_tensor(state.get("loss_sum", 0.0), dtype=torch.float32).to(self.device)
        self._restore_grads(state.get("grads") or [])

    def _load_components(self, state: dict[str, Any]) -> None:
        """The model, optimizer, scheduler (if both sides have one), scaler and EMA states."""
        self.unwrapped_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler") is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if state.get("ema") is not None:
            self._load_ema(state["ema"])

    def _load_ema(self, ema_state: Any) -> None:
        if self.ema is None:
            raise UserError("the state holds an EMA but this config has ema off: set ema = true to resume it")
        self.ema.load_state_dict(ema_state)

    def _restore_grads(self, grads: list[torch.Tensor | None]) -> None:
        """The gradients of a half-done group, as :meth:`state_dict` saved them (None: no gradient)."""
        for p, g in zip(self.unwrapped_model.parameters(), grads):
            p.grad = g.to(p.device) if g is not None else None

    def save(self, path: str | os.PathLike[str]) -> None:
        """:meth:`state_dict` to ``path``, atomically (a crash mid-write leaves the old file).

        Under ``torchrun`` call it on every rank. ``distributed = fsdp | zero1``: ``path`` is a
        folder and every rank writes its shards of a DCP checkpoint there (complete only once
        all are written; see :mod:`torch_tricks.train.sharded_checkpoint`); otherwise rank 0
        writes the one file. Either loads on any number of ranks, one plain process included
        (:meth:`load`).
        """
        self._need_prepare()
        if self._sharded_mode():
            if self._micro:
                raise UserError(f"under distributed = {self.config.distributed} save at a group's end (after "
                                "tricks.step()): the gradients of a half-done group are not saved")
            save_sharded(path, model=self.unwrapped_model, optimizer=self.optimizer, scheduler=self.scheduler,
                         scaler=self.scaler, ema=self.ema, step=self.step_count,
                         extra={"tricks": True, "skipped_steps": self.skipped_steps})
            return
        if self.is_main:
            _atomic_torch_save(self._state_dict(), Path(path))
        barrier()

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save` wrote: a file (loaded with weights_only), or a DCP folder of an fsdp run,
        on any number of ranks (call it on every rank)."""
        p = Path(path)
        self._need_prepare()
        if p.is_dir():
            self._load_folder(p)
            return
        if not p.is_file():
            raise UserError(f"no Tricks state at {str(p)!r}: give the file (or, under fsdp or zero1, the folder) "
                            "tricks.save() wrote")
        if self._fsdp_mode():
            raise UserError(f"{p} is a whole-model file; under distributed = fsdp load the folder tricks.save() "
                            "wrote under fsdp, or load this file under ddp or in one process")
        try:
            state = torch.load(p, map_location=self.device, weights_only=True)
        except Exception as exc:
            raise UserError(f"{p}: not a readable Tricks state ({type(exc).__name__}): the file is damaged or "
                            "not from tricks.save()") from None
        self.load_state_dict(state)

    def _load_folder(self, p: Path) -> None:
        """Restore the DCP checkpoint :meth:`save` wrote into folder ``p`` under fsdp or zero1."""
        folder = last_sharded(p)
        if folder is None:
            raise UserError(f"{str(p)!r} holds no complete sharded checkpoint: give the folder tricks.save() "
                            "wrote under distributed = fsdp or zero1, or the file it wrote otherwise")
        meta = load_sharded(folder, model=self.unwrapped_model, optimizer=self.optimizer,
                            scheduler=self.scheduler, scaler=self.scaler, ema=self.ema)
        self.step_count = int(meta["step"])
        self.skipped_steps = int((meta.get("extra") or {}).get("skipped_steps", 0))
        self._micro = 0
        self._loss_sum.zero_()

    # -- set-up ----------------------------------------------------------------------------------
    def _check_can_prepare(self, model: Any) -> None:
        if not isinstance(model, nn.Module):
            raise UserError(f"prepare() needs your nn.Module first, got {type(model).__name__}")
        if self.unwrapped_model is not None:
            raise UserError("prepare() was called already: make one Tricks per model")

    def _prepare_extra(self, obj: Any) -> Any:
        """One of prepare()'s extra arguments: a DataLoader prepared, or the lr scheduler to step."""
        if isinstance(obj, (DataLoader, Dataset)):
            return self.prepare_data(obj)
        if not _is_scheduler(obj):
            raise UserError(f"prepare() takes a model, an optimizer, then lr schedulers or DataLoaders; "
                            f"got {type(obj).__name__}")
        if self.scheduler is not None:
            raise UserError("prepare() got two lr schedulers: give one")
        self.scheduler = obj
        return obj

    def _setup_runtime(self) -> None:
        cfg = self.config
        self._init_process()
        check_precision(cfg.precision, self.device)
        if cfg.compile:  # before anything is applied: reduce-overhead on a CPU is one line
            check_compile_mode(cfg.compile, self.device)
        if cfg.offload_activations:
            check_offload_device(self.device)
            self.applied.append("offload_activations")
        if cfg.precision != "fp32":
            self.applied.append(f"precision={cfg.precision}")
        seed_everything(cfg.seed + (self.dist.rank if self.dist else 0), deterministic=cfg.deterministic,
                        device=self.device)
        self._process_wide_switches()

    def _init_process(self) -> None:
        """The process group (under ``torchrun``, when the config asks for one), the device, and whether main."""
        cfg = self.config
        self.dist = init_distributed(device=cfg.device) if _joins_process_group(cfg) else None
        if self.dist is not None:
            self.device = self.dist.device
        else:
            self.device = resolve_device(cfg.device)
        self.is_main = self.dist is None or self.dist.is_main

    def _process_wide_switches(self) -> None:
        """cudnn benchmark, the kept heap, intra-op threads and anomaly detection: settings of the process, not of
        the model. ``threads`` is checked against this machine's cores here, where it is applied: a configuration
        may be written on one machine and run on another."""
        cfg = self.config
        if cfg.threads:
            set_threads(cfg.threads)
            self.applied.append(f"threads={cfg.threads}")
        if cfg.fp32_matmul:  # checked against this device here: a file may be written on another machine
            set_fp32_matmul(cfg.fp32_matmul, self.device)
            self.applied.append(f"fp32_matmul={cfg.fp32_matmul}")
        if cfg.cudnn_benchmark:
            cudnn_benchmark(True, fixed_shapes=True)
            self.applied.append("cudnn_benchmark")
        if cfg.keep_heap and self.device.type == "cpu":
            if keep_heap():
                self.applied.append("keep_heap")
        if cfg.detect_anomaly:  # debugging only: slow, and for the rest of the process (fit scopes it to its run)
            torch.autograd.set_detect_anomaly(True)
            self.applied.append("detect_anomaly")

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        model, applied = apply_model_switches(model, self.config, distributed=self.dist is not None,
                                              device=self.device)
        self.applied += applied
        model = model.to(self.device)
        if self.config.channels_last:
            model = self._channels_last(model)
        return model

    def _channels_last(self, model: nn.Module) -> nn.Module:
        if self._fsdp_mode():
            # FSDP2 shards contiguous parameters only: the weights stay as they are and the inputs alone go
            # channels_last (to_device), which a convolution follows (its output and kernels take the input's)
            self.applied.append("channels_last=inputs")
            return model
        self.applied.append("channels_last")
        return channels_last(model)

    def _fsdp_mode(self) -> bool:
        return self.dist is not None and self.config.distributed == "fsdp"

    def _sharded_mode(self) -> bool:
        """fsdp or zero1 under torchrun: no rank holds the whole state (checkpoints are DCP folders)."""
        return self.dist is not None and self.config.distributed in ("fsdp", "zero1")

    def _shard(self, module: nn.Module) -> nn.Module:
        """FSDP2 on ``module`` with this config's precision and resharding (the model, and its EMA alike)."""
        return shard_fsdp(module, precision=self.config.precision, reshard_after_forward=self.config.fsdp_reshard)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if self._fsdp_mode():
            model = self._fsdp = self._shard(model)
            self.applied.append("fsdp")
        elif self.dist is not None:
            model = self._ddp = wrap_ddp(model, self.dist)
            self.applied.append("ddp")
        if self.config.compile:
            model = compile_model(model, **compile_kwargs(self.config.compile))
            self.applied.append("compile" if self.config.compile is True else f"compile={self.config.compile}")
        return model

    def _build_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        opt = self._build_local_optimizer(optimizer)
        if self.config.optimizer_in_backward:
            return self._in_backward(opt)
        if self.dist is not None and self.config.distributed == "zero1":
            opt = zero1_optimizer(opt)
            self.applied.append("zero1")
        return opt

    def _in_backward(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``opt`` stepped inside backward, one parameter at a time (T30); refused across ranks."""
        cfg = self.config
        across = self._ddp is not None or self._fsdp is not None or (self.dist is not None and cfg.distributed == "zero1")
        why = why_not_in_backward(accumulate=cfg.accumulate, grad_clip=cfg.grad_clip, precision=cfg.precision,
                                  distributed=across)
        if why:
            raise UserError(why)
        self.applied.append("optimizer_in_backward")
        return optimizer_in_backward(opt)

    def _build_local_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return self._adopt_optimizer(optimizer)
        if callable(optimizer):
            return self._low_precision_state(optimizer(self._trainable()))
        if optimizer is not None:
            raise UserError(f"optimizer must be a torch.optim.Optimizer, a callable params -> optimizer, or None; "
                            f"got {type(optimizer).__name__}")
        return self._config_optimizer()

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The user's own optimizer: rebuilt on low-precision state with its groups and settings when the config
        asks (torchao and bf16 have their own step), else switched to its fused step in place when it asks."""
        cfg = self.config
        if self._sharded_mode():
            raise UserError(f"under distributed = {cfg.distributed} Tricks builds the optimizer it shards: pass "
                            "prepare() no optimizer (config.optimizer) or a callable params -> optimizer")
        if cfg.optimizer_state:
            return self._low_precision_state(optimizer)
        if cfg.fused_optimizer:
            self.applied.append(_fast_step_note(_switch_to_fast_step(optimizer)))
        return optimizer

    def _rebuilt_by(self, optimizer: Any) -> str:
        """The switches that rebuild your ``optimizer`` into a new one ("" where prepare() keeps it)."""
        cfg = self.config
        if not isinstance(optimizer, torch.optim.Optimizer):
            return ""
        why = []
        if cfg.optimizer_state and not already_on(optimizer, cfg.optimizer_state):
            why.append(f"optimizer_state = {cfg.optimizer_state}")
        if cfg.optimizer_in_backward:
            why.append("optimizer_in_backward")
        return " and ".join(why)

    def _hand_over(self, old: torch.optim.Optimizer) -> None:
        """Your optimizer was rebuilt: the scheduler you gave drives the new one, and the old one steps no more."""
        if self.scheduler is not None:
            move_scheduler(self.scheduler, self.optimizer)
        retire(old, self._rebuilt_by(old))

    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.unwrapped_model.parameters() if p.requires_grad]

    def _config_optimizer(self) -> torch.optim.Optimizer:
        """``config.optimizer`` over the model, with no-decay groups and the scaled lr when switched on."""
        opt, applied = config_optimizer(self.unwrapped_model, self.config,
                                        world_size=self.dist.world_size if self.dist else 1)
        self.applied += applied
        return opt

    def _low_precision_state(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``opt`` on torchao's 8/4-bit state when ``optimizer_state`` asks (T29), else as it is."""
        if not self.config.optimizer_state:
            return opt
        self.applied.append(f"optimizer_state={self.config.optimizer_state}")
        return low_precision_state(opt, self.config.optimizer_state)

    def _build_scheduler(self, total_steps: int | None, loader: Any) -> Any:
        cfg = self.config
        if cfg.schedule == "constant" and not cfg.warmup_steps:
            return None
        total = total_steps or run_length(cfg, loader)[1]
        if not total:
            raise UserError("a learning-rate schedule needs a known length: give max_steps, total_steps= or a "
                            "sized DataLoader to prepare()")
        return config_scheduler(self.optimizer, cfg, total)

    def _build_ema(self) -> Any:
        if not self.config.ema:
            return None
        self.applied.append("ema")
        return EMA(self.unwrapped_model, decay=self.config.ema_decay)

    def _new_loader(self, data: Dataset, train: bool) -> DataLoader:
        """A DataLoader of ``batch_size`` over ``data``: seeded shuffling, or a DistributedSampler under torchrun;
        token rows of different lengths batched as ``token_batches`` says (T39-T41)."""
        from torch_tricks.data.token_batches import is_token_rows  # here: the data package costs ~85 ms

        cfg = self.config
        sampler = self._sampler(data, train) if self.dist is not None else None
        if is_token_rows(data):
            return self._token_loader(data, train, sampler)
        shuffle = train and sampler is None
        return DataLoader(
            data, batch_size=cfg.batch_size, shuffle=shuffle, sampler=sampler,
            generator=seeded_generator(cfg.seed) if shuffle else None,
            worker_init_fn=worker_init_fn, pin_memory=self.device.type == "cuda",
        )

    def _token_loader(self, data: Dataset, train: bool, sampler: DistributedSampler | None) -> DataLoader:
        from torch_tricks.data.token_batches import max_positions, pad_collate, packing_keywords, token_loader

        cfg, model = self.config, self.unwrapped_model
        pad_id = _pad_id(model)
        if sampler is not None:
            if cfg.token_batches in ("grouped", "packed"):
                raise UserError(f"token_batches = {cfg.token_batches} is not built for torchrun yet (its batches are "
                                "not split across ranks): use padded, or pass your own DataLoader")
            pad_to = max_positions(model) if cfg.token_batches == "max" else None
            return DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, collate_fn=pad_collate(
                pad_id=pad_id, pad_to=pad_to), pin_memory=self.device.type == "cuda")
        keywords = packing_keywords(model) if cfg.token_batches == "packed" else None
        trick = {"padded": "dynamic_padding", "grouped": "length_grouped", "packed": "packing"}.get(cfg.token_batches)
        if trick is not None and trick not in self.applied:
            self.applied.append(trick)
        return token_loader(data, batch_size=cfg.batch_size, mode=cfg.token_batches, row_len=max_positions(model),
                            pad_id=pad_id, seed=cfg.seed, shuffle=train, keywords=keywords,
                            pin_memory=self.device.type == "cuda")

    def _sampler(self, dataset: Dataset, train: bool) -> DistributedSampler:
        return distributed_sampler(dataset, self.dist, shuffle=train, seed=self.config.seed)

    # -- the step ----------------------------------------------------------------------------------
    def _optimizer_step(self) -> bool:
        cfg = self.config
        loss = self._loss_sum.clone()
        self._micro = 0
        self._loss_sum.zero_()
        if not self._all_finite(loss) and not self.scaler.is_enabled():
            self._diverged(loss)
        if cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.unwrapped_model.parameters(), cfg.grad_clip)
        stepped = scaler_step(self.scaler, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        if not stepped:
            self.skipped_steps += 1
            self.group_loss = torch.zeros((), device=self.device)
            return False
        self._after_step()
        self.group_loss = loss
        return True

    def _diverged(self, loss: torch.Tensor) -> NoReturn:
        """Drop the group's gradients and stop the run, naming the step and the last good checkpoint."""
        self.optimizer.zero_grad(set_to_none=True)
        raise TrainingDiverged(
            f"loss is {float(loss)} at step {self.step_count + 1}; "
            f"last good checkpoint: {self.last_good or 'none saved (set checkpoint_dir)'}"
        )

    def _after_step(self) -> None:
        """The scheduler and the EMA follow a step the optimizer took."""
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.unwrapped_model)

    def _all_finite(self, loss: torch.Tensor) -> bool:
        if not self.config.nan_guard:
            return True
        bad = not bool(torch.isfinite(loss))
        if self.dist is not None:
            bad = any_rank(bad)
        return not bad

    def _need_prepare(self) -> None:
        if self.optimizer is None:
            raise UserError("call tricks.prepare(model, optimizer) first")


class TricksState:
    """The part of a :class:`Tricks`' state an Accelerator does not save itself: the step count (and fp16-skipped
    steps), the lr schedule, the EMA with its update count and the grad scaler; not the model and the optimizer.
    What :meth:`Tricks.checkpointable` returns, for ``accelerator.register_for_checkpointing``."""

    def __init__(self, tricks: Tricks) -> None:
        self.tricks = tricks

    def state_dict(self) -> dict[str, Any]:
        t = self.tricks
        return {
            "step_count": t.step_count,
            "skipped_steps": t.skipped_steps,
            "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
            "ema": t.ema.state_dict() if t.ema is not None else None,
            "scaler": t.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a schedule or EMA on one side only is refused (the run would not go on as
        it was)."""
        t = self.tricks
        missing = [k for k in ("step_count", "scheduler", "ema", "scaler") if k not in state] \
            if isinstance(state, dict) else ["step_count"]
        if missing:
            raise UserError(f"not the state of tricks.checkpointable() (no {', '.join(missing)}): load what its "
                            "state_dict() returned")
        _same_side("an lr schedule", state["scheduler"], t.scheduler,
                   "the same schedule (config.schedule / warmup_steps, or your scheduler given to prepare())")
        _same_side("an EMA", state["ema"], t.ema, "the same ema setting")
        if t.scheduler is not None:
            t.scheduler.load_state_dict(state["scheduler"])
        if t.ema is not None:
            t.ema.load_state_dict(state["ema"])
        t.scaler.load_state_dict(state["scaler"])
        t.step_count = int(state["step_count"])
        t.skipped_steps = int(state.get("skipped_steps", 0))


def apply_model_switches(model: nn.Module, config: TrainConfig, *, distributed: bool = False,
                         channels_last_weights: bool = False, device: torch.device | str | None = None
                         ) -> tuple[nn.Module, list[str]]:
    """The model changes of a configuration, in :meth:`Tricks.prepare`'s order: in-place activations,
    memory-efficient BN, activation checkpointing, the chunked LM loss, BN momentum for accumulation, SyncBN
    (``distributed``: under torchrun), and with ``channels_last_weights`` the weights channels_last (``Tricks``
    does that after moving the model). Returns the model (the same object, except where checkpointing by
    ``sqrt`` wraps an nn.Sequential) and the switches applied. Also what the trainer integrations call."""
    applied: list[str] = []
    dev = torch.device(device) if device is not None else next(model.parameters(), torch.empty(0)).device
    _check_kernel_switches(model, config, dev)  # before any change: float8 or Liger on a CPU is one line
    if config.attention:  # T34: for the device it will train on (FlexAttention has no backward on a CPU)
        set_attention(model, config.attention, dev)
        applied.append(f"attention={config.attention}")
    applied += _apply_kernel_switches(model, config, dev)
    if config.inplace:
        model = inplace_activations(model)
        applied.append("inplace")
    if config.memory_efficient_bn:
        model = memory_efficient_bn_act(model)
        applied.append("memory_efficient_bn")
    if config.checkpointing:
        model = _with_checkpointing(model, config.checkpointing)
        applied.append(f"checkpointing={config.checkpointing}")
    if config.chunked_lm_loss:
        model = chunk_lm_loss(model)
        applied.append("chunked_lm_loss")
    if config.bn_momentum_adjust and config.accumulate > 1:
        _adjust_bn_momentum(model, config.accumulate)
        applied.append("bn_momentum_adjust")
    if config.sync_bn and distributed:
        model = convert_sync_batchnorm(model)
        applied.append("sync_bn")
    if config.channels_last and channels_last_weights:
        model = channels_last(model)
        applied.append("channels_last")
    return model, applied


def _apply_kernel_switches(model: nn.Module, config: TrainConfig, device: torch.device) -> list[str]:
    """Liger (T38: patches the model's own forward functions, before anything wraps them), then float8 (T37: swaps
    Linear modules, their parameters kept, before checkpointing or compile)."""
    applied = []
    if config.liger:
        apply_liger(model, device)
        applied.append("liger")
    if config.float8:
        _, n, total = float8_training(model, device)
        applied.append(f"float8 ({n} of {total} Linear layers)")
    return applied


def _check_kernel_switches(model: nn.Module, config: TrainConfig, device: torch.device) -> None:
    """float8 (T37) and Liger (T38) checked for this model and device, before the model changes."""
    if config.float8:
        ok, why = float8_available(device)
        if ok and not float8_linears(model)[0]:
            ok, why = False, "none of the model's Linear layers has both dimensions divisible by 16"
        if not ok:
            raise UserError(f"float8: {why}")
    if config.liger:
        ok, why = liger_support(model, device)
        if not ok:
            raise UserError(f"liger: {why}")


def config_optimizer(model: nn.Module, config: TrainConfig, *, world_size: int = 1
                     ) -> tuple[torch.optim.Optimizer, list[str]]:
    """``config.optimizer`` over ``model``'s trainable parameters as :meth:`Tricks.prepare` builds it: no-decay
    groups, the lr scaled to the global batch (``world_size`` processes) when ``scale_lr``, the fused or foreach
    step, the low-precision state; returns it and the switches applied. Also what the trainer integrations call."""
    applied: list[str] = []
    lr = config.lr
    if config.scale_lr:
        lr = scale_lr(config.lr, config.batch_size * config.accumulate * world_size, base_batch=config.base_batch)
        applied.append(f"scale_lr={lr:.3g}")
    groups = (param_groups(model, config.weight_decay) if config.no_decay_norm_bias
              else [{"params": [p for p in model.parameters() if p.requires_grad],
                     "weight_decay": config.weight_decay}])
    fast = None if config.fused_optimizer and not config.optimizer_state else False
    opt = build_optimizer(groups, config.optimizer, lr=lr, weight_decay=config.weight_decay,
                          momentum=config.momentum, fused=fast, foreach=fast)
    if config.optimizer_state:
        applied.append(f"optimizer_state={config.optimizer_state}")
        return low_precision_state(opt, config.optimizer_state), applied
    if config.fused_optimizer:  # say which multi-tensor form PyTorch could give this optimizer here
        applied.append(_fast_step_note(_fast_step_kind(opt) or ""))
    return opt, applied


def config_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_steps: int) -> Any:
    """The lr schedule of ``config`` (warm-up, then cosine / linear / constant) over ``total_steps`` optimizer steps,
    stepped after each optimizer step; None for a constant lr without warm-up."""
    if config.schedule == "constant" and not config.warmup_steps:
        return None
    return warmup_schedule(optimizer, config.warmup_steps, total_steps, kind=config.schedule)


def as_config(config: Any) -> TrainConfig | None:
    """A TrainConfig from a path (TOML/YAML), a dict, or a TrainConfig; None stays None."""
    if isinstance(config, (str, os.PathLike)):
        return TrainConfig.from_dict(load_config(config))
    if isinstance(config, dict):
        return TrainConfig.from_dict(config)
    if config is not None and not isinstance(config, TrainConfig):
        raise UserError(f"config must be a TrainConfig, a dict or a path to a TOML/YAML file, got {type(config).__name__}")
    return config


# -- helpers ---------------------------------------------------------------------------------------

def _switch_to_fast_step(opt: torch.optim.Optimizer) -> str:
    """Switch the user's optimizer to its fused step in place; the kind switched to ("" if none).

    In place, not rebuilt: the user's scheduler (and anything else) holds this object.
    torch.optim reads ``group["fused"]`` at each step; the two private flags are the ones
    its own ``__init__`` sets for ``fused=True`` (the amp-scaling hand-off and the one-time
    device/dtype check), so the result is what ``cls(params, fused=True)`` builds.
    """
    kind = _fast_step_kind(opt)
    if kind is not None:
        return kind
    if not _can_fuse(opt):
        return ""
    for g in [opt.defaults, *opt.param_groups]:
        g["fused"], g["foreach"] = True, False
    opt._step_supports_amp_scaling = True
    opt._need_device_dtype_check_for_fused = True
    return "fused"


def _joins_process_group(cfg: TrainConfig) -> bool:
    """Whether to join torchrun's process group: launched with several processes, and distributed not off.
    A mode that needs several processes without them is an error."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if cfg.distributed in ("ddp", "zero1", "fsdp") and not launched:
        raise UserError(f"distributed = {cfg.distributed} needs several processes: launch with `torchrun "
                        f"--nproc_per_node N ...` (or set distributed = off)")
    return cfg.distributed != "off" and launched


def _with_checkpointing(model: nn.Module, how: str) -> nn.Module:
    """Activation checkpointing as ``config.checkpointing`` says: ``sqrt`` segments, ``blocks``, or a name pattern."""
    if how == "sqrt":
        if not isinstance(model, nn.Sequential):
            raise UserError("checkpointing='sqrt' needs an nn.Sequential model: use 'blocks' or a name pattern")
        return checkpoint_sequential_sqrt(model)
    if how == "blocks":
        return checkpoint_blocks(model)
    return checkpoint_blocks(model, names=[how])


def _fast_step_note(kind: str) -> str:
    """What ``applied`` says of the fused/foreach step: ``fused_optimizer``, ``foreach_optimizer``, or unavailable."""
    return f"{kind}_optimizer" if kind else "fused_optimizer=unavailable"


def _fast_step_kind(opt: torch.optim.Optimizer) -> str | None:
    """The multi-tensor form ``opt`` was built with, "fused" or "foreach"; None if neither."""
    if opt.defaults.get("fused"):
        return "fused"
    if opt.defaults.get("foreach"):
        return "foreach"
    return None


def _can_fuse(opt: torch.optim.Optimizer) -> bool:
    """Whether ``type(opt)(params, fused=True)`` would build: fresh (no state yet, not differentiable), a class
    with a fused form, and only dense floating-point parameters on a device fused steps run on."""
    if opt.state or opt.defaults.get("differentiable"):
        return False
    params = [p for g in opt.param_groups for p in g["params"]]
    return bool("fused" in inspect.signature(type(opt).__init__).parameters and params
                and all(_fusable_param(p) for p in params))


def _fusable_param(p: torch.Tensor) -> bool:
    return p.device.type in _fused_devices() and p.is_floating_point() and not p.is_sparse


def _same_side(what: str, saved: Any, here: Any, fix: str) -> None:
    """One line where the saved state and this Tricks disagree on having ``what``."""
    if (saved is None) != (here is None):
        has, lacks = ("the saved state", "this Tricks") if saved is not None else ("this Tricks", "the saved state")
        raise UserError(f"{has} has {what} and {lacks} has none: resume with {fix}")


def _pad_id(model: nn.Module) -> int:
    """The id a transformers model pads with (its pad token, else its end-of-text token), else 0: padding is
    masked out of attention and loss, so any id in the vocabulary serves."""
    cfg = getattr(model, "config", None)
    for key in ("pad_token_id", "eos_token_id"):
        v = getattr(cfg, key, None)
        v = v[0] if isinstance(v, list) and v else v
        vocab = getattr(cfg, "vocab_size", None)
        if isinstance(v, int) and v >= 0 and (not isinstance(vocab, int) or v < vocab):
            return v
    return 0


def _first_loader(objs: list[Any]) -> Any:
    """The first DataLoader (or Dataset) among prepare()'s extra arguments, which sizes a schedule; None if none."""
    return next((obj for obj in objs if isinstance(obj, (DataLoader, Dataset))), None)


def _check_loss(loss: Any) -> None:
    """What backward() takes: a floating-point tensor of one value (the batch's mean loss)."""
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise UserError(f"backward() needs the loss tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise UserError(f"the loss has shape {tuple(loss.shape)}, not a scalar: reduce it to the batch's mean")


def _is_scheduler(obj: Any) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "state_dict") and hasattr(obj, "optimizer") \
        and not isinstance(obj, torch.optim.Optimizer)


def _adjust_bn_momentum(model: nn.Module, k: int) -> None:
    """k updates at m' move the running stats as far as one update at m: m' = 1 - (1 - m)^(1/k)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is not None:
            m.momentum = 1 - (1 - m.momentum) ** (1 / k)


def run_length(cfg: TrainConfig, loader: Any) -> tuple[int, int]:
    """``(optimizer steps per epoch, steps of the run)`` of ``cfg`` over ``loader``; 0 where unknown (no len)."""
    per_epoch = math.ceil(_len(loader) / cfg.accumulate) if loader is not None and _len(loader) else 0
    by_epochs = per_epoch * cfg.epochs
    return per_epoch, (min(cfg.max_steps, by_epochs) if cfg.max_steps and by_epochs else cfg.max_steps or by_epochs)


def _len(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:
        return 0
