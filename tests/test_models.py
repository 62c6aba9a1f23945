"""The built-in reference models: they build, run on their default input, and match
the published layouts (torchvision parameter counts, RepVGG's exact re-parameterization)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.models import get_model, list_models, load_model, model_spec
from torch_tricks.models.repvgg import RepVGG, RepVGGBlock, reparameterize_model

EXPECTED = {
    "lstm",
    "mlp",
    "mobilenet_v2",
    "repvgg",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet9",
    "small_cnn",
    "transformer",
}

# Published torchvision counts (ImageNet heads).
TORCHVISION_PARAMS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "mobilenet_v2": 3_504_872,
}


def make_input(spec: str, batch: int = 2) -> list[torch.Tensor]:
    """A minimal reader of the CLI input syntax, enough for the registry's defaults."""
    tensors = []
    for part in spec.split(","):
        if part.startswith("long:"):
            _, shape, high = part.split(":")
            dims = tuple(int(d) for d in shape.split("x"))
            tensors.append(torch.randint(0, int(high), (batch, *dims)))
        else:
            dims = tuple(int(d) for d in part.split("x"))
            tensors.append(torch.randn(batch, *dims))
    return tensors


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_lists_all_models():
    assert set(list_models()) == EXPECTED
    assert list_models() == sorted(list_models())
    assert "resnet50" in list_models("vision")
    assert "resnet50" not in list_models("text")
    assert set(list_models("text")) == {"lstm", "transformer"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_forward_default_input(name):
    torch.manual_seed(0)
    spec = model_spec(name)
    model = get_model(name).eval()
    with torch.no_grad():
        out = model(*make_input(spec.default_input))
    num_classes = model.num_classes
    assert out.shape == (2, num_classes)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert spec.description
    assert spec.tags


@pytest.mark.parametrize("name", ["resnet18", "mlp", "small_cnn", "transformer", "lstm", "repvgg"])
def test_num_classes_kwarg(name):
    model = get_model(name, num_classes=7).eval()
    with torch.no_grad():
        out = model(*make_input(model_spec(name).default_input))
    assert out.shape == (2, 7)


@pytest.mark.parametrize("name,count", sorted(TORCHVISION_PARAMS.items()))
def test_torchvision_parameter_counts(name, count):
    assert n_params(get_model(name)) == count


def test_resnet_torchvision_layout():
    keys = set(get_model("resnet50").state_dict())
    for k in (
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.conv3.weight",
        "layer1.0.bn3.bias",
        "layer2.0.downsample.0.weight",
        "layer2.0.downsample.1.running_mean",
        "layer4.2.bn3.weight",
        "fc.weight",
        "fc.bias",
    ):
        assert k in keys, k
    keys18 = set(get_model("resnet18").state_dict())
    assert "layer1.1.bn2.weight" in keys18 and "layer1.0.conv3.weight" not in keys18
    assert "layer1.0.downsample.0.weight" not in keys18


def test_resnet_zero_init_residual():
    model = get_model("resnet18", zero_init_residual=True)
    assert all(torch.count_nonzero(b.bn2.weight) == 0 for b in model.layer1)
    assert bool((model.bn1.weight == 1).all())


def test_mobilenet_width_mult():
    small = get_model("mobilenet_v2", width_mult=0.5)
    assert n_params(small) < TORCHVISION_PARAMS["mobilenet_v2"]
    assert "features.1.conv.0.0.weight" in small.state_dict()
    assert "classifier.1.weight" in small.state_dict()


def test_resnet9_scale():
    torch.manual_seed(0)
    scaled = get_model("resnet9").eval()
    plain = get_model("resnet9", scale=None).eval()
    plain.load_state_dict(scaled.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(scaled(x), plain(x) * 0.125)


def _randomize_bn(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(c, generator=gen) * 0.1)


def test_repvgg_block_reparameterize():
    torch.manual_seed(0)
    for in_ch, out_ch, stride in [(8, 8, 1), (8, 16, 2), (8, 16, 1), (8, 8, 2)]:
        block = RepVGGBlock(in_ch, out_ch, stride)
        _randomize_bn(block)
        block.eval()
        x = torch.randn(2, in_ch, 9, 9)
        with torch.no_grad():
            before = block(x)
            assert not block.deployed
            block.reparameterize()
            assert block.deployed
            after = block(x)
        assert not any(isinstance(m, nn.BatchNorm2d) for m in block.modules())
        assert isinstance(block.rbr_reparam, nn.Conv2d) and block.rbr_reparam.bias is not None
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
        block.reparameterize()  # idempotent
        assert block.deployed


def test_repvgg_model_reparameterize():
    torch.manual_seed(0)
    # A narrow RepVGG keeps the test quick; the registered one is checked at 64x64 below.
    tiny = RepVGG(widths=(8, 8, 16, 16, 32), depths=(2, 2, 2, 1), num_classes=5)
    models = [tiny, get_model("repvgg")]
    for model, size in zip(models, (32, 64)):
        _randomize_bn(model)
        model.eval()
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            before = model(x)
            assert reparameterize_model(model) is model
            after = model(x)
        blocks = [m for m in model.modules() if isinstance(m, RepVGGBlock)]
        assert blocks and all(b.deployed for b in blocks)
        assert not any(isinstance(m, nn.BatchNorm2d) for b in blocks for m in b.modules())
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)


def test_repvgg_deploy_kwarg():
    model = get_model("repvgg", deploy=True, width_mult=0.25, num_classes=3).eval()
    assert all(m.deployed for m in model.modules() if isinstance(m, RepVGGBlock))
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


def test_text_models_store_vocab_size():
    assert get_model("transformer").vocab_size == 1000
    assert get_model("lstm", vocab_size=50).vocab_size == 50


def test_transformer_rejects_too_long_input():
    model = get_model("transformer", max_len=16).eval()
    with pytest.raises(UserError, match="max_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_lstm_mean_pooling():
    model = get_model("lstm", pooling="mean").eval()
    with torch.no_grad():
        assert model(torch.randint(0, 1000, (2, 8))).shape == (2, 2)


def test_mlp_kwargs():
    model = get_model("mlp", in_features=20, hidden=16, depth=3, num_classes=4)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 4
    assert model(torch.randn(2, 4, 5)).shape == (2, 4)


def test_small_cnn_trains():
    # A learnable toy problem: the class is which quadrant holds the bright blob.
    torch.manual_seed(0)
    x = torch.rand(256, 1, 8, 8) * 0.3
    y = torch.randint(0, 4, (256,))
    for i, q in enumerate(y.tolist()):
        r, c = divmod(q, 2)
        x[i, 0, r * 4 : r * 4 + 4, c * 4 : c * 4 + 4] += 1.0
    model = get_model("small_cnn", num_classes=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert acc > 0.95


def test_get_model_unknown_lists_choices():
    with pytest.raises(UserError) as info:
        get_model("nope")
    msg = str(info.value)
    assert "nope" in msg
    for name in EXPECTED:
        assert name in msg


def test_load_model_reference():
    model, default_input = load_model("torch_tricks.models.mlp:mlp")
    assert isinstance(model, nn.Module)
    assert model(torch.randn(2, 784)).shape == (2, 10)
    model, default_input = load_model("resnet9")
    assert default_input == "3x32x32"


def test_load_model_bad_reference():
    with pytest.raises(UserError):
        load_model("no_such_pkg.x:f")
    with pytest.raises(UserError):
        load_model("torch_tricks.models.mlp:no_such_factory")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fx_traceable(name):
    # The inspector's graph-level tools rely on torch.fx; keep every built-in traceable.
    torch.fx.symbolic_trace(get_model(name))
