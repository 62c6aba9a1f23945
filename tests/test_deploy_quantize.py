"""I3: dynamic / static int8, QAT and half precision produce working models and leave the input alone.

No timing assertions (shared cores); speed is measured outside the tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from torch_tricks.deploy import quantize as q
from torch_tricks.deploy.cpu_int8 import int8_setting
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


def _activation_qmax(qmodel: PT2EInt8Model) -> set[int]:
    """The quant_max of every activation quantize op in the converted PT2E graph: what the
    int8 kernels really get (127 with reduce_range, 255 without)."""
    return {int(n.args[4]) for n in qmodel.quantized.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("quantized_decomposed.quantize_per_tensor")}


def test_static_int8_resnet18_agrees_and_is_smaller(resnet_int8):
    model, before, qmodel, rep, gen = resnet_int8
    assert _unchanged(model, before) and not model.training
    expected = "pt2e" if q._import_torchao_pt2e() is not None else "fx"
    assert rep.backend == expected, rep.notes
    if expected == "pt2e":
        assert isinstance(qmodel, PT2EInt8Model)
        # the range chosen for this CPU (and its env caps) is the one in the graph, and is reported
        auto = int8_setting("torch")
        assert rep.int8_setting == auto.to_dict() and not auto.forced
        assert _activation_qmax(qmodel) == {127 if auto.reduce_range else 255}
        assert any(n.startswith("int8 setting: ") and auto.reason in n for n in rep.notes)
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


# (flags in /proc/cpuinfo, ATen capability, env): the CPUs the int8 range decision must tell apart
_SPR = {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8"}  # Sapphire Rapids (AMX)
_CASCADE = {"avx2", "avx512f", "avx512_vnni"}  # AVX-512 VNNI, no AVX-VNNI
_CPUS = {
    "amx": (_SPR, "AVX512", {}),
    "avx512-vnni": (_CASCADE, "AVX512", {}),
    "alder-lake avx-vnni": ({"avx2", "avx_vnni"}, "AVX2", {}),
    "avx2-only": ({"avx2", "fma"}, "AVX2", {}),
    "avx512 no vnni": ({"avx2", "avx512f", "avx512bw"}, "AVX512", {}),
    "sse4.1 only": ({"sse4_1"}, "DEFAULT", {}),
    "amx, ONEDNN_MAX_CPU_ISA=AVX2": (_SPR, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
    "amx, DNNL_MAX_CPU_ISA=avx512_core": (_SPR, "AVX512", {"DNNL_MAX_CPU_ISA": "avx512_core"}),
    "amx, ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI": (_SPR, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}),
    "avx512-vnni, ATen capability AVX2": (_CASCADE, "AVX2", {}),
    "emulated avx2 (both caps)": (_SPR, "AVX2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
}


@pytest.mark.parametrize(
    "cpu, ort_vnni, torch_vnni, why",
    [
        ("amx", True, True, "amx_int8"),
        ("avx512-vnni", True, True, "avx512_vnni"),
        ("alder-lake avx-vnni", True, True, "avx_vnni"),
        ("avx2-only", False, False, "no VNNI in the CPU flags (avx2)"),
        ("avx512 no vnni", False, False, "no VNNI in the CPU flags (avx2, avx512f)"),
        ("sse4.1 only", False, False, "no VNNI"),
        # ONNX Runtime's MLAS reads cpuid and ignores the caps; oneDNN / inductor honour them
        ("amx, ONEDNN_MAX_CPU_ISA=AVX2", True, False, "ONEDNN_MAX_CPU_ISA=AVX2"),
        ("amx, DNNL_MAX_CPU_ISA=avx512_core", True, False, "DNNL_MAX_CPU_ISA=avx512_core"),
        ("amx, ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI", True, True, "avx512_vnni"),
        ("avx512-vnni, ATen capability AVX2", True, False, "ATen's capability AVX2"),
        ("emulated avx2 (both caps)", True, False, "ONEDNN_MAX_CPU_ISA=AVX2"),
    ],
)
def test_int8_setting_is_the_saturation_free_one_exactly_where_the_kernels_have_no_vnni(cpu, ort_vnni, torch_vnni, why):
    flags, capability, env = _CPUS[cpu]
    ort = int8_setting("onnxruntime", flags=flags, capability=capability, env=env, machine="x86_64")
    pt = int8_setting("torch", flags=flags, capability=capability, env=env, machine="x86_64")
    assert (ort.for_vnni, pt.for_vnni) == (ort.vnni, pt.vnni) == (ort_vnni, torch_vnni)
    # torch: 7-bit activations without VNNI; ONNX Runtime: u8 weights (U8U8 kernels) without VNNI
    assert pt.reduce_range is not torch_vnni and pt.weight_type == "int8" and pt.activation_type == "uint8"
    assert not ort.reduce_range and ort.weight_type == ("int8" if ort_vnni else "uint8")
    for s in (ort, pt):
        assert not s.forced and s.reason and "\n" not in s.reason
        assert ("saturate" in s.reason) is not s.for_vnni  # the reason says what is at stake
    assert why in pt.reason, pt.reason
    # ONNX Runtime static int8 takes u8 weights everywhere (more exact, never saturates), and says why
    static = int8_setting("onnxruntime-static", flags=flags, capability=capability, env=env, machine="x86_64")
    assert static.weight_type == "uint8" and not static.for_vnni and "every CPU" in static.reason
    # off x86 nothing saturates (ARM's kernels widen before they add)
    arm = int8_setting("torch", flags=set(), capability="DEFAULT", env={}, machine="aarch64")
    assert arm.for_vnni and not arm.reduce_range and arm.vnni is None and "not x86" in arm.reason


def test_int8_setting_can_be_forced_and_says_what_auto_would_pick():
    for runtime in ("onnxruntime", "torch"):
        vnni = int8_setting(runtime, True, flags={"avx2"}, capability="AVX2", env={}, machine="x86_64")
        assert vnni.for_vnni and vnni.forced and vnni.vnni is False and vnni.weight_type == "int8"
        assert not vnni.reduce_range
        assert vnni.reason.startswith("forced by the caller (auto would pick the no-VNNI setting")
        safe = int8_setting(runtime, False, flags=_SPR, capability="AVX512", env={}, machine="x86_64")
        assert not safe.for_vnni and safe.forced and "auto would pick the VNNI setting" in safe.reason
        assert safe.to_dict()["forced"] is True and safe.reason in safe.describe()
    with pytest.raises(ValueError):
        int8_setting("tensorrt")


def test_pt2e_forced_reduced_range_reaches_the_graph_and_the_report():
    """Forcing the no-VNNI setting on any CPU: the activations of the compiled graph are
    quantized to 0..127 (the int8 kernels' input), and the report and notes say so."""
    if q._import_torchao_pt2e() is None:
        pytest.skip("torchao not installed")
    model = get_model("small_cnn").eval()
    gen = torch.Generator().manual_seed(2)
    calib = [torch.randn(32, 1, 8, 8, generator=gen) for _ in range(2)]
    qmodel, rep = quantize_static_int8(model, calib, calib[0], backend="pt2e", cpp_wrapper=False, reduce_range=True)
    assert _activation_qmax(qmodel) == {127}
    s = rep.int8_setting
    assert s["reduce_range"] is True and s["forced"] and s["runtime"] == "torch"
    assert any(n.startswith("int8 setting: reduce_range=True") and "forced" in n for n in rep.notes)
    assert agreement(model, qmodel, torch.randn(64, 1, 8, 8, generator=gen)).max_rel_diff < 0.1
    with pytest.raises(UserError) as exc:
        quantize_static_int8(model, calib, calib[0], reduce_range="yes")
    assert "\n" not in str(exc.value) and "reduce_range" in str(exc.value)


def test_static_fx_backend_and_fallback_when_torchao_missing(monkeypatch):
    model = get_model("small_cnn").eval()
    before = _snapshot(model)
    calib = [torch.randn(32, 1, 8, 8) for _ in range(3)]
    qfx, rep = quantize_static_int8(model, calib, calib[0], backend="fx")
    assert rep.backend == "fx" and rep.quantized.get("ConvReLU2d", 0) >= 3
    assert qfx(torch.randn(5, 1, 8, 8)).shape == (5, 10)  # any batch size
    assert rep.agreement.max_rel_diff < 0.1
    # FX's x86 qconfig reduces the activation range on every CPU: read from the qconfig, reported
    assert rep.int8_setting["reduce_range"] is True and not rep.int8_setting["forced"]
    assert any("reduce_range=True" in n and "every CPU" in n for n in rep.notes)
    with pytest.raises(UserError, match="full range is PT2E's"):
        quantize_static_int8(model, calib, calib[0], backend="fx", reduce_range=False)
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
    # torch.ao's dynamic kernels always quantize activations to 7 bits: saturation-free anywhere
    assert rep.int8_setting["reduce_range"] is True and "always" in rep.int8_setting["reason"]
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


class _AttentionHead(nn.Module):
    """Self-attention through nn.MultiheadAttention (not in an encoder layer), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


def test_dynamic_int8_counts_the_matmul_layers_it_quantized_and_names_the_others():
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)).eval()
    _, rep = quantize_dynamic_int8(plain)
    c = rep.coverage
    assert (c.changed, c.total, c.kind, c.kept, c.missed) == (3, 3, "matmul layers", {}, {})
    assert c.describe() == "quantized 3 of 3 matmul layers"
    # nn.MultiheadAttention reads its out_proj weight itself: torch.ao leaves it fp32, and the count says so
    model = _AttentionHead().eval()
    qmodel, rep = quantize_dynamic_int8(model)
    c = rep.coverage
    assert (c.changed, c.total) == (2, 3) and list(c.missed) == ["attn.out_proj"] and not c.kept
    assert "nn.MultiheadAttention" in c.missed["attn.out_proj"]
    assert c.describe().startswith("quantized 2 of 3 matmul layers; attn.out_proj left fp32: nn.MultiheadAttention")
    assert type(qmodel.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear  # as counted


def _gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_conv1d_layers_become_equal_linears_and_are_quantized_the_tied_head_stays_fp32():
    from transformers.pytorch_utils import Conv1D

    model = _gpt2()
    before = _snapshot(model)
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    # Conv1D (y = x @ W + b, W [in, out]) -> nn.Linear (W transposed): the same outputs, to float rounding
    work = copy.deepcopy(model)
    assert q._conv1d_to_linear(work) == 8 and not any(isinstance(m, Conv1D) for m in work.modules())
    with torch.inference_mode():
        torch.testing.assert_close(work(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)

    qmodel, rep = quantize_dynamic_int8(model)
    c = rep.coverage
    assert (c.changed, c.total, list(c.kept), c.missed) == (8, 9, ["lm_head"], {})
    assert c.describe().startswith("quantized 8 of 9 matmul layers; lm_head left fp32: tied to the input embedding")
    blocks = [m for n, m in qmodel.named_modules() if n.startswith("transformer.h.") and n.endswith(("c_attn", "c_proj",
                                                                                                     "c_fc"))]
    assert len(blocks) == 8 and all(q._is_quantized_layer(m) for m in blocks)
    assert qmodel.lm_head.weight is qmodel.transformer.wte.weight  # still tied: stored once
    assert any("8 transformers Conv1D" in n for n in rep.notes)
    # int8 moves the logits by ~1% of their range on this random model; 10% is the step's tolerance
    a = agreement(model, qmodel, ids)
    assert a.max_rel_diff < 0.1, a
    with torch.inference_mode():
        top1 = (qmodel(ids).logits.argmax(-1) == model(ids).logits.argmax(-1)).float().mean().item()
    assert top1 >= 0.9
    assert rep.new_size_bytes < 0.5 * rep.size_bytes == 0.5 * model_size_bytes(model)
    assert _unchanged(model, before) and sum(isinstance(m, Conv1D) for m in model.modules()) == 8

    # quantizing the tied head too: every matmul int8, and a larger file (an int8 copy beside the embedding)
    qtied, rep_tied = quantize_dynamic_int8(model, quantize_tied=True)
    assert (rep_tied.coverage.changed, rep_tied.coverage.total) == (9, 9)
    assert q._is_quantized_layer(qtied.lm_head) and rep_tied.new_size_bytes > rep.new_size_bytes
    assert agreement(model, qtied, ids).max_rel_diff < 0.1


def test_static_int8_and_half_count_the_layers_they_changed(resnet_int8):
    model, _, _, rep, _ = resnet_int8
    layers = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in model.modules())
    assert (rep.coverage.changed, rep.coverage.total, rep.coverage.missed) == (layers, layers, {})
    assert rep.coverage.describe() == f"quantized {layers} of {layers} conv/linear layers"
    fx_model, fx_rep = quantize_static_int8(get_model("small_cnn").eval(), [torch.randn(8, 1, 8, 8)],
                                            torch.randn(8, 1, 8, 8), backend="fx")
    assert (fx_rep.coverage.changed, fx_rep.coverage.total, fx_rep.coverage.missed) == (4, 4, {})
    _, half = cast_half(get_model("small_cnn"), torch.bfloat16, "cpu")
    floating = sum(t.is_floating_point() for t in get_model("small_cnn").state_dict().values())
    assert half.coverage.changed == half.coverage.total == floating
    _, again = cast_half(get_model("small_cnn").to(torch.bfloat16), torch.bfloat16, "cpu")
    assert again.coverage.changed == 0  # already bf16: nothing cast


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
