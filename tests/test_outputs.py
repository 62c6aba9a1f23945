"""Any model output: the prediction and the loss, decided once (torch_tricks.outputs)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.errors import UserError
from torch_tricks.outputs import LOSSES, get_loss, primary_output


class FakeModelOutput(OrderedDict):
    """What transformers' ModelOutput is: an ordered dict whose fields are also attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class DataOut:
    hidden: torch.Tensor
    logits: torch.Tensor


def test_the_prediction_of_every_output_structure():
    logits, hidden = torch.randn(2, 5), torch.randn(2, 3)
    assert primary_output(logits) is logits
    assert primary_output((torch.arange(3), logits)) is logits  # the first floating-point tensor
    assert primary_output({"hidden": hidden, "logits": logits}) is logits  # logits first, wherever it is
    assert primary_output(DataOut(hidden, logits)) is logits
    assert primary_output(FakeModelOutput(loss=torch.tensor(1.0), logits=logits)) is logits  # never the loss
    assert primary_output([{"a": (torch.arange(2), hidden)}]) is hidden  # nested


@pytest.mark.parametrize("out", [torch.arange(3), ("text", 3), {"ids": torch.arange(2)}, None])
def test_no_floating_point_output_is_one_clear_error(out):
    with pytest.raises(UserError, match="no floating-point tensor"):
        primary_output(out)


def test_auto_uses_the_models_own_loss_and_rejects_a_non_scalar_one():
    own = torch.tensor(0.25)
    assert get_loss()(FakeModelOutput(loss=own, logits=torch.randn(2, 3)), None) is not None
    assert float(get_loss("auto")(FakeModelOutput(loss=own, logits=torch.randn(2, 3)), torch.tensor([0, 1]))) == 0.25
    with pytest.raises(UserError, match="not a scalar"):
        get_loss("auto")({"loss": torch.ones(4), "logits": torch.randn(4, 3)}, None)


def test_auto_class_token_and_regression_targets_equal_the_torch_losses():
    auto = get_loss("auto")
    logits, y = torch.randn(4, 7), torch.randint(0, 7, (4,))
    assert torch.allclose(auto({"logits": logits}, y), F.cross_entropy(logits, y))
    tok, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    ids[0, -1] = -100  # ignored, as transformers does
    want = F.cross_entropy(tok.reshape(-1, 11), ids.reshape(-1), ignore_index=-100)
    assert torch.allclose(auto(DataOut(torch.randn(1), tok), ids), want)
    pred, target = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.allclose(auto((pred,), target), F.mse_loss(pred, target))
    assert torch.allclose(get_loss("bce-with-logits")(pred, (target > 0).float()),
                          F.binary_cross_entropy_with_logits(pred, (target > 0).float()))
    assert torch.allclose(get_loss("none")({"logits": pred}, None), pred.mean())


def test_bad_loss_names_and_shapes_are_user_errors():
    with pytest.raises(UserError, match="unknown loss 'hinge'.*auto, ce"):
        get_loss("hinge")
    with pytest.raises(UserError, match="cross-entropy needs class targets"):
        get_loss("ce")(torch.randn(4, 3), torch.randint(0, 3, (5, 2, 2)))
    with pytest.raises(UserError, match="differs from the output's"):
        get_loss("mse")(torch.randn(4, 3), torch.randn(4, 2))
    assert set(LOSSES) == {"auto", "ce", "nll", "mse", "bce-with-logits", "none"}


class DictNet(nn.Module):
    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.as_dict = as_dict
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        logits = self.net(x)
        return FakeModelOutput(hidden=x.mean(), logits=logits) if self.as_dict else logits


def test_fit_trains_a_model_returning_a_model_output_exactly_as_one_returning_logits():
    from torch_tricks.train import fit

    data = [(torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))) for _ in range(4)]
    losses = []
    for as_dict in (False, True):
        torch.manual_seed(0)
        h = fit(DictNet(as_dict), data, data, epochs=2, log_every=1)
        losses.append((h.final["loss"], h.final["acc"]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    def forward(self, ids):
        return FakeModelOutput(logits=self.head(self.emb(ids)))


def test_tune_example_batch_gives_token_models_next_token_targets():
    from torch_tricks.tuning import example_batch

    ids = torch.randint(0, 20, (3, 6))
    (x, target), loss_fn = example_batch(TinyLM(), ids)
    assert torch.equal(target[:, :-1], ids[:, 1:]) and (target[:, -1] == -100).all()
    assert loss_fn(TinyLM()(ids), target).dim() == 0
