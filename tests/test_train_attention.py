"""T34, a transformers model's attention implementation (issue 36): which ones can train here (one line where one
cannot), the same losses from eager and SDPA, the key through TrainConfig, Tricks, the CLI and the tune."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.train import TrainConfig, Tricks  # noqa: E402
from torch_tricks.train.attention import attention_modes, attention_support, current_attention  # noqa: E402
from torch_tricks.tuning.decide import DRIFT_TOLERANCE  # noqa: E402


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=500,
                                        max_position_embeddings=64))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


def test_which_implementations_can_train_here_and_why_not():
    llama, gpt2 = _llama(), _gpt2()
    assert current_attention(llama) == "sdpa" and current_attention(nn.Linear(2, 2)) is None
    assert attention_support(llama, "eager", "cpu") == (True, "")
    ok, why = attention_support(llama, "flex", "cpu")
    assert not ok and "no backward on a CPU" in why
    ok, why = attention_support(gpt2, "flex", "cuda")
    assert not ok and "GPT2LMHeadModel does not support attn_implementation='flex_attention'" in why
    ok, why = attention_support(llama, "flash2", "cpu")
    assert not ok and "CUDA" in why and "flash_attn" in why
    ok, why = attention_support(nn.Linear(2, 2), "sdpa", "cpu")
    assert not ok and "not a transformers model" in why
    assert not attention_support(llama, "fast", "cpu")[0]
    ok_modes, refused = attention_modes(llama, "cpu")
    assert ok_modes == ["eager"] and {m for m, _ in refused} == {"flex", "flash2"}


def _losses(mode: str, steps: int = 3) -> list[float]:
    tricks = Tricks({"attention": mode, "device": "cpu", "progress": False, "nan_guard": False, "lr": 1e-3})
    model, _ = tricks.prepare(_llama())
    assert f"attention={mode}" in tricks.applied and current_attention(model) == mode
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (4, 32), generator=g)
    out = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        tricks.backward(loss)
        tricks.step()
        out.append(float(loss.detach()))
    return out


def test_eager_and_sdpa_train_to_the_same_losses_within_the_drift_tolerance():
    eager, sdpa = _losses("eager"), _losses("sdpa")
    drift = max(abs(a - b) for a, b in zip(eager, sdpa)) / abs(sdpa[0])
    assert drift <= DRIFT_TOLERANCE["loss"] and drift < 1e-4, (eager, sdpa)  # fp32 kernels: the same numbers


def test_bad_values_are_one_line_errors(capsys):
    with pytest.raises(UserError, match="attention must be eager, sdpa, flex, flash2 or one SDPA kernel"):
        TrainConfig(attention="fast").validate()
    with pytest.raises(UserError, match=r"^attention = flex: FlexAttention has no backward on a CPU"):
        Tricks({"attention": "flex", "device": "cpu", "progress": False}).prepare(_llama())
    from torch_tricks.cli import main

    for value, needle in (("fast", "attention must be eager, sdpa, flex, flash2 or one SDPA kernel"),
                          ("sdpa", "is not a transformers model")):
        code = main(["train", "--model", "mlp", "--data", "digits", "--epochs", "1", "--device", "cpu",
                     "--attention", value, "--no-progress"])
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("torch-tricks: error:")]
        assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_the_tune_measures_the_other_implementation_and_skips_the_rest_with_the_reason():
    from torch_tricks.tuning import tune

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (4, 32), generator=g)
    report = tune(_llama, {"input_ids": ids, "labels": ids}, budget_s=15, progress=False, threads=1,
                  skip=["compile", "mixed_precision", "ema", "deterministic", "checkpointing", "fused_optimizer",
                        "gradient_accumulation", "low_precision_optimizer_state", "optimizer_in_backward",
                        "chunked_lm_loss"])
    row = next(r for r in report.results if r.name == "attention:eager")
    assert row.status == "measured" and row.loss_drift is not None and row.loss_drift <= DRIFT_TOLERANCE["loss"], row
    skipped = {s.name: s.reason for s in report.skipped}
    assert "no backward on a CPU" in skipped["attention:flex"] and "flash_attn" in skipped["attention:flash2"]
    assert report.recommended_config().get("attention", "") in ("", "eager")
