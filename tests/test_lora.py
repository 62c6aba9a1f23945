"""LoRA (peft) and frozen parameters (issue 38): no optimizer state and no change for frozen weights, gradients
through checkpointed blocks whose inputs come from a frozen embedding, the chunked loss through the peft wrapper,
and a LoRA GPT-2 tuned, then trained through Tricks and the transformers Trainer with the tuned tricks.toml."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from _trainer_data import lm_data  # noqa: E402
from torch_tricks.train import Tricks  # noqa: E402


@pytest.fixture(autouse=True)
def _threads_kept():
    """A tuned tricks.toml may set the intra-op threads process-wide: the tests after these keep theirs."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _lora(zero_b: bool = True) -> torch.nn.Module:
    """The tiny LoRA GPT-2; ``zero_b=False``: B random too, so that A has a gradient before the first step."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=128, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM",
                                                      lora_dropout=0.0, init_lora_weights=zero_b))


def _batches(n: int, size: int = 4) -> list[dict[str, torch.Tensor]]:
    rows = lm_data(n * size)
    return [{k: torch.stack([r[k] for r in rows[i * size:(i + 1) * size]]) for k in ("input_ids", "labels")}
            for i in range(n)]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _assert_lora_trained(model: torch.nn.Module, before: dict[str, torch.Tensor], optimizer) -> None:
    """Frozen weights as they were and out of the optimizer's state; every LoRA weight changed and in it."""
    inner = getattr(optimizer, "optimizer", optimizer)  # the Trainer's AcceleratedOptimizer wraps torch's
    in_state = {id(p) for p, s in inner.state.items() if s}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora) and len(frozen) > len(lora)
    assert not [n for n, p in frozen.items() if id(p) in in_state], "frozen parameters hold optimizer state"
    assert in_state == {id(p) for p in lora.values()}
    assert [n for n, p in frozen.items() if not torch.equal(p.detach().cpu(), before[n])] == []
    assert [n for n, p in lora.items() if torch.equal(p.detach().cpu(), before[n])] == []


@pytest.mark.parametrize("cfg", [{}, {"optimizer_state": "bf16"}, {"optimizer_in_backward": True},
                                 {"ema": True, "ema_decay": 0.9}])
def test_frozen_parameters_get_no_optimizer_state_and_stay_as_they_were(cfg):
    model = _lora()
    before = _weights(model)
    tricks = Tricks({**cfg, "device": "cpu", "lr": 1e-2, "keep_heap": False})
    own, opt = tricks.prepare(model)
    for batch in _batches(3):
        with tricks.autocast():
            loss = own(**batch).loss
        tricks.backward(loss)
        tricks.step()
    _assert_lora_trained(model, before, opt)
    if tricks.ema is not None:  # the average's frozen weights are the model's; its LoRA weights an average
        ema = dict(tricks.ema.module.named_parameters())
        for n, p in model.named_parameters():
            assert torch.equal(ema[n], p) != p.requires_grad, n


def _lora_grads(cfg: dict) -> dict[str, torch.Tensor | None]:
    """The LoRA weights' gradients of one backward through Tricks (from the same weights and batch each time)."""
    model = _lora(zero_b=False)
    # a trainable final norm (as peft's modules_to_save makes one): the loss needs grad even when no gradient
    # enters the blocks, so a checkpointing that cuts them off fails silently instead of raising in backward
    model.get_base_model().transformer.ln_f.requires_grad_(True)
    tricks = Tricks({**cfg, "device": "cpu", "keep_heap": False})
    own, _ = tricks.prepare(model)
    assert all(f"{k}={v}" in tricks.applied or k in tricks.applied for k, v in cfg.items())  # in effect
    batch = _batches(1)[0]
    with tricks.autocast():
        tricks.backward(own(**batch).loss, weight=1.0)
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _assert_same_nonzero(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n, g in got.items():
        assert g is not None and bool(g.abs().sum() > 0), f"{n}: no gradient reached it"
        torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_checkpointed_blocks_after_a_frozen_embedding_still_give_the_lora_weights_their_gradients(monkeypatch):
    plain = _lora_grads({})
    _assert_same_nonzero(_lora_grads({"checkpointing": "blocks"}), plain)

    # planted: reentrant checkpointing, the classic failure: the blocks' inputs come from the frozen embedding and
    # do not require grad, so autograd never enters the blocks and the LoRA weights get no gradient
    import torch_tricks.train.memory as memory

    real = memory.checkpoint
    monkeypatch.setattr(memory, "checkpoint", lambda fn, *args, use_reentrant, context_fn=None: real(
        fn, *args, use_reentrant=True))
    with pytest.raises(AssertionError, match="no gradient reached it"):
        _assert_same_nonzero(_lora_grads({"checkpointing": "blocks"}), plain)


def test_the_chunked_loss_serves_a_peft_model_through_the_model_it_wraps():
    from torch_tricks.train.lm_loss import chunk_lm_loss

    _assert_same_nonzero(_lora_grads({"chunked_lm_loss": True}), _lora_grads({}))
    model = chunk_lm_loss(_lora().train())
    out = model(**_batches(1)[0])
    assert out.logits is None and out.loss is not None  # computed chunk by chunk: the logits never whole


def test_the_attention_of_a_peft_model_is_switched_on_the_model_it_wraps():
    from torch_tricks.train.attention import attention_support, current_attention, set_attention

    model = _lora()
    assert attention_support(model, "sdpa", "cpu") == (True, "")  # read from GPT-2's flags, not the wrapper's
    set_attention(model, "eager", "cpu")
    assert current_attention(model) == "eager" == model.get_base_model().config._attn_implementation
    set_attention(model, "sdpa", "cpu")
    assert current_attention(model) == "sdpa"


def test_a_lora_gpt2_tuned_then_trained_through_tricks_and_the_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    from torch_tricks import tune
    from torch_tricks.integrations.hf import TricksCallback, training_args_from

    batch = _batches(1)[0]
    report = tune(_lora, batch, budget_s=6, progress=False, skip=["compile"], name="lora-gpt2")
    report.write(tmp_path)
    counts = json.loads((tmp_path / "report.json").read_text())["parameters"]
    model = _lora()
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counts == {"trainable": n, "total": sum(p.numel() for p in model.parameters())} and 0 < n < counts["total"]
    assert f"{n:,} of {counts['total']:,} parameters train" in report.to_text()
    toml = tmp_path / "tricks.toml"

    # 20 steps through Tricks in an own loop
    before = _weights(model)
    tricks = Tricks(toml, device="cpu", lr=1e-2)
    own, opt = tricks.prepare(model)
    losses = []
    for batch in _batches(20):
        with tricks.autocast():
            loss = own(**batch).loss
        tricks.backward(loss)
        tricks.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(x) for x in losses) and sum(losses[-5:]) < sum(losses[:5]), losses
    _assert_lora_trained(model, before, opt)

    # 20 steps through the transformers Trainer, with the same file
    model = _lora()
    before = _weights(model)
    base = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], max_steps=20,
                             per_device_train_batch_size=4, learning_rate=1e-2, use_cpu=True, save_strategy="no",
                             logging_steps=5)
    trainer = Trainer(model=model, args=training_args_from(toml, base=base), train_dataset=lm_data(80),
                      callbacks=[TricksCallback(toml)])
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 20 and len(logged) == 4 and all(math.isfinite(x) for x in logged)
    assert logged[-1] < logged[0], logged
    _assert_lora_trained(model, before, trainer.optimizer)
