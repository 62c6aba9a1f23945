from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from _deploy_utils import randomize_bn, rel_diff, same_state, state_copy
from torch_tricks.deploy.fuse import count_batchnorm, fuse
from torch_tricks.deploy.reparam import ACBlock, RepVGGBlock, reparameterize_model, reparameterize_with_report
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"stride": 2},
        {"kernel_size": 5, "padding": 2},
        {"padding": 0},  # the 1x3 / 3x1 branches crop instead of padding
        {"kernel_size": 5, "padding": 1, "stride": 2},
        {"groups": 4},
    ],
)
def test_acblock_folds_into_one_conv_exactly(kwargs):
    block = randomize_bn(ACBlock(8, 16, **kwargs)).eval()
    x = torch.randn(2, 8, 13, 11)
    with torch.no_grad():
        ref = block(x)
    before = state_copy(block)

    folded = reparameterize_model(block)

    convs = [m for m in folded.modules() if isinstance(m, nn.Conv2d)]
    assert folded.deployed and len(convs) == 1 and convs[0].bias is not None
    assert count_batchnorm(folded) == 0
    with torch.no_grad():
        out = folded(x)
    assert out.shape == ref.shape and rel_diff(ref, out) <= 1e-4
    assert same_state(block, before) and not block.deployed


def test_acblock_bad_arguments():
    with pytest.raises(UserError):
        ACBlock(4, 4, kernel_size=4)
    with pytest.raises(UserError):
        ACBlock(4, 6, groups=4)


def test_repvgg_model_reparameterized_then_fused():
    model = randomize_bn(get_model("repvgg", num_classes=10, width_mult=0.5)).eval()
    before = state_copy(model)
    x = torch.randn(2, 3, 32, 32)

    folded, rep = reparameterize_with_report(model)

    n_blocks = sum(isinstance(m, RepVGGBlock) for m in model.modules())
    assert len(rep.folded) == n_blocks and set(rep.folded.values()) == {"RepVGGBlock"}
    assert count_batchnorm(folded) == 0
    assert all(m.deployed for m in folded.modules() if isinstance(m, RepVGGBlock))
    with torch.no_grad():
        ref = model(x)
        assert rel_diff(ref, folded(x)) <= 1e-4
        # Fusing afterwards has nothing left to do; the pipeline stays exact.
        with pytest.warns(UserWarning):
            assert rel_diff(ref, fuse(folded)(x)) <= 1e-4
    assert same_state(model, before)
    assert not any(m.deployed for m in model.modules() if isinstance(m, RepVGGBlock))

    _, again = reparameterize_with_report(folded)
    assert again.folded == {} and len(again.already_folded) == n_blocks


def test_walks_a_user_model_of_acblocks():
    model = nn.Sequential(
        ACBlock(3, 8), nn.ReLU(), ACBlock(8, 8, stride=2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )
    model = randomize_bn(model).eval()
    x = torch.randn(3, 3, 16, 16)
    folded = reparameterize_model(model)
    assert [type(m).__name__ for m in folded if isinstance(m, ACBlock)] == ["ACBlock", "ACBlock"]
    with torch.no_grad():
        assert rel_diff(model(x), folded(x)) <= 1e-4


def test_nothing_to_reparameterize_and_other_meanings_of_the_name():
    class VAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 4)

        def reparameterize(self, mu, logvar):  # the VAE trick, not a branch fold
            raise AssertionError("must not be called")

        def forward(self, x):
            return self.enc(x)

    model = VAE()
    before = state_copy(model)
    with pytest.warns(UserWarning, match="nothing folded"):
        out = reparameterize_model(model)
    assert same_state(out, before) and same_state(model, before)
    with pytest.raises(UserError):
        reparameterize_model(None)  # type: ignore[arg-type]


def test_inplace_and_registration():
    model = randomize_bn(ACBlock(4, 4)).eval()
    assert reparameterize_model(model, inplace=True) is model and model.deployed
    t = get_trick("reparameterize")
    assert t.ids == ("I2",) and t.kind == "deploy" and t.fn is reparameterize_model
