"""`torch-tricks optimize`: deploy steps chained from the command line, checked, written, loaded back.

Small inputs and one intra-op thread keep the file fast on shared cores. Numbers are
checked (agreement, BatchNorm count, sizes, that latencies were measured), never
absolute times: speed is benchmarks/deploy.py's job. Models with weights come in through
``--weights`` (BN statistics randomized, so a fold that ignored them would show), and
models that exist only as Python objects through ``--model test_deploy_cli:NAME``, so
a test can check that the very object it passed was left unchanged.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
import torch.nn as nn
from _deploy_utils import randomize_bn, same_state, state_copy

from torch_tricks.cli import main
from torch_tricks.deploy.export import ort_int8_setting
from torch_tricks.deploy.pipeline import list_steps, load_optimized
from torch_tricks.deploy.quantize import _cpu_flag
from torch_tricks.models import get_model, list_models

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

_THIS = sys.modules[__name__]


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread, restored after: ``--threads`` sets it for the process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _weights(tmp_path, name: str, model: nn.Module) -> tuple[str, str]:
    """Save ``model``'s state_dict; return the path and the file's hash."""
    path = tmp_path / f"{name}.pt"
    torch.save(model.state_dict(), path)
    return str(path), _sha(path)


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _files(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


# -- models only importable from here (--model test_deploy_cli:NAME) -----------------------


class DataDependent(nn.Module):
    """Branches on a tensor value: neither torch.fx nor torch.export can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        y = self.bn(self.conv(x))
        if y.sum() > 0:
            y = y * 2
        return self.fc(y.mean((2, 3)))


def make_cancelling() -> nn.Module:
    """Outputs are differences of two numbers near 100: bf16 (8 bits of mantissa) loses them."""

    class Cancelling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4, bias=False)
            with torch.no_grad():
                self.fc.weight.copy_(torch.eye(4) - torch.eye(4).roll(1, 0))

        def forward(self, x):
            return self.fc(x + 100.0)

    return Cancelling()


# -- tests ------------------------------------------------------------------------------------


def test_list_steps(capsys):
    code, out, _ = run(capsys, "optimize", "--list-steps", "--json")
    assert code == 0 and json.loads(out)["steps"] == list_steps()
    code, out, _ = run(capsys, "optimize", "--list-steps")
    assert code == 0 and all(name in out for name in list_steps())


def test_fuse_resnet18_with_weights_reports_writes_and_loads_back(capsys, tmp_path):
    model = randomize_bn(get_model("resnet18"))
    weights, sha = _weights(tmp_path, "w", model)
    out_path = tmp_path / "fused.pt2"
    code, out, err = run(capsys, "optimize", "--model", "resnet18", "--input", "3x32x32", "--batch", 4,
                         "--weights", weights, "--steps", "fuse", "--latency-batch", 1, "--latency-batch", 4,
                         "--warmup", 1, "--repeats", 2, "--out", out_path, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["ok"] and d["written"] == str(out_path) and d["saved"]["format"] == "torch.export"
    fuse = d["steps"][0]
    assert fuse["backend"] == "fx" and fuse["within_tolerance"]
    assert fuse["details"]["batchnorm_before"] == 20 and fuse["details"]["batchnorm_after"] == 0
    assert fuse["agreement"]["max_rel_diff"] <= 1e-4 and fuse["agreement"]["top1_agreement"] == 1.0
    assert fuse["params"] < d["original"]["params"] and 0 < fuse["size_bytes"] < d["original"]["size_bytes"]
    for r in (d["original"], fuse):
        assert set(r["latency_s"]) == {"1", "4"} and all(t > 0 for t in r["latency_s"].values())
    assert d["saved"]["verify_max_abs_diff"] == 0.0 and out_path.stat().st_size == d["saved"]["size_bytes"]
    assert _sha(weights) == sha  # the input file is left alone

    # the written file is the fused model *with the loaded weights*: compare with the eval original
    x = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        ref, got = model.eval()(x), load_optimized(out_path)(x)
    assert float((ref - got).abs().max() / ref.abs().max()) <= 1e-4


def test_text_report_has_every_column_and_the_default_file_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    weights, _ = _weights(tmp_path, "w", randomize_bn(get_model("repvgg")))
    code, out, err = run(capsys, "optimize", "--model", "repvgg", "--input", "3x32x32", "--weights", weights,
                         "--steps", "reparam,fuse", "--latency-batch", 1, "--latency-batch", 2,
                         "--warmup", 1, "--repeats", 2)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("repvgg: reparam,fuse on cpu, 1 thread(s); outputs compared on (16, 3, 32, 32)")
    header = next(line for line in lines if line.startswith("step"))
    for col in ("backend", "max abs diff", "top-1", "params", "size", "changed", "bs1 ms", "bs1 x", "bs2 ms", "bs2 x",
                "status"):
        assert col in header
    rows = {line.split()[0]: line.split() for line in lines if line.split() and
            line.split()[0] in ("original", "reparam", "fuse")}
    assert set(rows) == {"original", "reparam", "fuse"} and rows["fuse"][1] == "(no-op)"
    assert float(rows["reparam"][2]) < 1e-3 and rows["reparam"][3] == "100.0%" and rows["reparam"][-1] == "ok"
    assert "verified: every step within its tolerance" in out
    assert "wrote repvgg-reparam-fuse.pt2: torch.export" in out
    assert _files(tmp_path) == ["repvgg-reparam-fuse.pt2", "w.pt"]


def test_int8_on_a_trained_model_calibrated_on_real_data(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, _, err = run(capsys, "train", "--model", "small_cnn", "--data", "digits", "--epochs", 3,
                       "--checkpoint-dir", ckpt, "--no-progress")
    assert code == 0, err
    out_path = tmp_path / "int8.pt2"
    code, out, err = run(capsys, "optimize", "--model", "small_cnn", "--weights", ckpt / "last.pt",
                         "--data", "digits", "--steps", "fuse,int8", "--latency-batch", 64,
                         "--warmup", 1, "--repeats", 2, "--out", out_path, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["calibration"].startswith("8 batches (128 samples) given in calib")
    fuse, int8 = d["steps"]
    assert fuse["details"]["batchnorm_after"] == 0 and fuse["agreement"]["max_rel_diff"] <= 1e-4
    assert int8["backend"] in ("pt2e", "fx") and int8["within_tolerance"]
    assert int8["agreement"]["top1_agreement"] >= 0.95  # on the 359 validation images
    assert int8["size_bytes"] * 3 < d["original"]["size_bytes"]
    assert int8["latency_s"]["64"] > 0  # one batch size: an int8 PT2E model compiles once per batch size
    assert d["saved"]["verify_max_abs_diff"] is not None and d["saved"]["verify_max_abs_diff"] < 1e-4
    assert out_path.is_file()


def test_int8_dynamic_transformer_runs_without_the_fast_path_crash(capsys, tmp_path):
    out_path = tmp_path / "dyn.pt"
    code, out, err = run(capsys, "optimize", "--model", "transformer", "--input", "long:16:1000",
                         "--steps", "int8-dynamic", "--latency-batch", 16, "--warmup", 1, "--repeats", 2,
                         "--out", out_path, "--json")
    assert code == 0, err
    d = json.loads(out)
    step = d["steps"][0]
    assert step["backend"] == "torch.ao dynamic" and step["within_tolerance"]
    assert step["agreement"]["top1_agreement"] >= 0.9 and step["latency_s"]["16"] > 0
    assert any("fast path" in n for n in step["notes"])
    assert step["size_bytes"] < 0.5 * d["original"]["size_bytes"]
    assert d["saved"]["format"] == "pickle" and d["saved"]["verify_max_abs_diff"] == 0.0
    assert torch.backends.mha.get_fastpath_enabled()  # the global switch was not turned off
    with torch.inference_mode():  # another batch and length: nothing frozen to the example
        assert load_optimized(out_path)(torch.randint(0, 1000, (3, 40))).shape == (3, 2)


def test_onnx_step_runs_in_onnx_runtime_and_writes_the_file(capsys, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = randomize_bn(get_model("small_cnn"))
    weights, _ = _weights(tmp_path, "w", model)
    out_path = tmp_path / "m.onnx"
    code, out, err = run(capsys, "optimize", "--model", "small_cnn", "--weights", weights, "--steps", "fuse,onnx",
                         "--no-latency", "--out", out_path, "--json")
    assert code == 0, err
    d = json.loads(out)
    step = d["steps"][-1]
    assert step["backend"].startswith("onnxruntime") and step["agreement"]["max_abs_diff"] <= 1e-4
    assert d["saved"]["format"] == "onnx" and not d["measured"]
    x = torch.randn(5, 1, 8, 8)
    sess = ort.InferenceSession(str(out_path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.inference_mode():
        assert float((got - model.eval()(x)).abs().max()) <= 1e-4


def test_onnx_runtime_int8_prints_nothing_but_the_report(capfd, caplog):
    """ORT's dynamic quantizer warns through the root logger (outside pytest that also
    installs a stderr handler for the whole process): nothing may reach the terminal or
    the logs but the report."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    code = main(["optimize", "--model", "mlp", "--steps", "onnx-int8:dynamic", "--no-latency", "--no-save", "--json"])
    out, err = capfd.readouterr()
    assert code == 0 and err == "", err
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []
    d = json.loads(out)
    step = d["steps"][0]
    assert step["backend"] == "onnxruntime dynamic int8" and step["within_tolerance"]
    assert step["size_bytes"] < 0.5 * d["original"]["size_bytes"]
    # the setting chosen for this CPU (u8 weights without VNNI, where s8 agreed for 87.5%) is reported
    auto = ort_int8_setting("dynamic")
    assert step["int8_setting"] == d["int8_setting"] == auto.to_dict()
    assert any(n.startswith("int8 setting: ") and auto.reason in n for n in step["notes"])


def test_onnx_runtime_int8_setting_can_be_forced(capsys):
    """Both settings can be forced, with --int8-for or on the step; the no-VNNI one is what
    a CPU without VNNI gets by default, so its agreement here is that CPU's (u8 weights run
    in kernels that cannot saturate: see test_deploy_export)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    for target, steps in (("no-vnni", ["--steps", "onnx-int8:dynamic", "--int8-for", "no-vnni"]),
                          ("vnni", ["--steps", "onnx-int8:dynamic:vnni"])):
        code, out, err = run(capsys, "optimize", "--model", "mlp", *steps, "--no-latency", "--no-save", "--json")
        step = json.loads(out)["steps"][0]
        s = step["int8_setting"]
        assert s["for_vnni"] is (target == "vnni") and s["forced"] and s["reason"].startswith("forced")
        assert s["weight_type"] == ("int8" if target == "vnni" else "uint8")
        if target == "no-vnni" or s["vnni"]:  # exact on every CPU, and s8 weights where the kernels have VNNI
            assert code == 0 and step["within_tolerance"], (err, step["agreement"])
        else:  # s8 weights forced onto kernels without VNNI may saturate (87.5% on an AVX2 EPYC): said, exit 1
            assert code == (0 if step["within_tolerance"] else 1), err
        assert any(n.startswith("int8 setting: ") and "forced by the caller" in n for n in step["notes"])
    code, out, _ = run(capsys, "optimize", "--model", "mlp", "--steps", "onnx-int8:dynamic:no-vnni", "--no-latency",
                       "--no-save")
    assert code == 0 and "int8 setting: full 8-bit range, uint8 activations x uint8 weights" in out  # text too


def test_every_builtin_vision_model_has_an_onnx_runtime_test():
    """test_deploy_export runs each vision model's ONNX file in ONNX Runtime (max abs diff
    <= 1e-4); a model added to the registry must be added there too."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import test_deploy_export

    marks = test_deploy_export.test_every_vision_model_runs_in_onnx_runtime.pytestmark
    params = next(m.args[1] for m in marks if m.name == "parametrize")
    names = {p.values[0] if hasattr(p, "values") else p[0] for p in params}
    assert names == set(list_models("vision"))


def test_int8_on_an_untraceable_model_says_why_in_one_line_and_changes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = DataDependent().train()
    before = state_copy(model)
    monkeypatch.setattr(_THIS, "UNTRACEABLE", model, raising=False)
    code, out, err = run(capsys, "optimize", "--model", "test_deploy_cli:UNTRACEABLE", "--input", "1x8x8",
                         "--steps", "fuse,int8", "--no-latency")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "step 'int8' cannot apply" in err and "torch.fx cannot trace" in err and "pt2e not used" in err
    assert same_state(model, before) and model.training
    assert _files(tmp_path) == []


@pytest.mark.skipif(_cpu_flag("_is_amx_fp16_supported"), reason="this CPU has native fp16 (AMX-FP16)")
def test_fp16_on_cpu_says_why_in_one_line_and_changes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    weights, sha = _weights(tmp_path, "w", get_model("small_cnn"))
    code, out, err = run(capsys, "optimize", "--model", "small_cnn", "--weights", weights, "--steps", "fuse,fp16")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "fp16 on CPU is slower than fp32" in err and "bf16" in err
    assert _sha(weights) == sha and _files(tmp_path) == ["w.pt"]


def test_a_step_outside_its_tolerance_exits_1_and_writes_only_with_force(capsys, tmp_path):
    out_path = tmp_path / "bf16.pt2"
    argv = ["optimize", "--model", "test_deploy_cli:make_cancelling", "--input", "4", "--steps", "bf16",
            "--no-latency", "--out", out_path]
    code, out, err = run(capsys, *argv)
    assert code == 1, err
    assert "EXCEEDED" in out and "NOT verified: bf16 exceeds max rel diff <= 0.05" in out
    assert "nothing written" in out and not out_path.exists()
    code, out, _ = run(capsys, *argv, "--force")
    assert code == 1 and out_path.is_file() and f"wrote {out_path}" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "small_cnn"], "--steps is required"),
        (["--model", "small_cnn", "--steps", "frobnicate"], "unknown step 'frobnicate'"),
        (["--model", "small_cnn", "--steps", "int8,fuse"], "'fuse' cannot follow 'int8'"),
        (["--model", "small_cnn", "--steps", "fuse", "--out", "m.onnx"], "name it .pt2 or .pt"),
        (["--model", "small_cnn", "--steps", "onnx", "--out", "m.pt2"], "name it .onnx"),
        (["--model", "small_cnn", "--steps", "fuse", "--data", "digits", "--input", "1x8x8"], "not both"),
        (["--model", "small_cnn", "--steps", "fuse", "--data", "imagenet"], "unknown data set 'imagenet'"),
        (["--model", "small_cnn", "--steps", "fuse", "--weights", "missing.pt"], "missing.pt"),
        (["--model", "small_cnn", "--steps", "fuse", "--threads", "0"], "--threads 0: give 1"),
        (["--model", "small_cnn", "--steps", "fuse", "--latency-batch", "0"], "batches must be positive"),
        (["--model", "mlp", "--steps", "fuse", "--data", "digits"], "does not run on the example inputs"),
        (["--model", "mlp", "--steps", "onnx-int8", "--int8-for", "avx2"], "must be auto, vnni or no-vnni"),
        (["--model", "mlp", "--steps", "fuse", "--int8-for", "vnni"], "has no int8 or onnx-int8 step"),
        (["--model", "mlp", "--steps", "onnx-int8:vnni", "--int8-for", "no-vnni"], "int8 target given twice"),
        (["--model", "mlp", "--steps", "onnx-int8:dynamic:7bit"], ":vnni or :no-vnni"),
        (["--model", "mlp", "--steps", "int8-dynamic", "--int8-for", "vnni"], "int8-dynamic has one setting"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "optimize", *argv)
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert _files(tmp_path) == []


def test_weights_that_do_not_fit_the_model_are_refused(capsys, tmp_path):
    weights, _ = _weights(tmp_path, "w", get_model("resnet9"))
    code, out, err = run(capsys, "optimize", "--model", "small_cnn", "--weights", weights, "--steps", "fuse")
    assert code == 2 and out == "" and err.count("\n") == 1


def _made_results(monkeypatch) -> list:
    """The OptimizeResult objects the command makes, kept for the test to render."""
    from torch_tricks.deploy import pipeline

    made, real = [], pipeline.optimize
    monkeypatch.setattr(pipeline, "optimize", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    return made


def test_the_printed_report_is_the_results_to_text(capsys, tmp_path, monkeypatch):
    """A Python user gets the very text the CLI prints: OptimizeResult.to_text, timings included."""
    made = _made_results(monkeypatch)
    out_path = tmp_path / "m.pt2"
    code, out, _ = run(capsys, "optimize", "--model", "small_cnn", "--steps", "fuse", "--latency-batch", 2,
                       "--warmup", 1, "--repeats", 2, "--out", out_path)
    assert code == 0 and f"wrote {out_path}" in out
    assert out == made[-1].to_text(model_name="small_cnn", steps=["fuse"], save_asked=True) + "\n"
    code, out, _ = run(capsys, "optimize", "--model", "test_deploy_cli:make_cancelling", "--input", "4",
                       "--steps", "bf16", "--no-latency", "--out", tmp_path / "bf16.pt2")
    assert code == 1 and "nothing written" in out
    assert out == made[-1].to_text(model_name="test_deploy_cli:make_cancelling", steps=["bf16"],
                                   save_asked=True) + "\n"
    code, out, _ = run(capsys, "optimize", "--model", "small_cnn", "--steps", "fuse", "--no-latency", "--no-save",
                       "--data", "digits")
    assert code == 0 and " from digits (validation)" in out
    assert out == made[-1].to_text(model_name="small_cnn", steps=["fuse"], data_name="digits") + "\n"
