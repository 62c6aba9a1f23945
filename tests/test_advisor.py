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


class _SelfAttention(nn.Module):
    """Separate Q/K/V projections of one input, as BERT and GPT-NeoX-style code write them."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class _Layer(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.attention = _SelfAttention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = self.attention(x)
        return x + self.mlp(x)


def twelve_layer_transformer():
    return nn.Sequential(*[_Layer() for _ in range(12)])


def test_attention_projections_are_a_fused_qkv_opportunity_reported_once_per_layer():
    """Q/K/V of one input: G3 says fuse into one matmul, not re-parameterize, and only at the attention
    block (not again at the layer and the model that contain it)."""
    found = advise(summary(twelve_layer_transformer(), torch.randn(2, 16, 64)))
    g3 = [a for a in found if a.rule == "G3"]
    assert sorted(a.module for a in g3) == sorted(f"{i}.attention" for i in range(12))
    assert all("fused QKV" in a.message and "re-parameteriz" in a.message and "not summed" in a.message
               for a in g3)
    assert all(a.severity == "info" for a in g3)


def test_a_twelve_layer_model_gives_one_advice_line_per_pattern(capsys):
    """`summary` of a 12-layer transformer prints at most one advisor line per pattern (rule, message,
    module names up to their layer index), with the count and the first modules."""
    from torch_tricks.cli import main
    from torch_tricks.inspect.advisor import group_advice

    grouped = group_advice(advise(summary(twelve_layer_transformer(), torch.randn(2, 16, 64))))
    keys = [(a.rule, a.severity, a.module) for a in grouped]
    assert len(keys) == len(set(keys))
    qkv = next(a for a in grouped if a.rule == "G3")
    assert (qkv.module, qkv.count, qkv.modules) == ("*.attention", 12, ["0.attention", "1.attention", "2.attention"])

    assert main(["summary", "--model", "tests.test_advisor:twelve_layer_transformer", "--input", "16x64",
                 "--batch", "2"]) == 0
    out = capsys.readouterr().out
    advice = out[out.index("\nadvice ("):].splitlines()[2:]
    lines = [line for line in advice if line.startswith("  [")]
    assert sum("G3" in line for line in lines) == 1 and "(x12: 0.attention, 1.attention, 2.attention, ...)" in out
    patterns = [line.split("]")[1].split(":")[0].split(" (x")[0].strip() for line in lines]
    assert len(patterns) == len(set(patterns)), lines
