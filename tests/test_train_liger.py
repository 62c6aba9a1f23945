"""T38, Liger's fused LM kernels (issue 36): refused in one line where they cannot run (not CUDA, not installed,
a model type Liger does not patch), the Trainer's own switch (use_liger_kernel) where it trains, and on a CUDA GPU
with liger-kernel a Llama that trains to the same losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_tricks.train.liger as liger
from torch_tricks._optional import available
from torch_tricks.errors import UserError
from torch_tricks.train import Tricks

_LIGER_GPU = torch.cuda.is_available() and available("liger_kernel.transformers")


def test_a_cpu_is_refused_in_one_line_before_the_model_changes():
    ok, why = liger.liger_available("cpu")
    assert not ok and why == "Liger's kernels are Triton kernels for CUDA GPUs; this is cpu"
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(UserError, match="^liger: Liger's kernels are Triton kernels for CUDA GPUs"):
        Tricks({"liger": True, "device": "cpu", "inplace": True}).prepare(model)
    assert not model[1].inplace


def test_a_model_liger_does_not_patch_is_named(monkeypatch):
    monkeypatch.setattr(liger, "liger_available", lambda device: (True, ""))
    ok, why = liger.liger_support(nn.Linear(2, 2), "cpu")
    assert not ok and "transformers language models" in why
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setattr(liger, "_patched_types", lambda: frozenset({"llama", "qwen2"}))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    ok, why = liger.liger_support(gpt2, "cpu")
    assert not ok and why == "Liger has no kernels for model type 'gpt2' (it patches llama, qwen2)"


def test_the_trainer_gets_its_own_switch_and_the_callback_checks_the_device():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from torch_tricks.integrations.hf import TricksCallback, training_args_from

    assert training_args_from({"liger": True})["use_liger_kernel"] is True
    args = TrainingArguments(output_dir="out", use_liger_kernel=True, use_cpu=True, report_to=[])
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(UserError, match="^liger: Liger's kernels are Triton kernels for CUDA GPUs; this is cpu"):
        TricksCallback({"liger": True}).on_init_end(args, None, None, model=gpt2)


def test_the_tune_says_why_it_does_not_measure_it_here():
    from torch_tricks.tuning.candidates import training_candidates

    _, skipped = training_candidates(nn.Linear(4, 2), (torch.randn(2, 4),), torch.device("cpu"), batch=2)
    assert "Triton kernels for CUDA" in {s.name: s.reason for s in skipped}["liger"]


@pytest.mark.skipif(not _LIGER_GPU, reason="needs a CUDA GPU and liger-kernel (pip install 'torch-tricks[liger]')")
def test_a_llama_trains_to_the_same_losses_with_liger_on_cuda():
    from transformers import LlamaConfig, LlamaForCausalLM

    def losses(cfg: dict) -> list[float]:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
        tricks = Tricks({**cfg, "device": "cuda", "progress": False})
        model, opt = tricks.prepare(model)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 256, (4, 64), generator=g).cuda()
        out = []
        for _ in range(4):
            loss = model(input_ids=ids, labels=ids).loss
            tricks.backward(loss)
            tricks.step()
            out.append(loss.item())
        return out

    assert losses({"liger": True}) == pytest.approx(losses({}), rel=1e-3)
