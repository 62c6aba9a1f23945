"""The tune's configuration in Lightning (issue 22)::

    import lightning
    from torch_tricks.integrations.lightning import optimizers_from, trainer_kwargs_from

    class Module(lightning.LightningModule):
        ...
        def configure_optimizers(self):
            return optimizers_from(cfg, self)           # the optimizer and lr schedule of the configuration

    trainer = lightning.Trainer(**trainer_kwargs_from(cfg))  # cfg: tricks.toml, a TrainConfig or a dict
    trainer.fit(Module(), train_loader)

:func:`trainer_kwargs_from` gives ``lightning.Trainer``'s keywords (precision, accumulation,
clipping, determinism, anomaly detection, cudnn benchmark, strategy and device, SyncBN, logging,
``ModelCheckpoint`` and ``StochasticWeightAveraging`` when asked) with :class:`TricksCallback`
among its ``callbacks`` (add yours to that list). The callback applies, from Lightning's own
hooks, what the Trainer has no keyword for: in ``setup`` (before ``configure_optimizers``) the
model changes of ``Tricks.prepare`` (activation checkpointing, in-place activations,
memory-efficient BN, the chunked loss of the causal LM inside the module, BN momentum,
channels_last, compile of each child module), the kept heap and the intra-op threads;
activation offload from batch start to ``on_before_backward``; the EMA after each optimizer
step (kept in the checkpoint); the NaN guard on each batch's loss. It also checks, at the start
of fitting, that what lives in your own code is in effect (the optimizer from
:func:`optimizers_from`, the seed), and says in one line what to change where it is not: a key
is never dropped in silence.

Written here rather than taken from Lightning: its Trainer has keywords for the first group and
nothing for the second; a callback is its own way of adding behaviour.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from typing import Any

import torch
import torch.nn as nn

from torch_tricks._optional import require
from torch_tricks.errors import UserError
from torch_tricks.integrations.mapping import (
    OPTIMIZER_KEYS,
    build,
    changed_keys,
    check_keywords,
    code_lines,
    config_of,
    keywords,
    routes,
    sourced_keywords,
)
from torch_tricks.integrations.merge import Tuned, check_prefer, merge, same
from torch_tricks.machine import set_threads
from torch_tricks.train.compile_modes import check_compile_mode, compile_kwargs
from torch_tricks.train.matmul_mode import set_fp32_matmul
from torch_tricks.train.config import TrainConfig
from torch_tricks.train.ema import EMA
from torch_tricks.train.lm_loss import chunk_lm_loss, why_not_chunkable
from torch_tricks.train.offload import check_device as check_offload_device
from torch_tricks.train.offload import offload_activations
from torch_tricks.train.speed import compile_model, keep_heap
from torch_tricks.train.tricks import (
    TrainingDiverged,
    apply_model_switches,
    config_optimizer,
    config_scheduler,
)

_lightning = require("lightning", "lightning", "the Lightning integration")
from lightning.pytorch import Callback  # noqa: E402

__all__ = ["trainer_kwargs_from", "optimizers_from", "trainer_lines", "TricksCallback"]


def trainer_kwargs_from(cfg: Any, *, prefer: str | None = None, **yours: Any) -> dict[str, Any]:
    """``lightning.Trainer``'s keywords for the keys ``cfg`` was given (a path to ``tricks.toml``, a ``TrainConfig``
    or a dict), merged into ``yours`` (your own keywords: ``trainer_kwargs_from(cfg, max_epochs=3)``), with
    :class:`TricksCallback` in ``callbacks``. The result's ``tricks_changes`` maps each keyword the configuration
    set to ``(Lightning's default, new)``; a keyword of yours with another value is one line naming both, unless
    ``prefer`` is ``"tuned"`` or ``"yours"``. A value with no place in Lightning, or a keyword the installed
    Lightning lacks, is one line saying which and what to do (``UserError``)."""
    config = config_of(cfg)
    tuned = sourced_keywords(config, "lightning")
    params = inspect.signature(_lightning.Trainer.__init__).parameters
    check_keywords(tuned, set(params), "lightning", _lightning, "Trainer keyword")
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    merged = merge(tuned, yours, explicit=set(yours), defaults=defaults, prefer=prefer,
                   where="your Trainer keywords")
    built = Tuned({k: build(v) for k, v in merged.items()})
    built.tricks_changes = merged.tricks_changes
    built["callbacks"] = [TricksCallback(config), *built.get("callbacks", [])]
    return built


def optimizers_from(cfg: Any, module: Any, *, prefer: str | None = None, **yours: Any) -> dict[str, Any]:
    """What ``configure_optimizers`` returns for ``cfg``: the optimizer ``Tricks`` builds (no-decay groups, fused
    step, low-precision state, scaled lr) over ``module``, and its lr schedule stepped every optimizer step
    (its length: the Trainer's ``estimated_stepping_batches``).

    ``yours``: your own optimizer settings as configuration keys (``lr=3e-4, weight_decay=0.1,
    schedule="cosine"``), merged with the configuration's (a different value is one line unless ``prefer``). The
    optimizer's kind and lr must be stated by one of the two: torch-tricks' own defaults are not your optimizer.
    """
    config = _optimizer_config(config_of(cfg), yours, prefer)
    trainer = getattr(module, "_trainer", None)
    world = trainer.world_size if trainer is not None else 1
    optimizer, _ = config_optimizer(module, config, world_size=world)
    optimizer._torch_tricks_config = True  # what TricksCallback checks: the configuration's optimizer is in effect
    out: dict[str, Any] = {"optimizer": optimizer}
    if config.schedule != "constant" or config.warmup_steps:
        if trainer is None:
            raise UserError("optimizers_from(cfg, self) builds the lr schedule from the Trainer's length: call it "
                            "from configure_optimizers")
        total = trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise UserError("the lr schedule needs a known length: give the Trainer max_steps or max_epochs with a "
                            "sized DataLoader")
        out["lr_scheduler"] = {"scheduler": config_scheduler(optimizer, config, int(total)), "interval": "step"}
    return out


def _optimizer_config(config: TrainConfig, yours: dict[str, Any], prefer: str | None) -> TrainConfig:
    """``config`` with your optimizer settings; a conflict is one line; the kind and lr must be given by one."""
    check_prefer(prefer)
    mine = TrainConfig.from_dict(yours)
    unknown = set(mine.given) - OPTIMIZER_KEYS
    if unknown:
        raise UserError(f"optimizers_from takes optimizer settings ({', '.join(sorted(OPTIMIZER_KEYS))}), not "
                        f"{', '.join(sorted(unknown))}")
    clash = [k for k in sorted(mine.given & config.given) if not same(getattr(mine, k), getattr(config, k))]
    if clash and prefer is None:
        raise UserError("conflict: " + "; ".join(f"{k}={getattr(mine, k)!r} of yours, {k}={getattr(config, k)!r} "
                                                 "in the configuration" for k in clash)
                        + ": remove one, or pass prefer='tuned' or prefer='yours'")
    keep = mine.given if prefer == "yours" else mine.given - config.given
    out = config.replace(**{k: getattr(mine, k) for k in keep})
    missing = [k for k in ("optimizer", "lr") if k not in out.given]
    if missing:
        raise UserError(f"optimizers_from: the configuration does not give {' or '.join(missing)}: pass yours, e.g. "
                        "optimizers_from(cfg, self, optimizer='adamw', lr=3e-4)")
    return out


def trainer_lines(cfg: Any, source: str | None = None) -> list[str]:
    """The lines of a Lightning script that carry ``cfg``. ``source``: how the script names the configuration
    (a path to tricks.toml); default: its given keys."""
    config = config_of(cfg)
    kwargs = keywords(config, "lightning")
    code = code_lines(config, "lightning")
    fit = code.pop("resume", "trainer.fit(module, train_loader)")
    code.pop("lr", None)
    tuned = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "nothing"
    optimizer_line = ["# in your LightningModule:",
                      "#     def configure_optimizers(self):",
                      "#         return optimizers_from(cfg, self, optimizer='adamw', lr=3e-4)  # your optimizer and lr "
                      "where the configuration has none"] if config.given & OPTIMIZER_KEYS else []
    return ["import lightning",
            "from torch_tricks.integrations.lightning import optimizers_from, trainer_kwargs_from",
            "",
            f"cfg = {source!r}" if source else f"cfg = {changed_keys(config)!r}",
            *code.values(),
            *optimizer_line,
            f"trainer = lightning.Trainer(**trainer_kwargs_from(cfg))  # with your own keywords too; sets {tuned}, "
            "and TricksCallback",
            fit]


class TricksCallback(Callback):
    """The switches of a configuration that ``lightning.Trainer`` has no keyword for, applied from its hooks.

    After fitting, :attr:`ema` holds the EMA (``ema.module`` the averaged LightningModule) when ``ema`` is on.
    """

    def __init__(self, cfg: Any) -> None:
        self.config = config_of(cfg)
        routes(self.config, "lightning", given=True)  # a value Lightning cannot serve is refused here, before any training
        self.applied: list[str] = []
        self.ema: Any = None
        self._offload: contextlib.AbstractContextManager[Any] | None = None
        self._steps_seen = 0

    # -- before configure_optimizers ---------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.applied:
            return
        cfg = self.config
        self.applied = _check_trainer(cfg, trainer)
        if cfg.compile:  # before the model changes: reduce-overhead on a CPU is one line
            check_compile_mode(cfg.compile, trainer.strategy.root_device)
        if "seed" in cfg.given:
            self._seed()
        switches = cfg.replace(chunked_lm_loss=False)
        changed, applied = apply_model_switches(pl_module, switches, distributed=trainer.world_size > 1,
                                                     channels_last_weights=True, device=trainer.strategy.root_device)
        if changed is not pl_module:
            raise UserError(f"checkpointing = {cfg.checkpointing!r} wraps the model in a new module, which Lightning "
                            "would not train: use 'blocks' or a name pattern")
        self.applied += applied
        if cfg.chunked_lm_loss:
            _chunk_the_lm(pl_module)
            self.applied.append("chunked_lm_loss")
        if cfg.compile:  # compile_model: a bare nn.Sequential child would stay eager under child.compile()
            for child in pl_module.children():
                compile_model(child, check=False, **compile_kwargs(cfg.compile))
            self.applied.append("compile" if cfg.compile is True else f"compile={cfg.compile}")
        # setup runs before the strategy moves the module: the device it will train on is the strategy's
        if cfg.keep_heap and trainer.strategy.root_device.type == "cpu":
            if keep_heap():
                self.applied.append("keep_heap")
        if cfg.threads:  # after the strategy's own thread setting (setup_environment), checked against the cores
            set_threads(cfg.threads)
            self.applied.append(f"threads={cfg.threads}")
        if cfg.fp32_matmul:  # for the strategy's device, checked there (tf32 on a CPU: one line)
            set_fp32_matmul(cfg.fp32_matmul, trainer.strategy.root_device)
            self.applied.append(f"fp32_matmul={cfg.fp32_matmul}")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        mine = [o for o in trainer.optimizers if not getattr(o, "_torch_tricks_config", False)]
        if mine and self.config.given & OPTIMIZER_KEYS:
            raise UserError(f"the configuration's optimizer is not in effect ({type(mine[0]).__name__} from your "
                            "configure_optimizers): return torch_tricks.integrations.lightning.optimizers_from(cfg, "
                            "self) there")
        if self.config.offload_activations:
            check_offload_device(pl_module.device)
            self.applied.append("offload_activations")
        if self.config.ema and self.ema is None:
            self.ema = EMA(pl_module, decay=self.config.ema_decay)
            self.applied.append("ema")
        self._steps_seen = trainer.global_step

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._steps_seen = trainer.global_step  # a resumed run's step is restored after on_fit_start

    # -- each batch ------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.config.offload_activations:
            self._offload = offload_activations()
            self._offload.__enter__()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._offload is not None:
            self._offload.__exit__(None, None, None)
            self._offload = None
        if self.config.nan_guard and not math.isfinite(float(loss.detach())):
            raise TrainingDiverged(f"loss is {float(loss.detach())} at step {trainer.global_step + 1} (batch "
                                   f"{trainer.fit_loop.epoch_loop.batch_progress.current.completed}); lower the "
                                   "learning rate or check the data")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is not None and trainer.global_step > self._steps_seen:  # an optimizer step was taken
            self.ema.update(pl_module)
        self._steps_seen = trainer.global_step

    # -- checkpoints -------------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.ema is not None:
            checkpoint["torch_tricks_ema"] = self.ema.state_dict()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("torch_tricks_ema")
        if state is not None and self.config.ema:
            self.ema = self.ema or EMA(pl_module, decay=self.config.ema_decay)
            self.ema.load_state_dict(state)

    def _seed(self) -> None:
        """The configuration's seed: Lightning's, set before the model was built (checked), or set here."""
        seed = os.environ.get("PL_GLOBAL_SEED")
        if seed is None:
            _lightning.seed_everything(self.config.seed, workers=True, verbose=False)
            self.applied.append("seed (at setup; seed before building the model for the same initial weights)")
        elif int(seed) != self.config.seed:
            raise UserError(f"seed = {self.config.seed} in the configuration, but lightning.seed_everything({seed}) "
                            f"ran: seed with {self.config.seed}, or set seed = {seed}")


# -- helpers ----------------------------------------------------------------------------------------------

# Where a running lightning.Trainer holds the value of each keyword the callback checks.
_TRAINER_HOLDS = {"precision": lambda t: t.precision, "accumulate_grad_batches": lambda t: t.accumulate_grad_batches,
                  "gradient_clip_val": lambda t: t.gradient_clip_val, "max_epochs": lambda t: t.max_epochs,
                  "max_steps": lambda t: t.max_steps, "log_every_n_steps": lambda t: t.log_every_n_steps}


def _check_trainer(config: TrainConfig, trainer: Any) -> list[str]:
    """The configuration's keys that belong to the Trainer's own keywords, checked against the running Trainer:
    the switches in effect (``key=value (keyword=...)``), or one line naming a keyword that does not carry its key."""
    applied = []
    for name, (value, key) in sourced_keywords(config, "lightning").items():
        if name not in _TRAINER_HOLDS:
            continue
        have = _TRAINER_HOLDS[name](trainer)
        if not same(have, value):
            raise UserError(f"{key} = {getattr(config, key)!r} in the configuration needs {name}={value!r}, but the "
                            f"Trainer has {name}={have!r}: build it with lightning.Trainer(**trainer_kwargs_from(cfg, "
                            "...your keywords))")
        applied.append(f"{key}={getattr(config, key)} ({name}={value!r})")
    return applied


def _chunk_the_lm(pl_module: nn.Module) -> None:
    """The chunked loss on the causal LM inside the LightningModule (the first submodule it can serve)."""
    why = ""
    for m in pl_module.modules():
        if m is pl_module:
            continue
        why = why_not_chunkable(m)
        if not why:
            chunk_lm_loss(m)
            return
    raise UserError("chunked_lm_loss: no causal LM with a vocabulary head inside the LightningModule (a transformers "
                    "model computing its own loss from labels): switch chunked_lm_loss off")
