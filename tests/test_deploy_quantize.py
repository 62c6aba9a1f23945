"""I3: dynamic / static int8, QAT and half precision produce working models and leave the input alone.

No timing assertions (shared cores); speed is measured outside the tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from torch_tricks.deploy import quantize as q
from torch_tricks.deploy.quantize import (
    PT2EInt8Model,
    cast_half,
    convert_qat,
    quantize_dynamic_int8,
    quantize_qat,
    quantize_static_int8,
)
from torch_tricks.deploy.step_report import agreement, model_size_bytes
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick

SHAPE = (16, 3, 64, 64)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return list(now) == list(before) and all(torch.equal(now[k], v) for k, v in before.items())


@pytest.fixture(scope="module")
def resnet_int8():
    """ResNet-18 quantized once for the module (PT2E export + compile is the slow part)."""
    torch.manual_seed(0)
    model = get_model("resnet18").eval()
    before = _snapshot(model)
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randn(*SHAPE, generator=gen) for _ in range(4)]
    qmodel, rep = quantize_static_int8(model, calib, calib[0])
    return model, before, qmodel, rep, gen


def test_static_int8_resnet18_agrees_and_is_smaller(resnet_int8):
    model, before, qmodel, rep, gen = resnet_int8
    assert _unchanged(model, before) and not model.training
    expected = "pt2e" if q._import_torchao_pt2e() is not None else "fx"
    assert rep.backend == expected, rep.notes
    if expected == "pt2e":
        assert isinstance(qmodel, PT2EInt8Model)
    # same (random normal) distribution as the calibration, fresh samples, same shape
    for _ in range(2):
        a = agreement(model, qmodel, torch.randn(*SHAPE, generator=gen))
        assert a.top1_agreement >= 0.95, a
        assert a.max_rel_diff < 0.1, a
    assert rep.agreement is not None and rep.agreement.top1_agreement >= 0.95
    assert rep.size_ratio >= 3.5, (rep.size_bytes, rep.new_size_bytes)
    assert rep.new_size_bytes == model_size_bytes(qmodel)
    assert rep.to_dict()["backend"] == expected


def test_pt2e_model_refuses_other_shapes_in_one_line(resnet_int8):
    _, _, qmodel, rep, _ = resnet_int8
    if rep.backend != "pt2e":
        pytest.skip("torchao not installed: FX model accepts any shape")
    with pytest.raises(UserError) as exc:
        qmodel(torch.randn(2, 3, 32, 32))
    assert "\n" not in str(exc.value) and "backend='fx'" in str(exc.value)


def test_pt2e_model_recompiles_after_dynamo_reset():
    """A strict torch.export elsewhere resets dynamo; the int8 model must still run (frozen)."""
    if q._import_torchao_pt2e() is None:
        pytest.skip("torchao not installed")
    model = get_model("small_cnn").eval()
    calib = [torch.randn(16, 1, 8, 8) for _ in range(2)]
    qmodel, rep = quantize_static_int8(model, calib, calib[0], backend="pt2e", cpp_wrapper=False)  # faster compile
    x = torch.randn(16, 1, 8, 8)
    before = qmodel(x)
    torch._dynamo.reset()
    torch.testing.assert_close(qmodel(x), before)
    assert qmodel(torch.randn(3, 1, 8, 8)).shape == (3, 10)  # another batch size: compiles once more


def test_static_fx_backend_and_fallback_when_torchao_missing(monkeypatch):
    model = get_model("small_cnn").eval()
    before = _snapshot(model)
    calib = [torch.randn(32, 1, 8, 8) for _ in range(3)]
    qfx, rep = quantize_static_int8(model, calib, calib[0], backend="fx")
    assert rep.backend == "fx" and rep.quantized.get("ConvReLU2d", 0) >= 3
    assert qfx(torch.randn(5, 1, 8, 8)).shape == (5, 10)  # any batch size
    assert rep.agreement.max_rel_diff < 0.1
    # auto falls back to FX, and says why, when torchao cannot be imported
    monkeypatch.setattr(q, "_import_torchao_pt2e", lambda: None)
    _, rep2 = quantize_static_int8(model, [(x, torch.zeros(32)) for x in calib], calib[0])  # (x, y) pairs
    assert rep2.backend == "fx" and any("torchao is not installed" in n for n in rep2.notes)
    with pytest.raises(UserError, match="pip install"):
        quantize_static_int8(model, calib, calib[0], backend="pt2e")
    assert _unchanged(model, before)


class _DataDependent(nn.Module):
    """Python control flow on a tensor value: neither torch.export nor torch.fx can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if float(x.sum()) > 0 else self.b(x)


def test_static_int8_on_untraceable_model_explains_in_one_line():
    model = _DataDependent().eval()
    before = _snapshot(model)
    with pytest.raises(UserError) as exc:
        quantize_static_int8(model, [torch.randn(8, 4)], torch.randn(8, 4))
    msg = str(exc.value)
    assert "\n" not in msg and "cannot apply" in msg and "torch.fx" in msg
    assert _unchanged(model, before)


def test_dynamic_int8_builtin_transformer_runs_without_fastpath_crash():
    model = get_model("transformer").eval()
    before = _snapshot(model)
    x = torch.randint(0, 1000, (16, 32))
    qmodel, rep = quantize_dynamic_int8(model)
    with torch.inference_mode():
        out = qmodel(x)  # the fused fast path would crash here (pytorch#109987)
    assert out.shape == (16, 2)
    a = agreement(model, qmodel, x)
    assert a.max_rel_diff < 0.1 and a.top1_agreement >= 0.9, a
    assert not any(isinstance(m, nn.TransformerEncoderLayer) for m in qmodel.modules())
    assert rep.quantized["Linear"] == 4 * 4 + 1  # in_proj, out_proj, linear1, linear2 per layer + head
    assert rep.size_ratio > 2 and rep.backend == "torch.ao dynamic"
    assert _unchanged(model, before)
    assert any(isinstance(m, nn.TransformerEncoderLayer) for m in model.modules())


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_rewrite_matches_pytorch_with_masks(norm_first):
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True, norm_first=norm_first)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    ref = copy.deepcopy(enc)
    assert q._rewrite_encoder_layers(enc) == 2
    x = torch.randn(3, 7, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(7)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:] = True
    with torch.inference_mode():
        torch.testing.assert_close(enc(x), ref(x), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(enc(x, mask=causal), ref(x, mask=causal), atol=1e-5, rtol=1e-4)
        got, want = enc(x, src_key_padding_mask=pad), ref(x, src_key_padding_mask=pad)
    keep = ~pad
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-4)


def test_dynamic_int8_lstm_and_nothing_to_quantize():
    model = get_model("lstm").eval()
    qmodel, rep = quantize_dynamic_int8(model)
    x = torch.randint(0, 1000, (4, 16))
    assert agreement(model, qmodel, x).max_rel_diff < 0.1
    assert "LSTM" in rep.quantized and rep.size_ratio > 3
    conv_only = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())
    with pytest.raises(UserError, match="quantize_static_int8"):
        quantize_dynamic_int8(conv_only)


def test_qat_fine_tunes_and_converts_on_digits():
    pytest.importorskip("sklearn")
    from torch_tricks.data.digits import load_dataset
    from torch_tricks.train.config import TrainConfig
    from torch_tricks.train.loop import fit

    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model on shared cores: a second thread only spins
    try:
        train, val = load_dataset("digits")
        model = get_model("small_cnn")
        before = _snapshot(model)
        example = train.tensors[0][:8]
        prepared, rep = quantize_qat(model, example)
        assert rep.quantized["fake-quant modules"] > 0 and _unchanged(model, before)
        hist = fit(prepared, train, val, config=TrainConfig(epochs=4, batch_size=64, lr=3e-3, progress=False, device="cpu"))
        assert hist.final["acc"] >= 0.9, hist.final
        int8, crep = convert_qat(prepared, val.tensors[0][:64])
        assert crep.agreement.top1_agreement >= 0.95, crep.agreement
        with torch.inference_mode():
            acc = (int8(val.tensors[0]).argmax(1) == val.tensors[1]).float().mean().item()
        assert acc >= 0.9
        assert crep.new_size_bytes < model_size_bytes(model)
    finally:
        torch.set_num_threads(prev)
    with pytest.raises(UserError, match="quantize_qat"):
        convert_qat(get_model("small_cnn"))


def test_half_precision_refuses_cpu_fp16_and_casts_bf16():
    model = get_model("small_cnn").eval()
    before = _snapshot(model)
    if not q._cpu_flag("_is_amx_fp16_supported"):
        with pytest.raises(UserError) as exc:
            cast_half(model, torch.float16, "cpu")
        assert "\n" not in str(exc.value) and "bfloat16" in str(exc.value)
    bf, rep = cast_half(model, torch.bfloat16, "cpu")
    x = torch.randn(32, 1, 8, 8)
    with torch.inference_mode():
        out = bf(x)
    assert out.dtype == torch.float32
    assert next(bf.parameters()).dtype == torch.bfloat16
    a = agreement(model, bf, x)
    assert a.max_rel_diff < 0.05 and a.top1_agreement >= 0.9, a
    assert rep.size_ratio > 1.9 and any("bf16 on CPU" in n for n in rep.notes)
    assert _unchanged(model, before) and next(model.parameters()).dtype == torch.float32


def test_quantize_tricks_registered():
    for name in ("int8_dynamic", "int8_static", "qat", "half_precision_inference"):
        trick = get_trick(name)
        assert trick.ids == ("I3",) and trick.kind == "deploy"
    ok, why = get_trick("int8_static").check("cuda")
    assert not ok and "CPU" in why
