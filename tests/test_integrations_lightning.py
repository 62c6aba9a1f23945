"""The tune's configuration in Lightning (issue 22): trainer_kwargs_from + optimizers_from + TricksCallback put each
switch in effect in a real lightning.Trainer, and what Lightning cannot serve, or what your own code leaves out,
is one line."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
lightning = pytest.importorskip("lightning")

from _trainer_data import assert_resumed_like, ema_of, gpt2, lm_data  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.integrations.lightning import (  # noqa: E402
    TricksCallback,
    optimizers_from,
    trainer_kwargs_from,
    trainer_lines,
)


class LM(lightning.LightningModule):
    """A LightningModule as users write one: the model inside, its own loss, the configuration's optimizer."""

    def __init__(self, cfg: dict, own_optimizer: bool = False) -> None:
        super().__init__()
        self.model = gpt2()
        self.cfg, self.own_optimizer = cfg, own_optimizer
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        if self.own_optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)
        # the optimizer and lr are the user's where the configuration gives none
        return optimizers_from(self.cfg, self, optimizer="adamw", **({} if "lr" in self.cfg else {"lr": 1e-3}))


class Seen(lightning.Callback):
    """The autocast state inside the forward, and the raw weights after each optimizer step."""

    def __init__(self, module: LM) -> None:
        self.autocast: list[tuple[bool, torch.dtype]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        self._step, self._training = 0, False
        module.model.transformer.register_forward_pre_hook(lambda m, a: self.autocast.append(
            (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))) if self._training else None)

    def on_train_start(self, trainer, pl_module):
        self._training = True  # not the chunked loss's agreement check at setup (two forwards, fp32)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self._step:
            self.weights.append({k: v.detach().float().clone() for k, v in pl_module.state_dict().items()})
        self._step = trainer.global_step


def _fit(cfg: dict, tmp_path, module: LM, seen: Seen | None = None) -> lightning.Trainer:
    kw = trainer_kwargs_from({"device": "cpu", "progress": False, **cfg})
    kw["callbacks"] += [seen] if seen else []
    trainer = lightning.Trainer(**kw, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                                enable_model_summary=False)
    trainer.fit(module, DataLoader(lm_data(), batch_size=cfg.get("batch_size", 4), shuffle=False))
    return trainer


def test_each_switch_is_in_effect_in_a_real_trainer_and_the_loss_goes_down(tmp_path):
    cfg = {"precision": "bf16", "checkpointing": "blocks", "accumulate": 2, "batch_size": 4, "lr": 1e-2,
           "epochs": 3, "ema": True, "ema_decay": 0.9, "weight_decay": 0.01, "chunked_lm_loss": True}
    lightning.seed_everything(0, workers=True, verbose=False)
    module = LM(cfg)
    seen = Seen(module)
    trainer = _fit(cfg, tmp_path, module, seen)
    assert seen.autocast and all(on and dtype == torch.bfloat16 for on, dtype in seen.autocast)
    assert all(type(block.forward).__name__ == "_CheckpointedForward" for block in module.model.transformer.h)
    (opt,) = trainer.optimizers
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert trainer.accumulate_grad_batches == 2 and trainer.global_step == 3 * 24 // (4 * 2)
    cb = next(c for c in trainer.callbacks if isinstance(c, TricksCallback))
    assert {"chunked_lm_loss", "ema", "checkpointing=blocks"} <= set(cb.applied), cb.applied
    assert cb.ema.num_updates == trainer.global_step == len(seen.weights)
    ours = ema_of(seen.weights, 0.9)
    for k, v in cb.ema.module.state_dict().items():
        torch.testing.assert_close(v.float(), ours[k], rtol=1e-5, atol=1e-6)
    assert sum(module.losses[-4:]) < 0.9 * sum(module.losses[:4]), module.losses


def test_the_configurations_schedule_steps_with_the_optimizer(tmp_path):
    cfg = {"schedule": "cosine", "warmup_steps": 2, "max_steps": 6, "lr": 1e-2, "batch_size": 4}
    lightning.seed_everything(0, workers=True, verbose=False)
    module = LM(cfg)
    trainer = _fit(cfg, tmp_path, module)
    (sched,) = [c.scheduler for c in trainer.lr_scheduler_configs]
    assert sched.last_epoch == 6 and trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


class Threads(lightning.Callback):
    """The process's intra-op thread count at each training batch."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(torch.get_num_threads())


def test_the_callback_sets_the_threads_the_batches_run_on(tmp_path):
    """``threads`` has no Trainer keyword: the callback sets it in setup and lists it; the batches run on it."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not 1 already (one thread per xdist worker): the callback must change it
        cfg = {"threads": 1, "max_steps": 2, "batch_size": 4}
        kw = trainer_kwargs_from({"device": "cpu", "progress": False, **cfg})
        seen = Threads()
        trainer = lightning.Trainer(**kw, default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                                    enable_model_summary=False)
        trainer.callbacks.append(seen)
        trainer.fit(LM(cfg), DataLoader(lm_data(), batch_size=4, shuffle=False))
        cb = next(c for c in trainer.callbacks if isinstance(c, TricksCallback))
        assert "threads=1" in cb.applied and seen.seen == [1, 1]
    finally:
        torch.set_num_threads(before)


def test_your_own_optimizer_or_seed_is_caught_in_one_line(tmp_path):
    lightning.seed_everything(0, workers=True, verbose=False)
    with pytest.raises(UserError, match=r"configuration's optimizer is not in effect \(SGD.*optimizers_from"):
        _fit({"max_steps": 1, "fused_optimizer": True}, tmp_path, LM({}, own_optimizer=True))
    _fit({"max_steps": 1}, tmp_path, LM({}, own_optimizer=True))  # a configuration without optimizer keys: yours
    lightning.seed_everything(5, workers=True, verbose=False)
    with pytest.raises(UserError, match=r"seed = 0 in the configuration, but lightning.seed_everything\(5\) ran"):
        _fit({"max_steps": 1, "seed": 0}, tmp_path, LM({}))


def test_a_non_finite_loss_stops_the_trainer_naming_the_step(tmp_path):
    lightning.seed_everything(0, workers=True, verbose=False)
    module = LM({})
    with torch.no_grad():
        module.model.transformer.wte.weight.fill_(float("nan"))
    with pytest.raises(UserError, match=r"loss is nan at step 1"):
        _fit({"max_steps": 2}, tmp_path, module)


def test_the_mapped_keywords():
    kw = trainer_kwargs_from({"precision": "fp16", "grad_clip": 1.0, "deterministic": True, "cudnn_benchmark": True,
                              "max_steps": 0, "swa": True, "swa_lr": 0.05, "swa_start": 0.5, "log_dir": "logs",
                              "checkpoint_dir": "ck", "checkpoint_every": 10, "keep_checkpoints": 3})
    assert kw["precision"] == "16-mixed" and kw["gradient_clip_val"] == 1.0 and kw["deterministic"] is True
    assert kw["benchmark"] is True and kw.get("max_steps", -1) == -1 and kw["default_root_dir"] == "ck"  # -1: the default, left out
    names = [type(c).__name__ for c in kw["callbacks"]]
    assert names == ["TricksCallback", "StochasticWeightAveraging", "ModelCheckpoint"], names
    swa, ck = kw["callbacks"][1], kw["callbacks"][2]
    assert swa._swa_lrs == 0.05 and swa._swa_epoch_start == 0.5
    assert ck.dirpath.endswith("ck") and ck._every_n_train_steps == 10 and ck.save_top_k == 3
    assert type(kw["logger"]).__name__ == "CSVLogger"
    fsdp = trainer_kwargs_from({"distributed": "fsdp", "fsdp_reshard": False})["strategy"]
    assert type(fsdp).__name__ == "FSDPStrategy"


def test_the_emitted_lines_carry_what_needs_your_own_code():
    text = "\n".join(trainer_lines({"precision": "bf16", "resume": True, "checkpoint_dir": "ck", "seed": 3,
                                    "fused_optimizer": True}))
    assert "lightning.seed_everything(3, workers=True)" in text and "precision='bf16-mixed'" in text
    assert 'trainer.fit(module, ckpt_path="last")' in text and "optimizers_from(cfg, self, optimizer=" in text
    assert text.index("seed_everything") < text.index("lightning.Trainer(") < text.index("ckpt_path")


@pytest.mark.parametrize("cfg, match", [
    ({"optimizer_in_backward": True}, "optimizer_in_backward = True has no place in lightning.Trainer"),
    ({"distributed": "zero1"}, "distributed = 'zero1' has no place in lightning.Trainer.*deepspeed_stage_1"),
    ({"auto_micro_batch": True}, "auto_micro_batch = True has no place"),
])
def test_what_lightning_cannot_serve_is_one_line(cfg, match):
    with pytest.raises(UserError, match=match) as err:
        trainer_kwargs_from(cfg)
    assert "\n" not in str(err.value)


def test_without_lightning_it_is_one_line_naming_the_extra(monkeypatch, capsys):
    import sys

    from torch_tricks.cli import main

    monkeypatch.setitem(sys.modules, "lightning", None)  # an import of it now fails
    monkeypatch.delitem(sys.modules, "torch_tricks.integrations.lightning", raising=False)
    code = main(["tune", "--model", "mlp", "--emit", "lightning", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert 'the Lightning integration needs lightning: pip install "torch-tricks[lightning]"' in err, err


# -- issue 34: the Trainer gets exactly what the configuration gives, and keeps its state on resume --------------

def test_a_toml_with_only_precision_changes_no_other_keyword_of_yours(tmp_path):
    toml = tmp_path / "tricks.toml"
    toml.write_text('[train]\nprecision = "bf16"\n')
    yours = {"max_epochs": 1, "accumulate_grad_batches": 2, "log_every_n_steps": 5, "gradient_clip_val": 0.5}
    kw = trainer_kwargs_from(str(toml), **yours)
    assert {k: v for k, v in kw.items() if k != "callbacks"} == {**yours, "precision": "bf16-mixed"}
    assert kw.tricks_changes == {"precision": (None, "bf16-mixed")}  # None: Lightning's own default
    assert [type(c).__name__ for c in kw["callbacks"]] == ["TricksCallback"]
    trainer = lightning.Trainer(**kw, logger=False, enable_checkpointing=False, enable_model_summary=False,
                                default_root_dir=str(tmp_path))
    assert (trainer.max_epochs, trainer.accumulate_grad_batches, trainer.log_every_n_steps) == (1, 2, 5)


def test_a_conflict_with_your_keyword_is_one_line_unless_you_say_which_wins():
    with pytest.raises(UserError, match=r"conflict: accumulate_grad_batches=2 in your Trainer keywords, "
                                        r"accumulate_grad_batches=4 from the configuration's accumulate") as err:
        trainer_kwargs_from({"accumulate": 4}, accumulate_grad_batches=2)
    assert "\n" not in str(err.value)
    assert trainer_kwargs_from({"accumulate": 4}, prefer="tuned", accumulate_grad_batches=2)[
        "accumulate_grad_batches"] == 4
    assert trainer_kwargs_from({"accumulate": 4}, prefer="yours", accumulate_grad_batches=2)[
        "accumulate_grad_batches"] == 2
    callbacks = trainer_kwargs_from({"precision": "bf16"}, callbacks=[Stop(0)])["callbacks"]
    assert [type(c).__name__ for c in callbacks] == ["TricksCallback", "Stop"]  # lists are joined


@pytest.mark.parametrize("cfg, match", [
    ({"precision": "bf16"}, r"precision = 'bf16' in the configuration needs precision='bf16-mixed', but the Trainer "
                            r"has precision='32-true'"),
    ({"accumulate": 2}, r"accumulate = 2 .* needs accumulate_grad_batches=2, but the Trainer has "
                        r"accumulate_grad_batches=1"),
    ({"grad_clip": 1.0}, r"grad_clip = 1.0 .* needs gradient_clip_val=1.0, but the Trainer has gradient_clip_val=None"),
])
def test_the_callback_refuses_a_configuration_the_trainer_does_not_carry(tmp_path, cfg, match):
    lightning.seed_everything(0, workers=True, verbose=False)
    trainer = lightning.Trainer(callbacks=[TricksCallback(cfg)], max_steps=1, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=str(tmp_path))
    with pytest.raises(UserError, match=match) as err:
        trainer.fit(LM({}), DataLoader(lm_data(), batch_size=4))
    assert "\n" not in str(err.value)


class Stop(lightning.Callback):
    """The lr after each optimizer step; stops the run at the end of epoch ``stop_after`` (a killed job, after its
    checkpoint)."""

    def __init__(self, stop_after: int) -> None:
        self.lrs: list[float] = []
        self.stop_after, self._step = stop_after, 0

    def on_train_start(self, trainer, pl_module):
        self._step = trainer.global_step  # a resumed run starts at the checkpoint's step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self._step:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self._step = trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module):
        if self.stop_after and trainer.current_epoch + 1 == self.stop_after:
            trainer.should_stop = True


def test_stopped_and_resumed_the_ema_and_the_lr_equal_an_uninterrupted_run(tmp_path):
    def run(folder, stop_after=0, resume=False):
        cfg = {"ema": True, "ema_decay": 0.9, "accumulate": 2, "schedule": "cosine", "lr": 1e-2, "epochs": 2,
               "checkpoint_dir": str(folder), "device": "cpu", "progress": False, "seed": 0}
        lightning.seed_everything(0, workers=True, verbose=False)
        module, stop = LM(cfg), Stop(stop_after)
        kw = trainer_kwargs_from(cfg, logger=False, enable_model_summary=False)
        kw["callbacks"].append(stop)
        trainer = lightning.Trainer(**kw)
        # 16 samples, 2 a micro-batch, 2 micro-batches a step: 4 optimizer steps an epoch, 8 in all
        trainer.fit(module, DataLoader(lm_data(16), batch_size=2, shuffle=False),
                    ckpt_path=str(folder / "last.ckpt") if resume else None)
        cb = next(c for c in trainer.callbacks if isinstance(c, TricksCallback))
        return cb, stop, trainer

    whole, whole_stop, _ = run(tmp_path / "whole")
    _, first, _ = run(tmp_path / "cut", stop_after=1)
    resumed, second, trainer = run(tmp_path / "cut", resume=True)
    assert trainer.global_step == 8
    assert_resumed_like(whole.ema, resumed.ema, whole_stop.lrs, first.lrs, second.lrs)
