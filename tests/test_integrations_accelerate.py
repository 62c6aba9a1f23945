"""The tune's configuration in an Accelerate loop (issue 22): accelerator_kwargs_from + tricks_for put each switch in
effect, the EMA equals one the test computes from the raw weights, the loss goes down, the printed loop runs, and
what Accelerate cannot serve is one line."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from _trainer_data import assert_resumed_like, ema_of, gpt2, lm_data  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.integrations.accelerate import (  # noqa: E402
    ACCELERATOR_OWNS,
    accelerator_kwargs_from,
    trainer_lines,
    tricks_for,
)


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps one state per process; each test gets its own (the Trainer's tests make theirs too)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_each_switch_is_in_effect_in_an_accelerate_loop_and_the_loss_goes_down():
    cfg = {"precision": "bf16", "checkpointing": "blocks", "accumulate": 2, "lr": 1e-2, "weight_decay": 0.01,
           "ema": True, "ema_decay": 0.9, "device": "cpu", "progress": False, "chunked_lm_loss": True}
    accelerator = accelerate.Accelerator(**accelerator_kwargs_from(cfg))
    assert accelerator.mixed_precision == "bf16" and accelerator.gradient_accumulation_steps == 2
    tricks = tricks_for(cfg, accelerator)
    assert all(getattr(tricks.config, k) == v for k, v in ACCELERATOR_OWNS.items())  # nothing applied twice
    model = gpt2()
    autocast = []
    model.transformer.register_forward_pre_hook(
        lambda m, a: autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    model, optimizer = tricks.prepare(model)
    loader = DataLoader(lm_data(), batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    autocast.clear()  # not the chunked loss's agreement check at prepare (fp32, by design)
    losses, weights = [], []
    for _ in range(3):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                tricks.guard(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(loss))
            if accelerator.sync_gradients:
                tricks.after_step()
                weights.append({k: v.detach().float().clone()
                                for k, v in accelerator.unwrap_model(model).state_dict().items()})
    assert autocast and all(on and dtype == torch.bfloat16 for on, dtype in autocast)
    inner = accelerator.unwrap_model(model)
    assert all(type(block.forward).__name__ == "_CheckpointedForward" for block in inner.transformer.h)
    assert type(optimizer.optimizer) is torch.optim.AdamW and optimizer.optimizer.defaults["fused"] is True
    assert tricks.step_count == len(weights) == 3 * 6 // 2  # 6 micro-batches an epoch, 2 a step
    ours = ema_of(weights, 0.9)
    for k, v in tricks.ema.module.state_dict().items():
        torch.testing.assert_close(v.float(), ours[k], rtol=1e-5, atol=1e-6)
    assert sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses


def test_the_guard_stops_a_non_finite_loss_before_the_step():
    accelerator = accelerate.Accelerator(**accelerator_kwargs_from({"device": "cpu"}))
    tricks = tricks_for({"device": "cpu", "progress": False}, accelerator)
    model, optimizer = tricks.prepare(gpt2())
    with pytest.raises(UserError, match=r"loss is nan at step 1"):
        tricks.guard(torch.tensor(float("nan")))


def test_the_printed_loop_runs(tmp_path, run_script):
    from pathlib import Path

    lines = trainer_lines({"precision": "bf16", "accumulate": 2, "grad_clip": 1.0, "device": "cpu", "max_steps": 2,
                           "ema": True, "epochs": 1})
    script = tmp_path / "loop.py"
    script.write_text("\n".join([
        "import sys", f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
        "from torch.utils.data import DataLoader",
        "from _trainer_data import gpt2, lm_data",
        "import torch",
        "model, loader = gpt2(), DataLoader(lm_data(), batch_size=4)",
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)",
        *lines,
        "print('steps', tricks.step_count)"]))
    run = run_script(script, cwd=tmp_path)  # as `python loop.py` in tmp_path (conftest.py)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "steps 2", run.stdout[-2000:]


def test_the_mapped_keywords():
    kw = accelerator_kwargs_from({"precision": "fp16", "accumulate": 4, "device": "cpu", "compile": True,
                                  "checkpoint_dir": "ck", "keep_checkpoints": 3})
    assert kw["mixed_precision"] == "fp16" and kw["gradient_accumulation_steps"] == 4 and kw["cpu"] is True
    assert type(kw["dynamo_plugin"]).__name__ == "TorchDynamoPlugin"
    assert kw["project_config"].project_dir == "ck" and kw["project_config"].total_limit == 3
    fsdp = accelerator_kwargs_from({"distributed": "fsdp", "fsdp_reshard": False})["fsdp_plugin"]
    assert fsdp.fsdp_version == 2 and fsdp.reshard_after_forward is False


@pytest.mark.parametrize("cfg, match", [
    ({"distributed": "zero1"}, "distributed = 'zero1' has no place in Accelerate.*DeepSpeed"),
    ({"swa": True}, "swa = True has no place in Accelerate"),
    ({"auto_micro_batch": True}, "auto_micro_batch = True has no place"),
    ({"device": "cuda:1"}, "CUDA_VISIBLE_DEVICES=1"),
])
def test_what_accelerate_cannot_serve_is_one_line(cfg, match):
    with pytest.raises(UserError, match=match) as err:
        accelerator_kwargs_from(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=match):
        tricks_for(cfg)


# -- issue 34: after_step follows the accelerator's real steps, and the Tricks' state survives save/load_state -------

def _loop(folder, stop_at: int = 0, resume: bool = False):
    """8 optimizer steps over 16 micro-batches of 2 (accumulation 2), a cosine schedule and the EMA from the
    configuration; stops after ``stop_at`` steps with ``accelerator.save_state()`` (a killed job's checkpoint)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    cfg = {"ema": True, "ema_decay": 0.9, "accumulate": 2, "schedule": "cosine", "lr": 1e-2, "max_steps": 8,
           "device": "cpu", "checkpoint_dir": str(folder), "progress": False}
    accelerator = accelerate.Accelerator(**accelerator_kwargs_from(cfg))
    tricks = tricks_for(cfg, accelerator)
    model, optimizer = tricks.prepare(gpt2())  # the configuration's AdamW and its cosine schedule over max_steps
    loader = DataLoader(lm_data(32), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if resume:
        accelerator.load_state()
        loader = accelerator.skip_first_batches(loader, 2 * tricks.step_count)
    lrs, micro = [], 0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            tricks.guard(loss)
            optimizer.step()
            optimizer.zero_grad()
            if tricks.after_step():  # nothing on the first micro-batch of each group
                lrs.append(optimizer.param_groups[0]["lr"])
        micro += 1
        if stop_at and tricks.step_count == stop_at:
            accelerator.save_state()
            break
    return tricks, lrs, micro


def test_after_step_does_nothing_on_a_micro_batch_that_did_not_step(tmp_path):
    tricks, lrs, micro = _loop(tmp_path / "whole")
    assert micro == 16 and tricks.step_count == len(lrs) == 8 and tricks.ema.num_updates == 8
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)  # the cosine reaches 0 at the 8th step, not halfway


def test_stopped_and_resumed_the_ema_and_the_lr_equal_an_uninterrupted_run(tmp_path):
    whole, whole_lrs, _ = _loop(tmp_path / "whole")
    _, first, _ = _loop(tmp_path / "cut", stop_at=4)
    resumed, second, _ = _loop(tmp_path / "cut", resume=True)
    assert resumed.step_count == whole.step_count == 8
    assert_resumed_like(whole.ema, resumed.ema, whole_lrs, first, second)


def test_a_toml_with_only_precision_changes_no_other_keyword_of_yours(tmp_path):
    toml = tmp_path / "tricks.toml"
    toml.write_text('[train]\nprecision = "bf16"\n')
    kw = accelerator_kwargs_from(str(toml), gradient_accumulation_steps=2, cpu=True)
    assert dict(kw) == {"gradient_accumulation_steps": 2, "cpu": True, "mixed_precision": "bf16"}
    assert kw.tricks_changes == {"mixed_precision": (None, "bf16")}
    with pytest.raises(UserError, match=r"conflict: mixed_precision='no' in your Accelerator keywords, "
                                        r"mixed_precision='bf16' from the configuration's precision"):
        accelerator_kwargs_from(str(toml), mixed_precision="no")
