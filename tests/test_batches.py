"""One meaning of a batch (torch_tricks/batches.py): pairs, keyword inputs, transformers dicts with labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torch_tricks import batches as B
from torch_tricks.errors import UserError
from torch_tricks.outputs import get_loss
from torch_tricks.train import fit
from torch_tricks.train.loop import TrainStep


class KwNet(nn.Module):
    """Takes keyword inputs and, like a transformers model, ``labels`` for a loss of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)
        self.saw_labels = 0

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids) * (attention_mask.unsqueeze(-1) if attention_mask is not None else 1)
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            self.saw_labels += 1
            out["loss"] = nn.functional.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1))
        return out


def _ids(n=4, t=6, seed=0):
    return torch.randint(0, 20, (n, t), generator=torch.Generator().manual_seed(seed))


def test_every_form_unpacks_to_args_kwargs_and_target():
    x, y = torch.randn(4, 3), torch.arange(4)
    assert B.unpack((x, y)).args == (x,) and B.unpack((x, y)).target is y
    assert B.unpack(((x, x), y)).args == (x, x)
    assert B.unpack({"input": x, "target": y}).args == (x,)
    kw = B.unpack(({"a": x}, y))
    assert kw.kwargs == {"a": x} and kw.target is y
    hf = B.unpack({"input_ids": _ids(), "labels": _ids()})
    assert set(hf.kwargs) == {"input_ids", "labels"} and hf.target is hf.kwargs["labels"]
    assert len(hf.inputs) == 1  # labels are the target, not an input
    with pytest.raises(UserError, match="each batch must be"):
        B.unpack((x, y, y))


def test_split_keeps_the_form_and_counts_samples_or_tokens():
    batch = {"input_ids": _ids(8), "attention_mask": torch.ones(8, 6, dtype=torch.long), "labels": _ids(8)}
    parts = B.split(batch, 4)
    assert len(parts) == 4 and all(set(p) == set(batch) and p["input_ids"].shape == (2, 6) for p in parts)
    torch.testing.assert_close(torch.cat([p["labels"] for p in parts]), batch["labels"])
    assert B.count(batch) == 48 and B.batch_size(batch) == 8
    assert B.count((torch.randn(5, 3), torch.arange(5))) == 5
    assert B.count({"input_ids": _ids(3)}) == 3  # no target: the batch size


def test_labels_go_to_the_forward_only_for_the_models_own_loss():
    model, batch = KwNet(), {"input_ids": _ids(), "labels": _ids(seed=1)}
    out, loss = B.forward(model, batch, get_loss("auto"))
    assert model.saw_labels == 1 and torch.equal(loss, out["loss"])
    out, loss = B.forward(model, batch, get_loss("ce"))  # an explicit loss: labels are the target only
    assert model.saw_labels == 1
    torch.testing.assert_close(loss, nn.functional.cross_entropy(out["logits"].reshape(-1, 20), batch["labels"].reshape(-1)))


def test_fit_and_trainstep_take_transformers_style_dict_batches():
    data = [{"input_ids": _ids(seed=i), "attention_mask": torch.ones(4, 6, dtype=torch.long),
             "labels": _ids(seed=i)} for i in range(4)]
    torch.manual_seed(0)
    h = fit(KwNet(), data, data[:2], epochs=3, lr=0.05, progress=False, log_every=1)
    train = [r["loss"] for r in h.rows if r["split"] == "train"]
    assert train[-1] < train[0] and "loss" in h.final
    step = TrainStep(KwNet(), config={"accumulate": 2, "device": "cpu"})
    loss = step(data[0])
    assert torch.isfinite(loss) and step.model.saw_labels == 2  # two micro-batches, labels passed to each


def test_example_batch_for_keyword_inputs_gives_labels_the_model_shifts_itself():
    model = KwNet()
    ids = _ids()
    batch, loss_fn = B.example_batch(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert isinstance(batch, dict) and torch.equal(batch["labels"], ids)
    batch, _ = B.example_batch(model, {"input_ids": ids}, loss="ce")  # an explicit loss: next-token targets
    (inputs, target) = batch
    assert torch.equal(target[:, :-1], ids[:, 1:]) and (target[:, -1] == -100).all()
    with pytest.raises(UserError, match="needs class logits"):
        B.example_batch(nn.Linear(3, 1), torch.randn(4, 3)[:, None, :].expand(4, 2, 3).contiguous(), loss="ce")


def test_to_device_in_channels_last_walks_every_form_of_batch():
    """``to_channels_last`` lives here (train.speed re-exports it): every 4-D float input of any form, a mapping
    that is not a dict included, is channels_last; the values are the same."""
    from collections import UserDict

    from torch_tricks.train.speed import to_channels_last

    img, ids = torch.randn(2, 3, 8, 8), torch.zeros(2, 1, 8, 8, dtype=torch.long)
    moved = B.to_device((UserDict(pixels=img, ids=ids), torch.arange(2)), torch.device("cpu"), channels_last=True)
    inputs = moved[0]
    assert isinstance(inputs, UserDict) and inputs["pixels"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(inputs["pixels"], img) and inputs["ids"].is_contiguous()  # integer tensors as they are
    assert to_channels_last is B.to_channels_last
