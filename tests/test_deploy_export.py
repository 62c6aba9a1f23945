from __future__ import annotations

import pytest
import torch

from _deploy_utils import randomize_bn, same_state, state_copy
from torch_tricks.deploy.export import (
    OrtModule,
    export_onnx_checked,
    onnx_size_bytes,
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
    rep = export_onnx_checked(model, torch.randn(shape), tmp_path / f"{name}.onnx")
    assert rep.ok and rep.max_abs_diff <= 1e-4, rep.to_dict()
    assert rep.max_rel_diff <= 1e-4
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
