import torch
import torch.nn as nn

from torch_tricks.inspect.advisor import advise
from torch_tricks.inspect.summarize import summary
from torch_tricks.models import get_model
from torch_tricks.models.repvgg import RepVGGBlock
from torch_tricks.models.resnet import BasicBlock


def rules(model, x):
    return {(a.rule, a.module, a.severity) for a in advise(summary(model, x))}


def test_g1_channel_ratio_and_g2_groups():
    m = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 64, 1),
                      nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.Conv2d(64, 64, 1))
    found = rules(m, torch.randn(1, 8, 16, 16))
    assert ("G1", "1", "info") in found
    assert ("G2", "2", "info") in found
    assert not any(r == "G1" and mod in ("0", "3") for r, mod, _ in found)


def test_g3_flags_multibranch_block_not_resnet_block():
    block = RepVGGBlock(16, 16, 1).eval()
    found = rules(nn.Sequential(block), torch.randn(1, 16, 8, 8))
    assert any(r == "G3" and mod == "0" for r, mod, _ in found)
    res = nn.Sequential(BasicBlock(16, 16))
    assert not any(r == "G3" for r, _, _ in rules(res, torch.randn(1, 16, 8, 8)))


def test_t23_dims_not_multiple_of_eight():
    m = nn.Sequential(nn.Linear(3, 30), nn.ReLU(), nn.Linear(30, 32), nn.Linear(32, 10))
    found = rules(m, torch.randn(2, 3))
    assert ("T23", "0", "info") in found  # input features come from the data
    assert ("T23", "1", "warn") not in found  # ReLU has no dims
    assert ("T23", "2", "warn") in found  # in_features=30
    assert ("T23", "3", "info") in found  # 10 classes: the last layer's output
    assert not any(mod == "3" and sev == "warn" for r, mod, sev in found if r == "T23")


def test_g4_elementwise_heavy_model_is_flagged():
    m = nn.Sequential(nn.Linear(8, 8), *[nn.ReLU() for _ in range(6)])
    advice = advise(summary(m, torch.randn(64, 8)))
    assert advice[0].rule == "G4" and advice[0].module == "(model)" and advice[0].severity == "warn"


def test_resnet18_advice_is_quiet_on_design():
    found = rules(get_model("resnet18"), torch.randn(1, 3, 64, 64))
    assert not any(r in ("G3", "T23") and sev == "warn" for r, _, sev in found)
