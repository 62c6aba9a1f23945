"""T28 chunked LM-head loss: the loss and every gradient equal the model's own (fp32, rel 1e-5) on a
small GPT-2 (tied embeddings) and a small Llama (an untied head), with -100 labels and a padding
mask; within the tune's drift tolerance under bf16; in the user's own loop through ``Tricks`` the
unchanged ``model(input_ids=..., labels=...).loss`` is the chunked one; bad use is one line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("transformers")

from torch_tricks.cli import main  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.models import load_model  # noqa: E402
from torch_tricks.train import Tricks  # noqa: E402
from torch_tricks.train.lm_loss import chunk_lm_loss, chunked_lm_loss, is_chunked, lm_head_of  # noqa: E402
from torch_tricks.tuning.tuner import DRIFT_TOLERANCE  # noqa: E402

VOCAB, B, T = 500, 3, 24
GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": VOCAB, "n_positions": 64, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 160, "vocab_size": VOCAB, "max_position_embeddings": 64}
MODELS = {"gpt2": ("hf:gpt2", GPT2), "llama": ("hf:llama", LLAMA)}
REL = 1e-5


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    ref, cfg = MODELS[name]
    return load_model(ref, hf_config=cfg)[0]


def _batch() -> dict[str, torch.Tensor]:
    """Token ids with right padding (a mask, and -100 labels where it is 0) and a few ignored labels."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 17:] = 0
    mask[2, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100  # a prompt not trained on
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", MODELS)
def test_the_chunked_loss_and_every_gradient_equal_the_models_own(name):
    plain = _model(name).train()
    chunked = chunk_lm_loss(copy.deepcopy(plain), chunk_tokens=7)  # 72 tokens in 11 chunks, the last short
    batch = _batch()
    ref, ref_grads = _loss_and_grads(plain, batch)
    out, grads = _loss_and_grads(chunked, batch)
    assert _rel(out.loss, ref.loss) <= REL
    assert set(grads) == set(ref_grads) and len(grads) > 10
    for n, g in grads.items():
        assert _rel(g, ref_grads[n]) <= REL, n
    assert ref.logits.shape == (B, T, VOCAB) and out.logits is None  # the whole logits never existed
    if name == "gpt2":  # tied: the head's weight is the embedding, and its gradient is both uses'
        assert lm_head_of(chunked).weight is chunked.get_input_embeddings().weight


def test_without_labels_or_in_eval_the_model_returns_its_logits():
    model = chunk_lm_loss(_model("gpt2"))
    batch = _batch()
    assert model.train()(input_ids=batch["input_ids"]).logits.shape == (B, T, VOCAB)
    with torch.no_grad():
        out = model.eval()(**batch)
    assert out.logits.shape == (B, T, VOCAB) and out.loss is not None
    assert "forward" not in lm_head_of(model).__dict__ and "_loss_function" not in model.__dict__  # nothing left swapped


def test_the_function_alone_matches_cross_entropy_with_num_items_and_without_shift():
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(2, 9, 16, generator=g), torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    y = torch.randint(0, 40, (2, 9), generator=g)
    y[1, 2] = -100
    ref = F.cross_entropy(F.linear(h, w, b).reshape(-1, 40), y.reshape(-1), reduction="sum") / 11
    got = chunked_lm_loss(h, w, y, bias=b, shift=False, num_items_in_batch=torch.tensor(11), chunk_tokens=4)
    assert _rel(got, ref) <= REL
    with pytest.raises(UserError, match="18 hidden states but 9 labels"):
        chunked_lm_loss(h, w, y[0], shift=False)


def test_under_bf16_the_loss_stays_within_the_tunes_drift_tolerance():
    plain, chunked = _model("llama").train(), chunk_lm_loss(_model("llama").train())
    batch = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(**batch).loss, chunked(**batch).loss
    fp32 = _model("llama").train()(**batch).loss
    assert abs(float(b) - float(a)) / float(a) <= DRIFT_TOLERANCE["loss"]
    assert abs(float(b) - float(fp32)) / float(fp32) <= DRIFT_TOLERANCE["loss"]


def test_in_the_users_own_loop_through_tricks_the_unchanged_loss_is_the_chunked_one():
    ref_model = _model("gpt2")
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    model = copy.deepcopy(ref_model)
    tricks = Tricks(chunked_lm_loss=True, device="cpu", progress=False, nan_guard=False)
    model, opt = tricks.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert "chunked_lm_loss" in tricks.applied and is_chunked(model)
    for step in range(3):  # the user's loop, unchanged: model(**batch).loss
        batch = _batch()
        with tricks.autocast():
            out = model(**batch)
        assert out.logits is None
        tricks.backward(out.loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        tricks.step()
        ref_opt.zero_grad(set_to_none=True)
        ref = ref_model.train()(**batch)
        ref.loss.backward()
        assert _rel(out.loss, ref.loss) <= REL, step
        for n, p in ref_model.named_parameters():
            if p.grad is not None:
                assert _rel(grads[n], p.grad) <= REL, (step, n)
        ref_opt.step()


def test_a_model_copied_after_switching_on_computes_its_own_loss():
    model = chunk_lm_loss(_model("gpt2"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(0.01)
    batch = _batch()
    a, b = model.train()(**batch), twin.train()(**batch)
    assert a.logits is None and b.logits is None and float(a.loss) != float(b.loss)
    assert "forward" not in lm_head_of(model).__dict__  # the twin's forward touched only the twin


def test_a_model_without_a_vocabulary_head_is_one_line():
    with pytest.raises(UserError, match="no vocabulary head.*switch chunked_lm_loss off"):
        chunk_lm_loss(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(UserError, match="no vocabulary head"):
        Tricks(chunked_lm_loss=True, device="cpu").prepare(nn.Sequential(nn.Linear(4, 4)))


def test_a_model_that_changes_its_logits_before_the_loss_is_refused():
    model = _model("gpt2")

    class Capped(type(model)):  # soft-capping between head and loss: the chunked loss would train something else
        def forward(self, input_ids=None, labels=None, **kw):
            out = super().forward(input_ids=input_ids, **kw)
            logits = 3.0 * torch.tanh(out.logits / 3.0)
            loss = None if labels is None else self.loss_function(logits, labels, vocab_size=VOCAB)
            return type(out)(loss=loss, logits=logits)

    model.__class__ = Capped
    with pytest.raises(UserError, match="differ by .* relative with the chunked loss"):
        chunk_lm_loss(model)
    assert not is_chunked(model) and "forward" not in lm_head_of(model).__dict__


def test_the_cli_refuses_it_on_an_image_model_with_exit_2(capsys):
    code = main(["train", "--model", "small_cnn", "--data", "digits", "--max-steps", "1", "--chunked-lm-loss",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no vocabulary head" in err, err


def test_fit_with_chunked_lm_loss_makes_the_updates_plain_fit_makes():
    from torch_tricks.train import TrainConfig, fit

    batches = [_batch() for _ in range(3)]
    cfg = TrainConfig(epochs=1, optimizer="sgd", lr=0.1, device="cpu", progress=False, log_every=1)
    plain, chunked, start = _model("gpt2"), _model("gpt2"), _model("gpt2")
    h0 = fit(plain, batches, config=cfg)
    h1 = fit(chunked, batches, config=cfg.replace(chunked_lm_loss=True))
    assert h1.config["chunked_lm_loss"] is True and is_chunked(chunked) and h0.steps == h1.steps == 3
    for (n, a), b, p0 in zip(plain.named_parameters(), chunked.parameters(), start.parameters()):
        assert _rel(b - p0, a - p0) <= 1e-4, n  # three SGD steps (momentum 0.9) from equal gradients


def test_the_tune_measures_it_on_a_causal_lm_and_its_peak_is_lower():
    from torch_tricks.tuning import tune

    torch.manual_seed(0)
    report = tune(lambda: _model("gpt2"), _batch(), budget_s=20, progress=False,
                  skip=["compile", "ema", "deterministic", "mixed_precision", "checkpointing", "inplace_activations",
                        "memory_efficient_bn", "gradient_accumulation", "fused_optimizer", "channels_last",
                        "low_precision_optimizer_state"])
    row = next(r for r in report.results if r.name == "chunked_lm_loss")
    assert row.status == "measured", row
    assert row.peak_bytes < report.baseline.peak_bytes  # the logits (3 x 24 x 500 fp32, and their copies) are gone
    assert row.loss_drift is not None and row.loss_drift <= 1e-5  # the same loss, step after step


def test_with_checkpointing_accumulation_and_bf16_in_fit():
    from torch_tricks.train import TrainConfig, fit

    batches = [_batch() for _ in range(4)]
    cfg = TrainConfig(epochs=1, optimizer="sgd", lr=0.1, device="cpu", progress=False, log_every=1, accumulate=2,
                      checkpointing="blocks")
    plain, chunked, start = _model("llama"), _model("llama"), _model("llama")
    fit(plain, batches, config=cfg)
    h = fit(chunked, batches, config=cfg.replace(chunked_lm_loss=True))
    assert h.steps == 2 and h.config["checkpointing"] == "blocks"
    for (n, a), b, p0 in zip(plain.named_parameters(), chunked.parameters(), start.parameters()):
        assert _rel(b - p0, a - p0) <= 1e-4, n
    bf = _model("llama")
    hb = fit(bf, batches, config=cfg.replace(chunked_lm_loss=True, precision="bf16"))
    hp = fit(_model("llama"), batches, config=cfg.replace(precision="bf16"))
    b, p = hb.final["train_loss"], hp.final["train_loss"]
    assert abs(b - p) / p <= DRIFT_TOLERANCE["loss"], (b, p)


@pytest.mark.parametrize("mode,params,applied_file,needles", [
    ("ddp", "params.pt", "applied.txt", ("chunked_lm_loss", "logits None under DDP: True")),
    ("fsdp", "fsdp_params.pt", "fsdp_applied.txt", ("chunked_lm_loss", "fsdp")),
])
def test_on_two_ranks_fit_with_the_chunked_loss_makes_the_single_process_updates(gloo_jobs, mode, params,
                                                                                applied_file, needles):
    """Two gloo ranks (the session's shared torchrun launch), each on the same batches: DDP averages equal
    gradients, and FSDP2 gathers its sharded parameters for the forward the chunked loss runs in, so the (full)
    parameters are one process's plain fit's. The FSDP run first found fit under FSDP with SGD on a CPU
    crashing at the first step (a fused SGD step has no sharded form)."""
    from torch_tricks.train import TrainConfig, fit

    assert gloo_jobs.returncode == 0 and (gloo_jobs.lm / params).exists(), gloo_jobs.log[-3000:]
    applied = (gloo_jobs.lm / applied_file).read_text()
    assert all(n in applied for n in needles), (mode, applied)
    ranks = torch.load(gloo_jobs.lm / params)
    single, start = _model("gpt2"), _model("gpt2")
    fit(single, [_batch() for _ in range(3)], config=TrainConfig(epochs=1, optimizer="sgd", lr=0.1, device="cpu",
                                                                 progress=False))
    for (n, p), p0 in zip(single.named_parameters(), start.parameters()):
        key = n if n in ranks else n.replace("transformer.wte", "lm_head")
        assert _rel(ranks[key] - p0.detach(), p.detach() - p0.detach()) <= 1e-4, (mode, n)


def test_the_tune_leaves_it_out_where_the_loss_is_computed_outside_the_model():
    """Found on a GPU run: `tune --input long:512:50257` (positional ids, next-token targets outside the
    model) measured it as a switch that changed nothing; it is skipped there, saying what would change it."""
    from torch_tricks import batches as B
    from torch_tricks.outputs import get_loss
    from torch_tricks.tuning.candidates import training_candidates

    model, batch = _model("gpt2"), _batch()
    positional = (batch["input_ids"], batch["labels"])
    assert B.labels_go_in(model, batch, get_loss("auto"))
    assert not B.labels_go_in(model, positional, get_loss("auto")) and not B.labels_go_in(model, batch, get_loss("ce"))
    for labels_in, measured in [(True, True), (False, False)]:
        cands, skipped = training_candidates(model, (batch["input_ids"],), torch.device("cpu"), batch=B,
                                             labels_in_forward=labels_in)
        assert any(c.name == "chunked_lm_loss" for c in cands) is measured
        if not measured:
            why = next(s.reason for s in skipped if s.name == "chunked_lm_loss")
            assert "outside the model" in why and "--input input_ids=" in why
