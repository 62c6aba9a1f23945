from __future__ import annotations

import pytest
import torch

from _deploy_utils import randomize_bn, same_state, state_copy
from torch_tricks.deploy.cpu_int8 import int8_setting
from torch_tricks.deploy.export import (
    OrtModule,
    export_onnx_checked,
    onnx_size_bytes,
    ort_int8_setting,
    ort_quantize_dynamic,
    ort_quantize_static,
)
from torch_tricks.deploy.step_report import report
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.registry import get_trick

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def _vision(name: str) -> torch.nn.Module:
    if name == "repvgg":  # exported as deployed: the folded net is what one ships
        from torch_tricks.deploy.reparam import reparameterize_model

        return reparameterize_model(randomize_bn(get_model("repvgg", num_classes=10)))
    return randomize_bn(get_model(name, num_classes=10))


# Every built-in vision model (resnet34 is resnet18's blocks, deeper: slow only). Small
# spatial sizes keep each export to a few seconds.
@pytest.mark.parametrize(
    "name,shape",
    [
        ("small_cnn", (2, 1, 8, 8)),
        ("resnet9", (2, 3, 32, 32)),
        ("resnet18", (2, 3, 32, 32)),
        ("mobilenet_v2", (2, 3, 32, 32)),
        ("repvgg", (2, 3, 32, 32)),
        ("resnet50", (2, 3, 32, 32)),
        pytest.param("resnet34", (2, 3, 32, 32), marks=pytest.mark.slow),
    ],
)
def test_every_vision_model_runs_in_onnx_runtime(name, shape, tmp_path):
    model = _vision(name).train()
    before = state_copy(model)
    x = torch.randn(shape)
    # 1e-4, or 1e-5 of the largest output where that is more: ResNet-50's logits reach 56 here, and ONNX Runtime
    # against torch's summation order (which changes with the thread count) differed by 1.05e-4 on one thread
    # on AVX2 kernels (1.9e-6 of the largest logit), 8.8e-5 on two
    with torch.inference_mode():
        scale = float(model.eval()(x).abs().max())
    model.train()
    atol = max(1e-4, 1e-5 * scale)
    rep = export_onnx_checked(model, x, tmp_path / f"{name}.onnx", atol=atol)
    assert rep.ok and rep.max_abs_diff <= atol, rep.to_dict()
    assert rep.max_rel_diff <= 1e-5
    assert rep.checked_batches == [2, 1]  # the batch dim is really dynamic
    assert rep.size_bytes == onnx_size_bytes(tmp_path / f"{name}.onnx") > 0
    assert model.training and same_state(model, before)


def test_ort_module_in_the_deploy_report_and_ort_int8(tmp_path):
    model = randomize_bn(get_model("small_cnn")).eval()
    x = torch.randn(16, 1, 8, 8)
    path = tmp_path / "m.onnx"
    export_onnx_checked(model, x, path)
    ort_fp32 = OrtModule(path)
    assert ort_fp32(x).shape == (16, 10)

    static = ort_quantize_static(path, tmp_path / "s8.onnx", [torch.randn(16, 1, 8, 8) for _ in range(4)])
    dynamic = ort_quantize_dynamic(path, tmp_path / "d8.onnx")
    reps = report(
        model,
        {"ort": ort_fp32, "ort_int8": OrtModule(static), "ort_dyn": OrtModule(dynamic)},
        {1: x[:1], 16: x},
        warmup=1,
        repeats=2,
        sizes={"ort": onnx_size_bytes(path), "ort_int8": onnx_size_bytes(static), "ort_dyn": onnx_size_bytes(dynamic)},
    )
    assert reps["ort"].agreement.max_abs_diff <= 1e-4 and reps["ort"].agreement.top1_agreement == 1.0
    assert reps["ort_int8"].agreement.max_rel_diff < 0.2  # int8: close, not equal
    assert reps["ort_int8"].size_bytes < reps["ort"].size_bytes
    assert set(reps["ort"].latency_s) == {1, 16}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d8.onnx", "m.onnx", "s8.onnx"]  # no temporaries left


def test_errors(tmp_path):
    with pytest.raises(UserError, match="no ONNX file"):
        OrtModule(tmp_path / "missing.onnx")
    model = get_model("small_cnn")
    path = tmp_path / "m.onnx"
    export_onnx_checked(model, torch.randn(2, 1, 8, 8), path, dynamic_batch=False)
    with pytest.raises(UserError, match="takes 1 inputs"):
        OrtModule(path)(torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8))
    with pytest.raises(UserError, match="calibration"):
        ort_quantize_static(path, tmp_path / "q.onnx", [])
    with pytest.raises(UserError):
        export_onnx_checked(model, torch.randn(2, 1, 8, 8), path, atol=-1)
    assert get_trick("onnx_export").ids == ("I7",)


def _weight_types(path) -> set[str]:
    """The integer types of the quantized weights (initializers ORT names ``*_quantized``) of an ONNX file."""
    import onnx

    m = onnx.load(str(path))
    return {onnx.TensorProto.DataType.Name(t.data_type).lower() for t in m.graph.initializer
            if t.name.endswith("_quantized") and len(t.dims) > 1}


def test_ort_dynamic_int8_mlp_agrees_on_a_cpu_without_vnni_and_here(tmp_path):
    """Issue 19: ONNX Runtime dynamic int8 of the built-in mlp agrees with fp32 on top-1 for
    >= 97% of 256 random inputs, for each of 5 seeds, under the setting the fix picks on a
    CPU without VNNI and under this machine's own setting.

    ONNX Runtime reads cpuid itself (no env var can hide VNNI from it), so on a VNNI machine
    the no-VNNI setting is forced: u8 weights. Forced here it computes exactly what a CPU
    without VNNI computes: u8 x u8 runs in ORT's U8U8 kernels, which never use VPMADDUBSW;
    they widen both factors to 16 bits and add pairs with VPMADDWD into int32
    (2 * 255 * 255 = 130050 fits), so their sums are the exact int32 sums of any other
    kernel, with or without VNNI. (The other cure, 7-bit s8 weights, also cannot saturate:
    |u8 * s7 + u8 * s7| <= 2 * 255 * 64 = 32640 < 32767; measured on ten model seeds with
    256 inputs each it agreed for 96.9% on two of them, u8 weights for >= 97.7% on all.)
    Measured before the fix on an AVX2-only machine, the s8 default agreed for 91-96%.
    """
    no_vnni = int8_setting("onnxruntime", flags={"avx2", "fma"}, env={}, machine="x86_64")
    here = ort_int8_setting("dynamic")
    assert no_vnni.weight_type == "uint8" and not no_vnni.forced
    settings = {"no-VNNI setting, forced: u8 weights": "uint8", f"this CPU's: {here.weight_type} weights": None}
    agree: dict[str, list[float]] = {label: [] for label in settings}
    for seed in range(5):
        torch.manual_seed(seed)
        model = get_model("mlp").eval()
        x = torch.randn(256, 784, generator=torch.Generator().manual_seed(100 + seed))
        path = export_onnx_checked(model, x[:2], tmp_path / f"mlp{seed}.onnx").path
        with torch.inference_mode():
            ref = model(x).argmax(1)
        for label, weight_type in settings.items():
            out = ort_quantize_dynamic(path, tmp_path / f"mlp{seed}-{weight_type}.onnx", weight_type=weight_type)
            assert _weight_types(out) == {weight_type or here.weight_type}  # the file has what was chosen
            agree[label].append(float((OrtModule(out)(x).argmax(1) == ref).float().mean()))
    assert all(a >= 0.97 for runs in agree.values() for a in runs), agree


def test_ort_int8_weight_type_is_in_the_file_and_can_be_forced(tmp_path):
    model = randomize_bn(get_model("small_cnn")).eval()
    path = tmp_path / "m.onnx"
    export_onnx_checked(model, torch.randn(16, 1, 8, 8), path)
    calib = [torch.randn(16, 1, 8, 8) for _ in range(2)]
    static = ort_quantize_static(path, tmp_path / "s.onnx", calib)  # u8 weights on every CPU
    assert _weight_types(static) == {"uint8"} and ort_int8_setting("static").weight_type == "uint8"
    for wt in ("int8", "uint8"):
        s = ort_quantize_static(path, tmp_path / f"s{wt}.onnx", calib, weight_type=wt)
        d = ort_quantize_dynamic(path, tmp_path / f"d{wt}.onnx", weight_type=wt)
        assert _weight_types(s) == _weight_types(d) == {wt}
        assert ort_int8_setting("static", wt).forced and ort_int8_setting("dynamic", wt).weight_type == wt
    with pytest.raises(UserError, match="weight_type must be 'int8', 'uint8' or None"):
        ort_quantize_dynamic(path, tmp_path / "x.onnx", weight_type="int4")
