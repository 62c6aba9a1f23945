from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _deploy_utils import same_state, state_copy
from torch_tricks.deploy.prune import (
    prune_channels,
    prune_channels_with_report,
    prune_unstructured,
    prune_unstructured_with_report,
)
from torch_tricks.errors import UserError
from torch_tricks.inspect.summarize import summary
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick


def _macs(model, x):
    return summary(model, x, depth=0).totals["macs"]


def _params(model):
    return sum(p.numel() for p in model.parameters())


# -- unstructured -------------------------------------------------------------------------------

def test_unstructured_global_sparsity_and_input_untouched():
    model = get_model("small_cnn")
    before = state_copy(model)
    pruned, rep = prune_unstructured_with_report(model, 0.6)
    weights = [m.weight for m in pruned.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert rep.sparsity == pytest.approx(0.6, abs=0.01) and zeros == pytest.approx(rep.sparsity)
    assert "no speed-up" in rep.notes[0]
    assert set(pruned.state_dict()) == set(before)  # permanent: no masks left
    assert same_state(model, before)
    pruned(torch.randn(2, 1, 8, 8))


def test_unstructured_per_layer_with_masks():
    model = get_model("mlp")
    pruned = prune_unstructured(model, 0.3, global_=False, make_permanent=False)
    layers = [m for m in pruned.modules() if isinstance(m, nn.Linear)]
    assert all(hasattr(m, "weight_mask") for m in layers)
    for m in layers:
        assert float((m.weight == 0).float().mean()) == pytest.approx(0.3, abs=0.01)
    with pytest.raises(UserError):
        prune_unstructured(model, 1.0)


# -- structured -----------------------------------------------------------------------------------

def test_resnet18_half_the_macs_runs_and_input_untouched():
    model = get_model("resnet18", num_classes=10)
    before = state_copy(model)
    x = torch.randn(1, 3, 32, 32)

    pruned, rep = prune_channels_with_report(model, x, target_macs=0.5)

    macs = _macs(pruned, x)
    assert macs == rep.macs_after and rep.macs_before == _macs(model, x)
    assert 0.4 <= rep.mac_ratio <= 0.6
    assert _params(pruned) < 0.65 * _params(model)
    assert any(g["residual"] and "conv1" in g["layers"] for g in rep.groups)  # stem + layer1 adds, one group
    assert rep.skipped == []
    assert pruned(torch.randn(3, 3, 32, 32)).shape == (3, 10)
    assert same_state(model, before)
    # The residual adds kept the same channels: each block's output width is the shortcut's.
    for blk in [pruned.layer1[0], pruned.layer1[1]]:
        assert blk.bn2.num_features == pruned.bn1.num_features


def test_amount_means_share_of_channels():
    model = get_model("small_cnn")
    x = torch.randn(2, 1, 8, 8)
    pruned, rep = prune_channels_with_report(model, x, amount=0.5)
    assert [b[0].out_channels for b in pruned.features] == [16, 32, 32]
    assert pruned.fc.in_features == 32
    assert rep.mac_ratio < 0.3  # half the channels on both sides of most convs
    loss = pruned(x).sum()  # still trainable
    loss.backward()
    assert pruned.features[1][0].weight.grad.shape == pruned.features[1][0].weight.shape


def test_resnet50_bottleneck_and_downsample_groups():
    model = get_model("resnet50", num_classes=10)
    x = torch.randn(1, 3, 32, 32)
    pruned, rep = prune_channels_with_report(model, x, target_macs=0.5)
    assert 0.4 <= rep.mac_ratio <= 0.6
    group = next(g for g in rep.groups if "layer2.0.downsample.0" in g["layers"])
    assert {"layer2.0.conv3", "layer2.1.conv3"} <= set(group["layers"])
    assert pruned.layer2[0].downsample[0].out_channels == pruned.layer2[0].conv3.out_channels == group["kept"]
    with torch.no_grad():
        assert pruned.eval()(x).shape == (1, 10)


def test_mobilenet_v2_depthwise_follow_their_input():
    model = get_model("mobilenet_v2", num_classes=10)
    x = torch.randn(1, 3, 32, 32)
    pruned, rep = prune_channels_with_report(model, x, target_macs=0.5)
    assert 0.4 <= rep.mac_ratio <= 0.6
    dws = [m for m in pruned.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert dws and all(m.groups == m.in_channels == m.out_channels for m in dws)
    assert any(m.groups < 96 for m in dws)  # they did shrink
    with torch.no_grad():
        assert pruned.eval()(x).shape == (1, 10)


class _Mixed(nn.Module):
    """Grouped conv, PReLU per channel, cat, depthwise, flatten of a 2x2 map into a linear,
    and a head conv whose output is the model output (must not be pruned)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.act = nn.PReLU(32)
        self.g = nn.Conv2d(32, 64, 3, padding=1, groups=4)
        self.side = nn.Conv2d(32, 16, 1)
        self.c4 = nn.Conv2d(80, 48, 3, padding=1, stride=2)
        self.dw = nn.Conv2d(48, 48, 3, padding=1, groups=48)
        self.fc = nn.Linear(48 * 2 * 2, 10)
        self.head = nn.Conv2d(48, 5, 1)

    def forward(self, x):
        y = self.act(self.bn1(self.c1(x)))
        z = torch.cat([F.relu(self.g(y)), F.max_pool2d(self.side(y), 1)], dim=1)
        z = F.hardswish(self.dw(self.c4(z)))
        p = F.adaptive_avg_pool2d(z, 2)
        return self.fc(p.view(p.size(0), -1)), self.head(z)


def test_grouped_cat_flatten_and_frozen_outputs():
    model = _Mixed()
    x = torch.randn(2, 3, 16, 16)
    pruned, rep = prune_channels_with_report(model, x, amount=0.5, round_to=1)
    kept = {g["layers"][0]: g["kept"] for g in rep.groups}
    assert kept == {"c1": 16, "g": 32, "side": 8, "c4": 24}
    assert pruned.g.groups == 4 and pruned.g.in_channels == 16 and pruned.g.weight.shape == (32, 4, 3, 3)
    assert pruned.act.num_parameters == 16 and pruned.c4.in_channels == 40
    assert pruned.dw.groups == pruned.dw.in_channels == 24 and pruned.fc.in_features == 24 * 4
    assert pruned.head.in_channels == 24 and pruned.head.out_channels == 5
    assert rep.skipped == [{"layers": ["head"], "reason": "reaches the model output"}]
    out, head = pruned(x)
    assert out.shape == (2, 10) and head.shape == (2, 5, 8, 8)
    assert _macs(pruned, x) == rep.macs_after


def test_cannot_apply_explains_and_leaves_the_model():
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 8, 3)
            self.d = nn.Conv2d(8, 8, 3)

        def forward(self, x):
            y = self.c(x)
            return self.d(y) if y.sum() > 0 else self.d(-y)

    model = Gated()
    before = state_copy(model)
    with pytest.raises(UserError, match="torch.fx can trace"):
        prune_channels(model, torch.randn(1, 3, 8, 8))
    assert same_state(model, before)
    with pytest.raises(UserError, match="no conv channels can be pruned"):
        prune_channels(nn.Sequential(nn.Conv2d(3, 4, 3)), torch.randn(1, 3, 8, 8))
    with pytest.raises(UserError, match="not both"):
        prune_channels(get_model("small_cnn"), torch.randn(1, 1, 8, 8), 0.5, target_macs=0.5)
    with pytest.raises(UserError):
        prune_channels(get_model("small_cnn"), torch.randn(1, 1, 8, 8), 1.5)


def test_registered():
    assert get_trick("prune_channels").ids == ("I5",)
    assert get_trick("prune_unstructured").ids == ("I5",)
    assert get_trick("prune_channels").fn is prune_channels
