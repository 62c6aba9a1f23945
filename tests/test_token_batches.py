"""Tokens, not padding (T39-T41): padding, length grouping and packing of token rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.data.token_batches import (IGNORE_INDEX, LengthGroupedBatchSampler, pack_collate,
                                             packed_attention_mask, packing_keywords, packing_leak, pad_collate,
                                             real_tokens, row_lengths)
from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick

LENGTHS = (5, 17, 9, 30, 2, 11)
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: the same sums in another order


def _rows(lengths=LENGTHS, vocab=100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=gen)} for n in lengths]


def test_registered_as_t39_t40_t41():
    assert get_trick("dynamic_padding").ids == ("T39",)
    assert get_trick("length_grouped").ids == ("T40",)
    assert get_trick("packing").ids == ("T41",)


def test_pad_collate_pads_to_the_longest_row_rounded_to_8():
    batch = pad_collate(pad_id=7)(_rows((5, 17, 9)))
    assert batch["input_ids"].shape == (3, 24)
    assert batch["attention_mask"].sum(1).tolist() == [5, 17, 9]
    assert (batch["input_ids"][0, 5:] == 7).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    expected = batch["input_ids"][1].masked_fill((torch.arange(24) >= 17) | (torch.arange(24) == 0), -100)
    assert torch.equal(batch["labels"][1], expected)  # the first token predicted by none, as in a packed row
    assert pad_collate(pad_to=32)(_rows((5, 9)))["input_ids"].shape == (2, 32)
    with pytest.raises(UserError, match="does not fit pad_to=8"):
        pad_collate(pad_to=8)(_rows((9,)))


def test_pack_collate_restarts_positions_and_leaves_first_tokens_out_of_the_loss():
    rows = _rows((5, 17, 9, 30, 2, 11))
    batch = pack_collate(32)(rows)
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    assert ids.shape == (3, 32)  # 74 tokens: 30+2, 17+11, 9+5 by first fit, longest first
    segments = [ids[r, a:a + n].tolist() for r, a, n in _segments(pos)]
    assert all(row["input_ids"].tolist() in segments for row in rows)  # each row whole, positions 0..n-1
    assert len(segments) <= len(rows) + ids.shape[0]  # the rows, and at most one padding run per packed row
    assert (labels[pos == 0] == IGNORE_INDEX).all()
    assert (labels != IGNORE_INDEX).sum().item() == sum(LENGTHS) - len(LENGTHS)  # padding's labels are -100 too
    assert real_tokens(rows) == sum(LENGTHS)
    with pytest.raises(UserError, match="1 row.*longer than the packed row of 16 tokens.*longest 30"):
        pack_collate(16)(_rows((30, 3)))


def _segments(pos):
    for r in range(pos.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
        for a, b in zip(starts, starts[1:]):
            yield r, a, b - a


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=100,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, loss_type="ForCausalLM")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _equal(a, b):
    (la, ga), (lb, gb) = a, b
    return torch.allclose(la, lb, **TOL) and all(torch.allclose(x, y, **TOL) for x, y in zip(ga, gb))


def test_packed_transformers_batch_equals_the_padded_one_and_a_leak_does_not():
    model = _gpt2()
    rows = _rows()
    padded = _loss_and_grads(model, pad_collate()(rows))
    kw = packing_keywords(model)
    assert kw == {"use_cache": False}
    packed = _loss_and_grads(model, pack_collate(32, keywords=kw)(rows))
    assert _equal(padded, packed)
    # planted leaks: positions that do not restart (one long sequence), or a cache (transformers then
    # ignores the restart): the sequences see each other and the check fails
    flat = pack_collate(32, keywords=kw)(rows)
    flat["position_ids"] = torch.arange(32).expand_as(flat["input_ids"]).clone()
    assert not _equal(padded, _loss_and_grads(model, flat))
    assert not _equal(padded, _loss_and_grads(model, pack_collate(32, keywords={"use_cache": True})(rows)))


class _OwnLM(nn.Module):
    """A causal LM of one's own: SDPA attention with the mask it is given, positions from position_ids."""

    def __init__(self, vocab=100, d=32, n=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(n, d)
        self.qkv, self.out, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None, attention_mask=None, position_ids=None, leak=False):
        b, n = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(n).expand(b, n)
        if attention_mask is not None and attention_mask.dim() == 2:  # padded: causal, keys that are tokens
            mask = torch.ones(n, n, dtype=torch.bool).tril() & attention_mask.bool()[:, None, None, :]
        else:
            mask = packed_attention_mask(position_ids) if not leak else torch.ones(n, n, dtype=torch.bool).tril()
        x = self.tok(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1))
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)


def test_packed_own_model_batch_equals_the_padded_one_and_a_plain_causal_mask_leaks():
    torch.manual_seed(0)
    model = _OwnLM()
    rows = _rows()
    padded = _loss_and_grads(model, pad_collate()(rows))
    packed = _loss_and_grads(model, pack_collate(32)(rows))
    assert _equal(padded, packed)
    assert not _equal(padded, _loss_and_grads(model, {**pack_collate(32)(rows), "leak": True}))


def test_packed_attention_mask_is_causal_within_each_sequence():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = packed_attention_mask(pos)[0, 0]
    assert mask[2].tolist() == [True, True, True, False, False, False]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[5].tolist() == [False, False, False, False, False, True]


def test_packing_leak_tells_a_model_that_honours_packing_from_one_that_does_not():
    model = _gpt2()
    assert packing_leak(model, vocab_size=100) < 1e-4
    assert packing_leak(model, vocab_size=100, keywords={}) > 1e-3  # the cache a model builds by default
    assert model.training  # mode restored


def test_length_grouped_batches_cover_every_row_once_longest_first_and_reshuffle():
    gen = torch.Generator().manual_seed(1)
    lengths = (torch.distributions.LogNormal(4.5, 0.9).sample((403,)).clamp(16, 1024)).long().tolist()
    sampler = LengthGroupedBatchSampler(lengths, 8, seed=3, chunk=10)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 51
    assert sorted(i for b in batches for i in b) == list(range(403))
    assert max(lengths[i] for i in batches[0]) == max(lengths)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    shuffled = torch.randperm(403, generator=gen).tolist()
    random_spread = sum(max(lengths[i] for i in shuffled[s:s + 8]) - min(lengths[i] for i in shuffled[s:s + 8])
                        for s in range(0, 403, 8))
    assert spread < random_spread / 3
    sampler.set_epoch(1)
    assert list(sampler) != batches
    assert all(len(b) == 8 for b in LengthGroupedBatchSampler(lengths, 8, drop_last=True))
    assert row_lengths([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]) == [3, 1]


def test_packed_batches_fill_the_same_number_of_rows_every_step():
    from torch_tricks.data.token_batches import PackedBatchSampler

    gen = torch.Generator().manual_seed(2)
    lengths = (torch.distributions.LogNormal(4.5, 0.9).sample((300,)).clamp(16, 256)).long().tolist()
    rows = [{"input_ids": torch.zeros(n, dtype=torch.long)} for n in lengths]
    sampler = PackedBatchSampler(lengths, 256, 4, seed=gen.initial_seed())
    n = len(sampler)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(300)) and n == len(batches)
    assert list(sampler) != batches  # the next pass reshuffles
    shapes = [pack_collate(256)([rows[i] for i in b])["input_ids"].shape for b in batches]
    assert all(s == (4, 256) for s in shapes[:-1]) and shapes[-1][0] <= 4
    fill = sum(lengths) / (sum(s[0] for s in shapes) * 256)
    assert fill > 0.85  # lengths 16-256 in rows of 256, in random order
    with pytest.raises(UserError, match="longer than the packed row of 128"):
        PackedBatchSampler(lengths, 128, 4)


@pytest.mark.parametrize("mode,shape", [("padded", (8, 64)), ("grouped", (8, 64)), ("packed", (4, 64)),
                                        ("max", (8, 64))])
def test_tricks_batch_token_rows_as_token_batches_says_and_fit_trains_on_them(mode, shape):
    from torch_tricks import Tricks, fit

    model = _gpt2()
    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 100, (int(n),), generator=gen)}
            for n in torch.randint(3, 60, (40,), generator=gen)]
    tricks = Tricks({"batch_size": 8, "token_batches": mode, "progress": False})
    tricks.prepare(model)
    from torch_tricks.data.token_batches import TokenRowList

    first = next(iter(tricks.prepare_data(TokenRowList(rows))))
    assert first["input_ids"].shape[0] <= shape[0] and first["input_ids"].shape[1] <= shape[1]
    if mode == "max":
        assert first["input_ids"].shape == shape  # every batch padded to the model's 64 positions
    if mode == "packed":
        assert first["use_cache"] is False and "position_ids" in first and "attention_mask" not in first
    history = fit(_gpt2(), rows, config={"batch_size": 8, "max_steps": 2, "token_batches": mode, "progress": False})
    assert history.steps == 2 and torch.isfinite(torch.tensor(history.final["train_loss"]))
    trick = {"padded": "dynamic_padding", "grouped": "length_grouped", "packed": "packing"}.get(mode)
    assert (trick in history.applied) if trick else not {"dynamic_padding", "packing"} & set(history.applied)


def test_a_padded_token_batch_split_on_out_of_memory_keeps_the_per_token_mean():
    """auto_micro_batch halves a batch whose rows hold different numbers of tokens: each half is weighted by its
    tokens (labels that count), so the update equals the whole batch's (a half weighted by its rows would not)."""
    from torch_tricks import fit

    class OOMAbove(nn.Module):
        def __init__(self, inner, limit):
            super().__init__()
            self.inner, self.limit = inner, limit

        def forward(self, input_ids, labels=None, **kw):
            if input_ids.shape[0] > self.limit:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return self.inner(input_ids=input_ids, labels=labels, **kw)

    rows = _rows((3, 30, 4, 28, 5, 31, 2, 25))  # halves of very different token counts
    cfg = {"batch_size": 8, "max_steps": 1, "optimizer": "sgd", "lr": 0.5, "momentum": 0.0, "progress": False,
           "token_batches": "padded", "seed": 0}
    split, whole = OOMAbove(_gpt2(), limit=4), _gpt2()
    h = fit(split, rows, config={**cfg, "auto_micro_batch": True})
    fit(whole, rows, config=cfg)
    assert h.micro_batches == 2 and h.steps == 1
    for p, q in zip(split.inner.parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)


@pytest.mark.parametrize("mode", ["grouped", "packed"])
def test_the_trainer_takes_token_batches_through_the_mapping(tmp_path, mode):
    """tricks.toml's token_batches in a real Trainer: the collator the mapping prints, the sampling strategy it
    sets; each batch seen is the mode's (packed: positions restarting, no mask, no cache), and the loss is finite."""
    transformers = pytest.importorskip("transformers")
    from torch_tricks.data.token_batches import TokenRowList, max_positions, pack_collate
    from torch_tricks.integrations.hf import TricksCallback, training_args_from
    from torch_tricks.integrations.mapping import code_lines, config_of

    cfg = {"token_batches": mode, "batch_size": 4, "max_steps": 3, "progress": False, "device": "cpu"}
    assert "data_collator=" in code_lines(config_of(cfg), "hf")["token_batches"]
    model = _gpt2()
    collate = pad_collate() if mode == "grouped" else pack_collate(max_positions(model),
                                                                   keywords=packing_keywords(model))
    seen = []

    def watched(examples):
        batch = collate(examples)
        seen.append({k: (v.shape if hasattr(v, "shape") else v) for k, v in batch.items()})
        return batch

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], **training_args_from(cfg))
    if mode == "grouped":
        assert getattr(args, "train_sampling_strategy", None) == "group_by_length" or args.group_by_length
    gen = torch.Generator().manual_seed(0)
    rows = TokenRowList([{"input_ids": torch.randint(0, 100, (int(n),), generator=gen)}
                         for n in torch.randint(3, 60, (24,), generator=gen)])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=watched,
                                   callbacks=[TricksCallback(cfg)])
    out = trainer.train()
    assert trainer.state.global_step == 3 and torch.isfinite(torch.tensor(out.training_loss))
    if mode == "packed":
        assert all(s["use_cache"] is False and "attention_mask" not in s and s["input_ids"][1] == 64 for s in seen)
    else:
        assert all("attention_mask" in s and s["input_ids"][1] % 8 == 0 for s in seen)


def test_a_lora_model_gets_the_keywords_that_keep_packed_sequences_apart():
    """peft's forward takes **kwargs: the keywords are its base model's, else GPT-2 under LoRA would build a cache
    and its packed sequences would see each other (0.17 from alone, measured)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    assert packing_keywords(model) == {"use_cache": False}
    assert packing_leak(model, vocab_size=100) < 1e-4
    assert packing_leak(model, vocab_size=100, keywords={}) > 1e-3
