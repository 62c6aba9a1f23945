"""The tune's configuration in transformers' Trainer (issue 22): the mapped TrainingArguments and TricksCallback put
each switch in effect in a real Trainer, a plain Tricks loop and the Trainer give the same first losses, and
what the Trainer cannot serve is one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own dependency

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402

from _trainer_data import assert_resumed_like, ema_of, gpt2 as _gpt2, lm_data as _data  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.integrations.hf import TricksCallback, trainer_lines, training_args_from  # noqa: E402
from torch_tricks.train import Tricks  # noqa: E402


class InOrder(Trainer):
    """The Trainer over the data in order (the test fixes the sampler; the Trainer's own shuffles)."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


class Seen(TrainerCallback):
    """What the test reads from inside the Trainer: the autocast state in forward, the losses, and the raw weights
    after each step (from which it computes its own EMA)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.autocast: list[tuple[bool, torch.dtype]] = []
        self.losses: list[float] = []
        self.weights: list[dict[str, torch.Tensor]] = []  # after each optimizer step
        # inside the forward (the Trainer's autocast wraps model.forward, within the model's own hooks)
        model.transformer.register_forward_pre_hook(lambda m, a: self.autocast.append(
            (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))) if m.training else None)
        model.register_forward_hook(lambda m, a, out: self.losses.append(float(out.loss.detach())) if m.training
                                    else None)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights.append({k: v.detach().float().clone() for k, v in model.state_dict().items()})


def _trainer(cfg: dict, tmp_path, model: torch.nn.Module, data=None, seen: Seen | None = None) -> Trainer:
    cfg.setdefault("device", "cpu")  # on a GPU machine too: the test reads CPU autocast
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], **training_args_from(cfg))
    callbacks = [TricksCallback(cfg)] + ([seen] if seen else [])
    return InOrder(model=model, args=args, train_dataset=data or _data(), callbacks=callbacks)


def test_each_switch_is_in_effect_in_a_real_trainer_and_the_loss_goes_down(tmp_path):
    cfg = {"precision": "bf16", "checkpointing": "blocks", "accumulate": 2, "batch_size": 4, "lr": 1e-2,
           "epochs": 3, "ema": True, "ema_decay": 0.9, "log_every": 1, "progress": False, "weight_decay": 0.01}
    model = _gpt2()
    seen = Seen(model)
    trainer = _trainer(cfg, tmp_path, model, seen=seen)
    trainer.train()
    assert seen.autocast and all(on and dtype == torch.bfloat16 for on, dtype in seen.autocast)  # bf16 in forward
    assert model.is_gradient_checkpointing
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert type(inner) is torch.optim.AdamW and inner.defaults["fused"] is True
    assert trainer.args.gradient_accumulation_steps == 2
    assert trainer.state.global_step == 3 * 24 // (4 * 2)  # 24 samples, 4 a micro-batch, 2 micro-batches a step
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TricksCallback))
    assert cb.ema is not None and cb.ema.num_updates == trainer.state.global_step
    ours = ema_of(seen.weights, 0.9)
    for k, v in cb.ema.module.state_dict().items():
        torch.testing.assert_close(v.float(), ours[k], rtol=1e-5, atol=1e-6)
    first, last = sum(seen.losses[:2]) / 2, sum(seen.losses[-2:]) / 2
    assert last < 0.9 * first, seen.losses  # (the Trainer divides each micro-batch loss by the group's tokens)


def test_a_plain_tricks_loop_and_the_trainer_give_the_same_first_losses(tmp_path):
    # the schedule and clipping stated: a key not given stays the Trainer's own (linear decay, clipping at 1.0)
    cfg = {"batch_size": 4, "lr": 1e-3, "max_steps": 3, "progress": False, "log_every": 1, "weight_decay": 0.01,
           "seed": 0, "schedule": "constant", "grad_clip": 0.0}
    data = _data(mask_first=True)
    model = _gpt2()
    seen = Seen(model)
    _trainer(cfg, tmp_path, model, data, seen).train()

    tricks = Tricks({**cfg, "nan_guard": False})
    own, _ = tricks.prepare(_gpt2())
    losses = []
    for i in range(3):
        batch = {k: torch.stack([d[k] for d in data[4 * i:4 * i + 4]]) for k in ("input_ids", "labels")}
        with tricks.autocast():
            loss = own(**batch).loss
        tricks.backward(loss)
        tricks.step()
        losses.append(float(loss))
    assert seen.losses[:3] == pytest.approx(losses, rel=1e-4), (seen.losses[:3], losses)
    assert losses[2] != losses[0]  # the steps changed the weights


def test_the_callback_applies_the_model_switches_before_the_optimizer_is_built(tmp_path):
    cfg = {"chunked_lm_loss": True, "batch_size": 4, "max_steps": 2, "progress": False, "nan_guard": True,
           "keep_heap": False}
    model = _gpt2()
    trainer = _trainer(cfg, tmp_path, model)
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TricksCallback))
    assert "chunked_lm_loss" in cb.applied and "nan_guard" in cb.applied
    trainer.train()
    ids = _data(2)[0]["input_ids"][None]
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None and out.loss is not None  # the chunked loss: logits never whole in training


def test_a_non_finite_loss_stops_the_trainer_naming_the_step(tmp_path):
    cfg = {"batch_size": 4, "max_steps": 3, "progress": False, "lr": 1e-3}
    model = _gpt2()
    trainer = _trainer(cfg, tmp_path, model)
    with torch.no_grad():
        model.transformer.wte.weight[3] = float("nan")
    data = _data()
    data[0]["input_ids"][0] = 3
    trainer.train_dataset = data
    with pytest.raises(UserError, match=r"loss is nan at step 1"):
        trainer.train()


def test_ema_weights_are_saved_beside_each_checkpoint(tmp_path):
    cfg = {"batch_size": 4, "max_steps": 2, "progress": False, "ema": True, "checkpoint_dir": str(tmp_path / "ck"),
           "checkpoint_every": 1, "device": "cpu"}
    args = training_args_from(cfg)
    assert args["output_dir"] == str(tmp_path / "ck") and args["save_steps"] == 1
    trainer = InOrder(model=_gpt2(), args=TrainingArguments(report_to=[], **args), train_dataset=_data(),
                      callbacks=[TricksCallback(cfg)])
    trainer.train()
    for step in (1, 2):
        saved = torch.load(tmp_path / "ck" / f"checkpoint-{step}" / "ema.pt", weights_only=True)
        assert saved["num_updates"] == step


def test_the_mapped_arguments():
    args = training_args_from({"precision": "fp16", "optimizer": "sgd", "momentum": 0.8, "grad_clip": 1.0,
                               "schedule": "cosine", "warmup_steps": 5, "deterministic": True, "compile": True,
                               "max_steps": 0, "optimizer_state": ""})
    assert args["fp16"] is True and args["bf16"] is False
    assert args["optim"] == "sgd" and args["optim_args"] == "momentum=0.8"
    assert args["max_grad_norm"] == 1.0 and args["lr_scheduler_type"] == "cosine" and args["warmup_steps"] == 5
    assert args["full_determinism"] is True and args["torch_compile"] is True and args["max_steps"] == -1
    assert training_args_from({"optimizer_state": "8bit"})["optim"] == "adamw_torch_8bit"
    assert training_args_from({"fused_optimizer": False})["optim"] == "adamw_torch"
    scaled = training_args_from({"scale_lr": True, "lr": 0.1, "batch_size": 64, "accumulate": 2, "base_batch": 256})
    assert scaled["learning_rate"] == pytest.approx(0.1 * 128 / 256)


def test_the_emitted_lines_carry_what_needs_your_own_code():
    lines = "\n".join(trainer_lines({"optimizer_state": "bf16", "resume": True, "checkpoint_dir": "ck"}))
    assert "optimizer_cls_and_kwargs=(Bf16StateAdam" in lines and "resume_from_checkpoint=True" in lines
    assert "callbacks=[TricksCallback(cfg)]" in lines and "'optimizer_state': 'bf16'" in lines


@pytest.mark.parametrize("cfg, match", [
    ({"optimizer_in_backward": True}, "optimizer_in_backward = True has no place in transformers Trainer: the "
                                      "Trainer steps its optimizer after backward"),
    ({"distributed": "zero1"}, "distributed = 'zero1' has no place in transformers Trainer"),
    ({"optimizer": "adam", "weight_decay": 0.1}, "optimizer = 'adam' has no place.*use optimizer = adamw"),
    ({"no_decay_norm_bias": False, "weight_decay": 0.1}, "no_decay_norm_bias = False has no place"),
    ({"swa": True}, "swa = True has no place"),
    ({"device": "cuda:1"}, "CUDA_VISIBLE_DEVICES=1"),
])
def test_what_the_trainer_cannot_serve_is_one_line(cfg, match):
    with pytest.raises(UserError, match=match) as err:
        training_args_from(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=match):
        TricksCallback(cfg)


def test_a_field_the_installed_transformers_lacks_is_one_line(monkeypatch):
    import dataclasses

    import torch_tricks.integrations.hf as hf

    real = dataclasses.fields
    monkeypatch.setattr(hf, "fields", lambda cls: [f for f in real(cls) if f.name != "torch_compile"])
    with pytest.raises(UserError, match=r"has no TrainingArguments field 'torch_compile'.*upgrade transformers"):
        training_args_from({"compile": True})


def test_an_unknown_key_in_the_toml_is_one_line(tmp_path):
    path = tmp_path / "tricks.toml"
    path.write_text("[train]\nprecision = 'bf16'\nprecison2 = true\n")
    with pytest.raises(UserError, match=r"unknown training option 'precison2'"):
        training_args_from(path)
    path.write_text("[train]\nprecision = 'bf16'\n")
    assert training_args_from(path)["bf16"] is True


@pytest.mark.cuda
def test_on_cuda_the_trainer_autocasts_bf16_and_the_callback_offloads_activations(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none here")
    cfg = {"precision": "bf16", "offload_activations": True, "batch_size": 4, "max_steps": 3, "progress": False,
           "device": "cuda"}
    model = _gpt2()
    dtypes = []
    model.transformer.register_forward_pre_hook(lambda m, a: dtypes.append(torch.get_autocast_dtype("cuda"))
                                                if torch.is_autocast_enabled("cuda") else None)
    saved_on_cpu = []
    model.transformer.h[0].mlp.register_forward_hook(
        lambda m, a, out: saved_on_cpu.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None))
    trainer = InOrder(model=model, args=TrainingArguments(output_dir=str(tmp_path / "o"), report_to=[],
                                                          **training_args_from(cfg)),
                      train_dataset=_data(), callbacks=[TricksCallback(cfg)])
    trainer.train()
    assert dtypes and set(dtypes) == {torch.bfloat16} and next(model.parameters()).is_cuda
    assert saved_on_cpu and all(saved_on_cpu)  # save_on_cpu's hooks were in force inside the forward


def test_tune_emit_hf_then_emit_of_its_toml_print_lines_that_run_in_a_trainer_script(tmp_path, capsys, run_script):
    import json
    from pathlib import Path

    from torch_tricks.cli import main

    hf = "n_layer=2,n_embd=32,n_head=2,vocab_size=128,n_positions=32"
    code = main(["tune", "--model", "hf:gpt2", "--hf-config", hf, "--input", "input_ids=long:16:128", "--batch", "4",
                 "--budget-seconds", "6", "--no-progress", "--emit", "hf", "--json", "--device", "cpu",
                 "--out", str(tmp_path / "out"), *(a for t in ("compile", "ema", "deterministic") for a in ("--skip", t))])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["emit"]["target"] == "hf"
    md = (tmp_path / "out" / "report.md").read_text()  # the report's "how to apply it" carries the same lines
    assert "### In your transformers Trainer script" in md and data["emit"]["lines"][-2] in md
    toml = tmp_path / "out" / "tricks.toml"
    assert main(["emit", "--config", str(toml), "--for", "hf"]) == 0  # the same file, later, without a new tune
    lines = capsys.readouterr().out.splitlines()
    assert f"cfg = {str(toml)!r}" in lines
    script = tmp_path / "train_hf.py"
    script.write_text("\n".join([
        "import sys",
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
        "from _trainer_data import gpt2, lm_data",
        "model, train_dataset = gpt2(), lm_data()",
        # pasted as printed; the user's own arguments line gets their own settings
        *(line.replace('TrainingArguments(output_dir="out"', 'TrainingArguments(output_dir="out", max_steps=2, '
                       'report_to=[]') for line in lines),
        "print('steps', trainer.state.global_step)",
    ]))
    run = run_script(script, cwd=tmp_path)  # as `python train_hf.py` in tmp_path (conftest.py)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "steps 2", run.stdout[-2000:]


@pytest.mark.parametrize("argv, match", [
    (["emit", "--config", "missing.toml", "--for", "hf"], "config file 'missing.toml' not found"),
    (["emit", "--config", "missing.toml", "--for", "keras"], "--for keras: give one of hf, lightning, accelerate, loop"),
])
def test_emit_of_a_missing_file_or_an_unknown_target_is_one_line_and_exit_2(capsys, argv, match):
    from torch_tricks.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err


def test_emit_of_an_unknown_trainer_is_one_line():
    from torch_tricks.integrations import emit_lines

    with pytest.raises(UserError, match="--emit keras: give one of hf, lightning, accelerate, loop"):
        emit_lines({}, "keras")


# -- issue 34: the Trainer gets exactly what the configuration gives, and keeps its state on resume --------------

def _fields(args: TrainingArguments) -> dict:
    import dataclasses

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}


def test_a_toml_with_only_precision_changes_no_other_field_of_your_arguments(tmp_path):
    toml = tmp_path / "tricks.toml"
    toml.write_text('[train]\nprecision = "bf16"\n')
    yours = TrainingArguments(output_dir=str(tmp_path / "o"), learning_rate=3e-4, num_train_epochs=1, use_cpu=True,
                              report_to=[])
    assert training_args_from(toml) == {"bf16": True, "fp16": False}  # nothing of torch-tricks' own defaults
    merged = training_args_from(str(toml), base=yours)
    before, after = _fields(yours), _fields(merged)
    assert {k for k in before if before[k] != after[k]} == {"bf16"}, {k: (before[k], after[k]) for k in before
                                                                       if before[k] != after[k]}
    assert merged.tricks_changes == {"bf16": (False, True)}
    assert (merged.learning_rate, merged.num_train_epochs, merged.max_grad_norm) == (3e-4, 1, 1.0)
    assert str(merged.lr_scheduler_type.value) == "linear"  # the Trainer's own schedule stays


def test_a_conflict_with_your_explicit_argument_is_one_line_unless_you_say_which_wins(tmp_path):
    yours = TrainingArguments(output_dir=str(tmp_path / "o"), learning_rate=3e-4, use_cpu=True, report_to=[])
    cfg = {"lr": 1e-3, "accumulate": 2}
    with pytest.raises(UserError, match=r"conflict: learning_rate=0.0003 in your TrainingArguments, "
                                        r"learning_rate=0.001 from the configuration's lr.*prefer='tuned'") as err:
        training_args_from(cfg, base=yours)
    assert "\n" not in str(err.value)
    tuned = training_args_from(cfg, base=yours, prefer="tuned")
    assert (tuned.learning_rate, tuned.gradient_accumulation_steps) == (1e-3, 2)
    kept = training_args_from(cfg, base=yours, prefer="yours")
    assert (kept.learning_rate, kept.gradient_accumulation_steps) == (3e-4, 2)
    assert kept.tricks_changes == {"gradient_accumulation_steps": (1, 2)}
    as_dict = training_args_from(cfg, base={"learning_rate": 3e-4, "output_dir": "o"}, prefer="yours")
    assert as_dict == {"learning_rate": 3e-4, "output_dir": "o", "gradient_accumulation_steps": 2}


@pytest.mark.parametrize("cfg, match", [
    ({"precision": "bf16"}, r"precision = 'bf16' in the configuration needs bf16=True, but the Trainer's arguments "
                            r"have bf16=False: build them with training_args_from\(cfg, base=your_args\)"),
    ({"accumulate": 4}, r"accumulate = 4 .* needs gradient_accumulation_steps=4, but .* have "
                        r"gradient_accumulation_steps=1"),
    ({"fused_optimizer": False}, r"fused_optimizer = False .* needs optim='adamw_torch'"),
    ({"grad_clip": 0.5}, r"grad_clip = 0.5 .* needs max_grad_norm=0.5"),
])
def test_the_callback_refuses_a_configuration_the_trainers_arguments_do_not_carry(tmp_path, cfg, match):
    args = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
    with pytest.raises(UserError, match=match) as err:
        InOrder(model=_gpt2(), args=args, train_dataset=_data(), callbacks=[TricksCallback(cfg)])
    assert "\n" not in str(err.value)


def test_applied_lists_the_trainers_own_switches_too(tmp_path):
    cfg = {"precision": "bf16", "accumulate": 2, "keep_heap": False}
    args = training_args_from(cfg, base=TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[]))
    trainer = InOrder(model=_gpt2(), args=args, train_dataset=_data(), callbacks=[TricksCallback(cfg)])
    cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TricksCallback))
    assert "precision=bf16 (bf16=True, fp16=False)" in cb.applied and "accumulate=2 (gradient_accumulation_steps=2)" in cb.applied


def test_the_callback_sets_the_threads_of_the_process(tmp_path):
    """``threads`` has no TrainingArguments field: the callback sets it when the Trainer is built and lists it."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not 1 already (one thread per xdist worker): the callback must change it
        trainer = _trainer({"threads": 1, "keep_heap": False}, tmp_path, _gpt2())
        cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TricksCallback))
        assert "threads=1" in cb.applied and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class Steps(TrainerCallback):
    """The lr after each optimizer step; stops the run after ``stop_at`` steps (as a killed job would, after its
    checkpoint)."""

    def __init__(self, stop_at: int = 0) -> None:
        self.lrs: list[float] = []
        self.stop_at = stop_at

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.lrs.append(optimizer.param_groups[0]["lr"])
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def test_stopped_and_resumed_the_ema_and_the_lr_equal_an_uninterrupted_run(tmp_path):
    def run(out, stop_at=0, resume=False):
        cfg = {"ema": True, "ema_decay": 0.9, "accumulate": 2, "schedule": "cosine", "lr": 1e-2, "batch_size": 2,
               "max_steps": 8, "checkpoint_dir": str(out), "checkpoint_every": 4, "device": "cpu", "progress": False}
        steps = Steps(stop_at)
        callback = TricksCallback(cfg)
        trainer = InOrder(model=_gpt2(), args=training_args_from(cfg, base=TrainingArguments(report_to=[])),
                          train_dataset=_data(), callbacks=[callback, steps])
        trainer.train(resume_from_checkpoint=resume or None)
        return callback, steps, trainer

    whole, whole_steps, _ = run(tmp_path / "whole")
    _, first, _ = run(tmp_path / "cut", stop_at=4)
    resumed, second, trainer = run(tmp_path / "cut", resume=True)
    assert trainer.state.global_step == 8 and any("ema restored from" in a for a in resumed.applied)
    assert_resumed_like(whole.ema, resumed.ema, whole_steps.lrs, first.lrs, second.lrs)


def test_resumed_without_the_ema_file_is_one_line(tmp_path):
    cfg = {"ema": True, "batch_size": 4, "max_steps": 2, "checkpoint_dir": str(tmp_path), "checkpoint_every": 1,
           "device": "cpu", "progress": False}
    InOrder(model=_gpt2(), args=training_args_from(cfg, base=TrainingArguments(report_to=[])),
            train_dataset=_data(), callbacks=[TricksCallback({**cfg, "ema": False})]).train()
    with pytest.raises(UserError, match=r"resumed at step 2 with ema = true, but .*checkpoint-2/ema.pt does not exist"):
        InOrder(model=_gpt2(), args=training_args_from({**cfg, "max_steps": 3}, base=TrainingArguments(report_to=[])),
                train_dataset=_data(), callbacks=[TricksCallback({**cfg, "max_steps": 3})]).train(
            resume_from_checkpoint=True)


def test_the_ema_weights_for_evaluation_and_save_model(tmp_path):
    cfg = {"ema": True, "ema_decay": 0.5, "batch_size": 4, "max_steps": 3, "lr": 1e-2, "device": "cpu",
           "progress": False}
    model = _gpt2()
    callback = TricksCallback(cfg, ema_weights_at_end=True)
    trainer = InOrder(model=model, args=training_args_from(cfg, base=TrainingArguments(output_dir=str(tmp_path),
                                                                                       report_to=[])),
                      train_dataset=_data(), callbacks=[callback])
    trainer.train()
    for k, v in callback.ema.module.state_dict().items():  # the model holds the average: evaluate and save_model use it
        torch.testing.assert_close(model.state_dict()[k], v)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved").is_dir()
    raw = {k: v + 1 for k, v in model.state_dict().items() if v.is_floating_point()}
    model.load_state_dict(raw, strict=False)
    with callback.ema_weights() as m:
        torch.testing.assert_close(m.transformer.wte.weight, callback.ema.module.transformer.wte.weight)
    torch.testing.assert_close(model.transformer.wte.weight, raw["transformer.wte.weight"])  # its own weights back


def test_the_attention_and_fp32_matmul_keys_take_effect_in_a_real_trainer(tmp_path):
    """Issue 36: attention switched on the model the Trainer trains; fp32_matmul set for the run (ieee runs
    everywhere); tf32 on a CPU refused in one line before training."""
    cfg = {"attention": "eager", "fp32_matmul": "ieee", "batch_size": 4, "max_steps": 2, "progress": False}
    model = _gpt2()
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        trainer = _trainer(cfg, tmp_path, model)
        trainer.train()
        assert model.config._attn_implementation == "eager" and trainer.state.global_step == 2
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        cb = next(c for c in trainer.callback_handler.callbacks if isinstance(c, TricksCallback))
        assert {"attention=eager", "fp32_matmul=ieee"} <= set(cb.applied)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = torch.backends.mkldnn.conv.fp32_precision = before
    with pytest.raises(UserError, match="fp32_matmul = tf32: TF32 is a CUDA"):
        _trainer({"fp32_matmul": "tf32", "max_steps": 1, "progress": False}, tmp_path, _gpt2())
