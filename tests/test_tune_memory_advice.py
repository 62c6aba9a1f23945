"""torch-tricks memory names the largest share of a step's memory and the trick that attacks it, with both
step peaks measured (issue 21, item 6)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from torch_tricks.batches import example_batch
from torch_tricks.cli import main
from torch_tricks.inspect.memory import memory_report
from torch_tricks.tuning.memory_advice import advise_memory, shares


def test_a_causal_lm_counts_its_loss_and_logits_apart_and_the_advice_is_measured():
    pytest.importorskip("transformers")
    from torch_tricks.models import load_model

    torch.manual_seed(0)
    model = load_model("hf:gpt2", hf_config={"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32,
                                             "vocab_size": 4000})[0]
    ids = torch.randint(0, 4000, (8, 32), generator=torch.Generator().manual_seed(1))
    batch, loss_fn = example_batch(model, {"input_ids": ids}, loss="auto")
    rep = memory_report(model, batch, loss_fn=None)  # the model's own loss, labels in the batch
    parts = shares(rep, model)
    assert parts["loss and logits"] >= 8 * 32 * 4000 * 4  # cross-entropy's log-softmax of the fp32 logits
    assert sum(parts.values()) == rep.param_bytes + rep.grad_bytes + rep.optimizer_state_bytes + rep.activation_bytes
    advice = advise_memory(model, rep, batch, loss_fn)
    assert advice.share == max(parts, key=parts.get) == "loss and logits"  # a 4000-word vocabulary, 32 wide
    assert advice.trick == "chunked_lm_loss" and advice.changes == {"chunked_lm_loss": True}
    assert advice.trick_peak_bytes < advice.plain_peak_bytes and advice.saving > 0.2
    assert "largest share: loss and logits" in advice.to_text() and "saved, measured" in advice.to_text()


def test_where_the_optimizer_state_is_largest_it_names_bf16_state_with_its_measured_saving():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(2, 1024), torch.randint(0, 10, (2,))
    rep = memory_report(model, x, loss_fn=nn.functional.cross_entropy, target=y)
    advice = advise_memory(model, rep, (x, y), nn.functional.cross_entropy)
    assert advice.share == "optimizer state" and advice.trick == "low_precision_optimizer_state"
    assert advice.changes == {"optimizer_state": "bf16"} and advice.saving > 0.15  # 16 of AdamW's 33 MiB of state
    assert "saved, measured" in advice.to_text() and "8bit / 4bit state (torchao)" in advice.to_text()
    sgd = advise_memory(model, memory_report(model, x, loss_fn=nn.functional.cross_entropy, target=y,
                                             optimizer="sgd"), (x, y), nn.functional.cross_entropy, optimizer="sgd")
    assert sgd.share in ("parameters", "gradients")  # plain SGD keeps no state


def test_the_cli_prints_it_and_puts_it_in_the_json(capsys):
    assert main(["memory", "--model", "small_cnn", "--batch", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    advice = data["advice"]
    assert advice["share"] in advice["shares"] and advice["trick"]
    assert main(["memory", "--model", "small_cnn", "--batch", "32", "--no-advice"]) == 0
    assert "largest share" not in capsys.readouterr().out
