from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from _deploy_utils import randomize_bn, rel_diff, same_state, state_copy
from torch_tricks.deploy.fuse import count_batchnorm, fuse, fuse_with_report
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick


@pytest.mark.parametrize(
    "name,shape",
    [
        ("resnet18", (2, 3, 64, 64)),
        ("resnet50", (2, 3, 64, 64)),
        ("mobilenet_v2", (2, 3, 64, 64)),
        ("resnet9", (2, 3, 32, 32)),
        ("small_cnn", (4, 1, 8, 8)),
    ],
)
def test_fused_model_matches_eval_original_and_has_no_batchnorm(name, shape):
    model = randomize_bn(get_model(name)).eval()
    before = state_copy(model)
    n_bn = count_batchnorm(model)
    x = torch.randn(shape)

    fused, rep = fuse_with_report(model)

    assert rep.method == "fx"
    assert len(rep.fused) == n_bn and rep.kept_batchnorm == []
    assert count_batchnorm(fused) == 0
    assert type(fused) is type(model)  # a copy of the model, not a GraphModule
    assert not fused.training
    with torch.no_grad():
        assert rel_diff(model(x), fused(x)) <= 1e-4
    assert same_state(model, before) and count_batchnorm(model) == n_bn


def test_fuse_sees_a_wrong_fold():
    """The comparison above can fail: skipping the BN shift would be caught."""
    model = randomize_bn(get_model("small_cnn")).eval()
    fused = fuse(model)
    fused.features[0][0].bias.data.zero_()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert rel_diff(model(x), fused(x)) > 1e-3


class _Gated(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 6 * 6, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.post = nn.BatchNorm2d(8)  # not after a conv inside a Sequential: stays

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.post(self.body(x))
        if y.sum() > 0:
            y = -y
        return self.head(y)


def test_untraceable_model_falls_back_to_sequential_pairs():
    model = randomize_bn(_Gated()).eval()
    before = state_copy(model)

    fused, rep = fuse_with_report(model)

    assert rep.method == "eager"
    assert "could not trace" in rep.notes[0]
    assert sorted(rep.fused) == [("body.0", "body.1"), ("body.3", "body.4"), ("head.1", "head.2")]
    assert count_batchnorm(fused) == 1 and any(k.startswith("post") for k in rep.kept_batchnorm)
    for sign in (1.0, -1.0):  # both branches of the control flow
        x = sign * torch.rand(3, 3, 6, 6)
        with torch.no_grad():
            assert rel_diff(model(x), fused(x)) <= 1e-4
    assert same_state(model, before)


def test_builtin_resnet_blocks_are_folded_by_the_fallback():
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = get_model("resnet18", num_classes=10)

        def forward(self, x):
            return self.net(x) if x.mean() > 0 else self.net(-x)

    model = randomize_bn(Wrapper()).eval()
    fused, rep = fuse_with_report(model)
    assert rep.method == "eager"
    assert count_batchnorm(fused) == 0  # blocks, stem and downsample Sequentials
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        assert rel_diff(model(x), fused(x)) <= 1e-4


def test_nothing_to_fuse_returns_the_model_unchanged_with_a_note():
    model = get_model("mlp")
    before = state_copy(model)
    with pytest.warns(UserWarning, match="nothing folded"):
        out = fuse(model)
    _, rep = fuse_with_report(model)
    assert rep.fused == [] and "no BatchNorm" in rep.notes[0]
    assert same_state(out, before) and same_state(model, before)


def test_pairs_that_are_not_safe_stay():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.bn_first = nn.BatchNorm2d(3)
            self.conv2 = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y + self.conv2(self.bn_first(x))  # conv output used twice; BN before conv

    model = randomize_bn(M()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused, rep = fuse_with_report(model)
    assert rep.fused == []
    assert len(rep.kept_batchnorm) == 2 and "other users" in " ".join(rep.kept_batchnorm)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(x), fused(x))


def test_linear_bn_and_modes():
    model = randomize_bn(nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2)))
    model.train()
    fused = fuse(model, example_inputs=torch.randn(3, 6))
    assert model.training and not fused.training  # the input keeps its mode
    assert count_batchnorm(fused) == 0
    x = torch.randn(4, 6)
    model.eval()
    with torch.no_grad():
        assert rel_diff(model(x), fused(x)) <= 1e-4

    # A 3-D (N, C, L) linear output: BatchNorm1d normalises dim 1, not the features.
    seq = randomize_bn(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, rep = fuse_with_report(seq, example_inputs=torch.randn(2, 4, 4))
    assert rep.fused == [] and "not (N, features)" in rep.kept_batchnorm[0]


def test_inplace_and_errors():
    model = randomize_bn(get_model("small_cnn")).eval()
    out = fuse(model, inplace=True)
    assert out is model and count_batchnorm(model) == 0
    with pytest.raises(UserError):
        fuse("resnet18")  # type: ignore[arg-type]
    t = get_trick("fuse_conv_bn")
    assert t.ids == ("I1",) and t.kind == "deploy" and t.fn is fuse
