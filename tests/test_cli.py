import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_tricks.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_resnet50_json(capsys):
    code, out, err = run(capsys, "summary", "--model", "resnet50", "--input", "3x224x224", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["totals"]["params"] == 25_557_032
    assert abs(data["totals"]["macs"] - 4.1e9) / 4.1e9 < 0.01
    assert data["totals"]["flops"] == 2 * data["totals"]["macs"]
    assert data["rows"] and isinstance(data["advice"], list)


def test_summary_table_of_default_model(capsys):
    code, out, _ = run(capsys, "summary", "--depth", "1")
    assert code == 0
    assert out.startswith("resnet18: input (1, 3, 224, 224) float32")
    assert "11,689,512" in out and "MACs: 1.81 G" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["summary", "--model", "resnet5O"], "unknown model 'resnet5O'"),
        (["summary", "--model", "resnet50", "--input", "5x224x224"], "module 'conv1' (Conv2d)"),
        (["summary", "--model", "resnet50", "--input", "3x224"], "forward failed"),
        (["summary", "--model", "mlp", "--input", "3xx4"], "bad input spec"),
        (["summary", "--model", "no_such_pkg.mod:factory"], "cannot import 'no_such_pkg.mod'"),
        (["summary", "--model", "torch_tricks.models:nope"], "has no attribute 'nope'"),
        (["summary", "--model", "mlp", "--batch", "0"], "--batch must be >= 1"),
        (["memory", "--model", "mlp", "--optimizer", "lion"], "unknown optimizer 'lion'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert out == ""


def test_debug_shows_the_traceback():
    from torch_tricks.errors import UserError

    with pytest.raises(UserError):
        main(["--debug", "summary", "--model", "nope"])


def test_user_factory_and_token_inputs(capsys):
    code, out, _ = run(capsys, "summary", "--model", "torch_tricks.models.transformer:transformer",
                       "--input", "long:32:1000", "--batch", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["by_operator"]["attention"] > 0 and data["inputs"] == "(2, 32) int64"


def test_models_lists_builtins(capsys):
    code, out, _ = run(capsys, "models", "--json")
    names = {m["name"] for m in json.loads(out)["models"]}
    assert {"resnet18", "resnet50", "resnet9", "mobilenet_v2", "repvgg", "transformer", "lstm", "mlp"} <= names


def test_memory_command_reports_activations_and_leak_check(capsys):
    code, out, err = run(capsys, "memory", "--model", "mlp", "--batch", "16", "--leak-steps", "4", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["activation_bytes"] > 0 and data["optimizer_state_bytes"] >= 2 * data["param_bytes"]
    assert data["leak_check"]["leaking"] is False


def test_time_command(capsys):
    code, out, err = run(capsys, "time", "--model", "mlp", "--batch", "4", "--warmup", "1", "--repeats", "3", "--json")
    assert code == 0, err
    timings = json.loads(out)["timings"]
    assert len(timings) == 3 and all(t["repeats"] == 3 and t["median_s"] > 0 for t in timings.values())


def test_profile_command(capsys):
    code, out, err = run(capsys, "profile", "--model", "mlp", "--batch", "4", "--top-k", "5")
    assert code == 0, err
    assert "aten::" in out and "cProfile" in out


def test_graph_command_writes_dot(capsys, tmp_path):
    target = tmp_path / "mlp.dot"
    code, out, err = run(capsys, "graph", "--model", "mlp", "--out", str(target))
    assert code == 0, err
    text = target.read_text()
    assert text.startswith("digraph") and "AddmmBackward0" in text


def test_console_script_entry_point():
    """The installed `torch-tricks` script (python -m for the venv in use) exits 2 on bad input."""
    proc = subprocess.run([sys.executable, "-m", "torch_tricks.cli", "summary", "--model", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("torch-tricks: error: unknown model 'nope'")


def test_tricks_lists_registered_training_tricks(capsys):
    code, out, _ = run(capsys, "tricks", "--kind", "train", "--json")
    assert code == 0
    tricks = {t["name"]: t for t in json.loads(out)["tricks"]}
    assert {"checkpointing", "mixed_precision", "ema", "swa", "fused_optimizer", "sync_batchnorm"} <= set(tricks)
    assert tricks["checkpointing"]["ids"] == ["T12"] and tricks["checkpointing"]["config_key"] == "checkpointing"
    assert tricks["cudnn_benchmark"]["runs_on_cpu"] is False and tricks["cudnn_benchmark"]["why_not"]
    from torch_tricks.train import TrainConfig

    fields = set(TrainConfig.__dataclass_fields__)
    assert all(t["config_key"] in fields for t in tricks.values() if t["config_key"])


def _image_tree(root, n_per_class=3):
    """A tiny ImageFolder tree: two classes of small JPEGs and one corrupt file."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(n_per_class):
            Image.fromarray(rng.integers(0, 255, (40 + i, 50, 3), dtype=np.uint8)).save(root / c / f"{i}.jpg")
    (root / "dog" / "broken.jpg").write_bytes(b"not a jpeg at all")
    return root


def test_pack_command_packs_and_lists_skipped(capsys, tmp_path):
    src = _image_tree(tmp_path / "src")
    dst = tmp_path / "pack"
    assert main(["pack", str(src), str(dst), "--storage", "raw", "--raw-size", "32", "--workers", "0",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "packed 6 samples (2 classes)" in out
    assert "skipped 1 unreadable" in out and "broken.jpg" in out

    from torch_tricks.data.dataset import PackedDataset

    ds = PackedDataset(dst)
    assert len(ds) == 6 and ds.classes == ["cat", "dog"]
    img, label = ds[0]
    assert tuple(img.shape)[-2:] == (32, 32) or tuple(img.shape)[:2] == (32, 32)

    # packing again onto a complete pack without --overwrite is a one-line error, and the pack survives
    assert main(["pack", str(src), str(dst), "--storage", "raw", "--raw-size", "32", "--workers", "0",
                 "--no-progress", "--no-resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "overwrite" in err[0]
    assert len(PackedDataset(dst)) == 6


def test_pack_command_bad_source_is_one_line(capsys, tmp_path):
    assert main(["pack", str(tmp_path / "missing"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]
    assert not (tmp_path / "out").exists()


def test_loader_tune_command_json(capsys, tmp_path):
    src = _image_tree(tmp_path / "src", n_per_class=8)
    dst = tmp_path / "pack"
    assert main(["pack", str(src), str(dst), "--storage", "raw", "--raw-size", "32", "--workers", "0",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["loader-tune", str(dst), "--batch", "4", "--workers", "0", "--seconds", "0.2", "--warm",
                 "--no-progress", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_samples"] == 16
    assert data["best"]["samples_per_s"] > 0
    assert data["verdict"] in ("I/O-bound", "decode-bound", "overhead-bound", "unknown")


def test_console_script_finds_a_factory_in_the_current_folder(tmp_path):
    script = Path(sys.executable).parent / "torch-tricks"
    if not script.exists():
        pytest.skip("the torch-tricks console script is not installed beside this Python")
    (tmp_path / "my_local_net.py").write_text(
        "import torch.nn as nn\n\ndef build():\n    return nn.Sequential(nn.Flatten(), nn.Linear(12, 3))\n")
    r = subprocess.run([str(script), "summary", "--model", "my_local_net:build", "--input", "12", "--json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"]["params"] == 12 * 3 + 3


# -- named inputs (keyword arguments of the forward) and --loss (issue 13) ----------------------------

BERT = ["--model", "hf:bert", "--hf-config",
        "num_hidden_layers=2,hidden_size=64,num_attention_heads=2,intermediate_size=128"]
GPT2 = ["--model", "hf:gpt2", "--hf-config", "n_layer=2,n_embd=64,n_head=2,vocab_size=1000,n_positions=64"]
GPT2_NAMED = ["--input", "input_ids=long:32:1000", "--input", "attention_mask=ones:32"]


def one_error_line(capsys, *argv) -> str:
    """Run a command that must fail on bad input: exit 2, nothing on stdout, one error line."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", err
    lines = [line for line in err.splitlines() if line.startswith("torch-tricks: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_summary_with_named_inputs_has_the_macs_and_params_of_the_positional_run(capsys):
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "summary", *BERT, "--input", "input_ids=long:32:30522",
                         "--input", "attention_mask=ones:32", "--json")
    assert code == 0, err
    named = json.loads(out)
    code, out, err = run(capsys, "summary", *BERT, "--input", "long:32:30522", "--json")
    assert code == 0, err
    positional = json.loads(out)
    assert named["totals"]["macs"] == positional["totals"]["macs"] > 0
    assert named["totals"]["params"] == positional["totals"]["params"]
    assert named["inputs"] == "input_ids=(1, 32) int64, attention_mask=(1, 32) int64"


def test_time_memory_profile_and_graph_run_named_inputs(capsys, tmp_path):
    pytest.importorskip("transformers")
    small = ["--batch", "2"]
    code, out, err = run(capsys, "time", *GPT2, *GPT2_NAMED, *small, "--warmup", "1", "--repeats", "2", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert len(data["timings"]) == 3 and data["loss"] == "sum of output means"
    code, out, err = run(capsys, "time", *GPT2, *GPT2_NAMED, *small, "--warmup", "0", "--repeats", "1",
                         "--loss", "auto", "--json")
    assert code == 0, err
    assert json.loads(out)["loss"] == "auto"
    code, out, err = run(capsys, "memory", *GPT2, *GPT2_NAMED, *small, "--loss", "ce", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["input_bytes"] == 2 * (2 * 32 * 8) and data["activation_bytes"] > 0  # the labels are a target
    code, out, err = run(capsys, "profile", *GPT2, *GPT2_NAMED, *small, "--loss", "auto", "--top-k", "5")
    assert code == 0, err
    assert "aten::" in out
    code, out, err = run(capsys, "graph", *GPT2, *GPT2_NAMED, "--out", str(tmp_path / "gpt2.dot"))
    assert code == 0, err
    assert "transformer.wte.weight" in (tmp_path / "gpt2.dot").read_text()


@pytest.mark.parametrize("argv, needle", [
    ([*GPT2, "--input", "input_ids=long:32:1000", "--input", "attention_mak=ones:32"],
     "model GPT2LMHeadModel's forward takes no input named 'attention_mak': did you mean 'attention_mask'? "
     "it takes input_ids, "),
    ([*GPT2, "--input", "input_ids=long:32:1000", "--input", "ones:32"], "name every input"),
    ([*GPT2, "--input", "input_ids=long:x:1000"], "bad input spec 'input_ids=long:x:1000'"),
    ([*GPT2, "--input", "input_ids=ones:4:2"], "ones takes the shape only"),
    ([*GPT2, "--input", "9ids=long:32"], "Python identifier"),
])
def test_bad_named_inputs_are_one_line_and_exit_2(capsys, argv, needle):
    pytest.importorskip("transformers")
    for command in ("summary", "time"):
        assert needle in one_error_line(capsys, command, *argv)


def test_optimize_takes_named_inputs_as_the_positional_ones_they_bind_to(capsys):
    """Issue 34: --input names are accepted by every command that takes --input; the deploy steps call the model
    positionally, so a name goes to its place in the forward, and one that cannot is said in one line."""
    results = []
    for spec in ("x=784", "784"):
        torch.manual_seed(0)  # the same random weights
        code, out, err = run(capsys, "optimize", "--model", "mlp", "--input", spec, "--steps", "int8-dynamic",
                             "--no-save", "--no-latency", "--json")
        assert code == 0, err
        data = json.loads(out)
        results.append((data["example_inputs"], [(s["step"], s["agreement"]) for s in data["steps"]]))
    assert results[0] == results[1] and results[0][0] == "(16, 784) float32"
    pytest.importorskip("transformers")
    line = one_error_line(capsys, "optimize", *GPT2, "--input", "input_ids=long:32:1000", "--input",
                          "attention_mask=ones:32", "--steps", "int8-dynamic", "--no-save")
    assert line.startswith("torch-tricks: error: optimize calls the model with positional inputs, and "
                           "GPT2LMHeadModel's forward takes 'cache' before 'attention_mask', so attention_mask "
                           "cannot go by position: leave it out"), line


FACTORIES = '''
import torch
import torch.nn as nn


class Argmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(x).argmax(-1)


class VectorLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        logits = self.fc(x)
        return {"loss": logits[:4].pow(2).mean(1), "logits": logits}


class OnePerSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc(x).squeeze(-1)


def argmax():
    return Argmax()


def vector_loss():
    return VectorLoss()


def one_per_sample():
    return OnePerSample()
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "tt_loss_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tt_loss_factories"


@pytest.mark.parametrize("command", [["memory"], ["time", "--repeats", "1", "--warmup", "0"],
                                     ["tune", "--budget-seconds", "5", "--no-progress"]])
def test_a_forward_without_a_floating_output_under_loss_auto_is_one_line(capsys, factories, command):
    line = one_error_line(capsys, *command, "--model", f"{factories}:argmax", "--input", "16", "--batch", "4",
                          "--loss", "auto")
    assert "no floating-point tensor" in line and "int64 tensor of shape" in line


@pytest.mark.parametrize("loss", ["auto", "none"])
@pytest.mark.parametrize("command", [["memory"], ["time", "--repeats", "1", "--warmup", "0"]])
def test_a_loss_that_is_not_a_scalar_is_one_line(capsys, factories, command, loss):
    line = one_error_line(capsys, *command, "--model", f"{factories}:vector_loss", "--input", "16", "--batch", "8",
                          "--loss", loss)
    assert "has shape (4,), not a scalar" in line


def test_without_loss_the_measured_step_needs_no_target(capsys, factories):
    code, out, err = run(capsys, "memory", "--model", f"{factories}:vector_loss", "--input", "16", "--batch", "8",
                         "--json")
    assert code == 0, err  # the sum of the output means: the (4,) loss is just one more output
    assert json.loads(out)["loss"] == "sum of output means"


def test_tune_and_train_pass_their_loss_on(capsys, factories):
    line = one_error_line(capsys, "tune", "--model", f"{factories}:one_per_sample", "--input", "16", "--batch", "4",
                          "--loss", "ce", "--budget-seconds", "5", "--no-progress")
    assert "--loss ce needs class logits" in line
    line = one_error_line(capsys, "train", "--model", "small_cnn", "--data", "digits", "--epochs", "1",
                          "--loss", "mse")
    assert re.search(r"the target's shape \(\d+,\) differs from the output's \(\d+, 10\)", line), line


def test_loss_choices_are_the_shared_ones():
    from torch_tricks.cli import build_parser
    from torch_tricks.outputs import LOSSES

    parser = build_parser()
    for command in ("memory", "time", "profile", "tune", "train"):
        assert parser.parse_args([command, "--loss", "bce-with-logits"]).loss == "bce-with-logits"
    assert parser.parse_args(["memory"]).loss is None and parser.parse_args(["tune"]).loss == "auto"
    assert parser.parse_args(["doctor", "--model", "mlp"]).loss == "auto"
    for kind in (*LOSSES, "cross-entropy", "bce"):
        assert parser.parse_args(["doctor", "--model", "mlp", "--loss", kind]).loss == kind


_NOISY_LIB = '''
import logging
import warnings

logging.getLogger("noisylib._C").warning("Failed to load /x/noisylib/_C_mxfp8.so: Could not load this library")
logging.getLogger("torch.utils._pytree_standin").warning("register_constant() on Enum subclasses is deprecated")
warnings.warn("noisylib.old_api is deprecated", FutureWarning)
'''
_USER_MODULE = '''
import logging
import warnings

import noisylib  # noqa: F401  (a library whose import is noisy, like transformers pulling in torchao)
import torch

warnings.warn("mymodel: the user's own warning")
logging.getLogger("torch_tricks.standin").warning("torch_tricks: the project's own log line")


def build():
    return torch.nn.Linear(8, 4)
'''


def test_other_libraries_import_noise_stays_off_the_terminal(tmp_path):
    """A stand-in library in a site-packages folder logs 'Failed to load ...so', a deprecation through a
    torch logger and a FutureWarning on import: none reaches stderr, the table comes first; -v shows them;
    the user's own warning and the project's own log line are never held back."""
    site = tmp_path / "site-packages"
    (site / "noisylib").mkdir(parents=True)
    (site / "noisylib" / "__init__.py").write_text(_NOISY_LIB)
    user = tmp_path / "work"
    user.mkdir()
    (user / "mymodel.py").write_text(_USER_MODULE)
    script = Path(sys.executable).parent / "torch-tricks"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(user)])}

    def run(*extra):
        return subprocess.run([str(script), "summary", "--model", "mymodel:build", "--input", "8", *extra],
                              capture_output=True, text=True, env=env, cwd=user, timeout=300)

    quiet, loud = run(), run("-v")
    assert quiet.returncode == 0 and loud.returncode == 0, quiet.stderr + loud.stderr
    for noise in ("Failed to load", "register_constant", "old_api is deprecated"):
        assert noise not in quiet.stderr, quiet.stderr
        assert noise in loud.stderr, loud.stderr
    assert "the user's own warning" in quiet.stderr and "the project's own log line" in quiet.stderr
    assert quiet.stdout.splitlines()[0].startswith("mymodel:build")
