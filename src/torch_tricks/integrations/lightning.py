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
channels_last, compile of each child module) and the kept heap; activation offload from batch
start to ``on_before_backward``; the EMA after each optimizer step (kept in the checkpoint);
the NaN guard on each batch's loss. It also checks, at the start of fitting, that what lives in
your own code is in effect (the optimizer from :func:`optimizers_from`, the seed), and says in
one line what to change where it is not: a key is never dropped in silence.

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
    Make,
    build,
    changed_keys,
    check_keywords,
    config_of,
    keywords,
    routes,
)
from torch_tricks.train.ema import EMA
from torch_tricks.train.lm_loss import chunk_lm_loss, why_not_chunkable
from torch_tricks.train.offload import check_device as check_offload_device
from torch_tricks.train.offload import offload_activations
from torch_tricks.train.speed import keep_heap
from torch_tricks.train.tricks import (
    TrainingDiverged,
    apply_model_switches,
    config_optimizer,
    config_scheduler,
)

_lightning = require("lightning", "lightning", "the Lightning integration")
from lightning.pytorch import Callback  # noqa: E402

__all__ = ["trainer_kwargs_from", "optimizers_from", "trainer_lines", "TricksCallback"]


def trainer_kwargs_from(cfg: Any) -> dict[str, Any]:
    """``lightning.Trainer``'s keywords for ``cfg`` (a path to ``tricks.toml``, a ``TrainConfig`` or a dict), with
    :class:`TricksCallback` in ``callbacks``. A value with no place in Lightning, or a keyword the installed
    Lightning lacks, is one line saying which and what to do (``UserError``)."""
    config = config_of(cfg)
    kwargs = keywords(config, "lightning")
    check_keywords(kwargs, set(inspect.signature(_lightning.Trainer.__init__).parameters), "lightning", _lightning,
                   "Trainer keyword")
    built = {k: build(v) for k, v in kwargs.items()}
    built["callbacks"] = [TricksCallback(config), *built.get("callbacks", [])]
    return built


def optimizers_from(cfg: Any, module: Any) -> dict[str, Any]:
    """What ``configure_optimizers`` returns for ``cfg``: the optimizer ``Tricks`` builds (no-decay groups, fused
    step, low-precision state, scaled lr) over ``module``, and its lr schedule stepped every optimizer step
    (its length: the Trainer's ``estimated_stepping_batches``)."""
    config = config_of(cfg)
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


def trainer_lines(cfg: Any) -> list[str]:
    """The lines of a Lightning script that carry ``cfg``."""
    config = config_of(cfg)
    kwargs = keywords(config, "lightning")
    kwargs["callbacks"] = [Make("torch_tricks.integrations.lightning.TricksCallback", {"cfg": changed_keys(config)}),
                           *kwargs.get("callbacks", [])]
    code = [r.line for r in routes(config, "lightning").values() if r.how == "code"]
    kw = ",\n    ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return ["import lightning",
            "from torch_tricks.integrations.lightning import TricksCallback, optimizers_from",
            f"cfg = {changed_keys(config)!r}",
            *[line for line in code if "fit(" not in line],
            f"trainer = lightning.Trainer(\n    {kw},\n)",
            *[line for line in code if "fit(" in line]]


class TricksCallback(Callback):
    """The switches of a configuration that ``lightning.Trainer`` has no keyword for, applied from its hooks.

    After fitting, :attr:`ema` holds the EMA (``ema.module`` the averaged LightningModule) when ``ema`` is on.
    """

    def __init__(self, cfg: Any) -> None:
        self.config = config_of(cfg)
        routes(self.config, "lightning")  # a value Lightning cannot serve is refused here, before any training
        self.applied: list[str] = []
        self.ema: Any = None
        self._offload: contextlib.AbstractContextManager[Any] | None = None
        self._steps_seen = 0

    # -- before configure_optimizers ---------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.applied:
            return
        cfg = self.config
        self._seed()
        switches = cfg.replace(chunked_lm_loss=False)
        changed, self.applied = apply_model_switches(pl_module, switches, distributed=trainer.world_size > 1,
                                                     channels_last_weights=True)
        if changed is not pl_module:
            raise UserError(f"checkpointing = {cfg.checkpointing!r} wraps the model in a new module, which Lightning "
                            "would not train: use 'blocks' or a name pattern")
        if cfg.chunked_lm_loss:
            _chunk_the_lm(pl_module)
            self.applied.append("chunked_lm_loss")
        if cfg.compile:
            for child in pl_module.children():
                child.compile()
            self.applied.append("compile")
        # setup runs before the strategy moves the module: the device it will train on is the strategy's
        if cfg.keep_heap and trainer.strategy.root_device.type == "cpu":
            if keep_heap():
                self.applied.append("keep_heap")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        mine = [o for o in trainer.optimizers if not getattr(o, "_torch_tricks_config", False)]
        if mine:
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
