"""`torch-tricks tune`: the table, the files under --out, tricks.toml into `train --config`, bad input."""

import contextlib
import io
import json
import tomllib

import pytest

from torch_tricks.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tuned_dir(tmp_path_factory):
    """One tune for the module, with a folder of images for the loader and the deploy chains measured too."""
    Image = pytest.importorskip("PIL.Image")
    import numpy as np

    imgs = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (imgs / c).mkdir()
        for i in range(40):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(imgs / c / f"{i}.png")
    out = tmp_path_factory.mktemp("tune")
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        code = main(["tune", "--model", "small_cnn", "--batch", "32", "--budget-seconds", "24", "--skip", "compile",
                     "--data", str(imgs), "--deploy", "--out", str(out), "--no-progress"])
    assert code == 0, err.getvalue()
    return out, buf.getvalue(), err.getvalue()


def test_tune_prints_a_table_and_writes_the_report(tuned_dir):
    out, text, err = tuned_dir
    assert err == ""  # no progress bar asked for, and the library prints nothing else
    lines = text.splitlines()
    if lines[0].startswith("shared machine: "):  # other processes used the CPU (the suite's other worker): said first
        lines = lines[1:]
    head = lines[0].split()
    assert head[:4] == ["trick", "ids", "goal", "speed-up"]
    assert "plain again (A/A)" in text and "noise ±" in text
    assert "small_cnn: batch 32, input [[1, 8, 8]], cpu, adamw" in text
    for name in ("report.md", "report.json", "report.png", "tricks.toml"):
        assert (out / name).is_file(), name
    data = json.loads((out / "report.json").read_text())
    assert data["model"] == "small_cnn" and data["batch"] == 32 and data["baseline"]["step_s"] > 0
    assert any(r["status"] == "measured" for r in data["results"])


def test_tricks_toml_runs_as_is_under_train_config(tuned_dir, capsys):
    out, _, _ = tuned_dir
    toml = tomllib.loads((out / "tricks.toml").read_text())["train"]
    code, text, err = run(capsys, "train", "--config", str(out / "tricks.toml"), "--model", "small_cnn",
                          "--data", "digits", "--max-steps", "3", "--no-progress", "--json")
    assert code == 0, err
    history = json.loads(text)
    for key, value in toml.items():  # exactly the recommended switches, nothing else changed
        assert history["config"][key] == value, key
    assert history["steps"] == 3


def test_tune_json(capsys, tmp_path):
    code, text, err = run(capsys, "tune", "--model", "mlp", "--batch", "16", "--budget-seconds", "20",
                          "--skip", "compile", "--no-progress", "--json")
    assert code == 0, err
    data = json.loads(text)
    assert data["inputs"] == [[784]] and data["recommended"].get("batch_size", 16) * data["recommended"].get("accumulate", 1) == 16
    assert all(s["reason"] for s in data["skipped"])
    assert data["baseline"]["peak_bytes"] > 0 and data["noise"] is not None


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "resnet5O"], "unknown model 'resnet5O'"),
        (["--model", "small_cnn", "--input", "3x8x8"], "forward failed in module"),
        (["--model", "no_such_pkg.nets:build"], "cannot import 'no_such_pkg.nets'"),
        (["--model", "small_cnn", "--memory-limit", "lots"], "cannot read the size 'lots'"),
        (["--model", "small_cnn", "--skip", "warp_drive"], "unknown trick 'warp_drive'"),
        (["--model", "small_cnn", "--budget-seconds", "0"], "--budget-seconds must be > 0"),
        (["--model", "small_cnn", "--device", "cuda:7"], "cuda"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, "tune", "--no-progress", *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torch-tricks: error: "), err
    assert needle in lines[0]


def test_tune_with_data_and_deploy(tuned_dir):
    out, text, _ = tuned_dir
    data = json.loads((out / "report.json").read_text())
    loader = data["data"]
    assert loader["status"] == "measured" and loader["loader_samples_per_s"] > 0 and loader["step_samples_per_s"] > 0
    assert loader["data_bound"] == (loader["loader_samples_per_s"] < loader["step_samples_per_s"])
    steps = {"+".join(s["steps"]): s for s in data["deploy"]["steps"]}
    assert steps["fuse"]["status"] == "measured" and steps["fuse"]["within_tolerance"] is True
    assert all(s["status"] in ("measured", "no change", "not applicable", "skipped") for s in steps.values())
    assert all(s.get("reason") for s in steps.values() if s["status"] in ("not applicable", "skipped"))


def test_missing_data_path_is_one_line_and_exit_2(capsys, tmp_path):
    code, out, err = run(capsys, "tune", "--model", "small_cnn", "--data", str(tmp_path / "nope"), "--no-progress")
    assert code == 2 and out == "" and "no data set at" in err and len(err.strip().splitlines()) == 1


def test_steps_flag_reaches_the_tune_and_a_bad_value_is_one_line(capsys):
    """`--steps N` is the run length compile must pay back within; 0 is a one-line error, exit 2."""
    from torch_tricks.cli import main

    assert main(["tune", "--model", "mlp", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "steps" in err[0] and ">= 1" in err[0]


# -- one model, every command: tricks.toml records the model, train --config trains it (issue 34) ------

GPT2_CFG = "n_layer=2,n_embd=64,n_head=2,vocab_size=256,n_positions=64"


@pytest.fixture(scope="module")
def gpt2_tuned(tmp_path_factory):
    """One GPT-2 tune for the module, and a token file of the tuned vocabulary. The recommendation is not what
    these tests check (the [model] table, the files, train --config on whatever [train] holds), so the budget is
    small (6 s, as test_integrations_hf's GPT-2 tune) and compile, ema and deterministic are left out (a 15 s
    budget on 2 cores skipped them anyway)."""
    pytest.importorskip("transformers")
    import numpy as np

    root = tmp_path_factory.mktemp("gpt2")
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        code = main(["tune", "--model", "hf:gpt2", "--hf-config", GPT2_CFG, "--input", "input_ids=long:32:256",
                     "--batch", "4", "--budget-seconds", "6", "--out", str(root / "d"), "--no-progress",
                     *(a for t in ("compile", "ema", "deterministic") for a in ("--skip", t))])
    assert code == 0, err.getvalue()
    np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16).tofile(root / "tokens.bin")
    return root


def _error_line(capsys, *argv) -> str:
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("torch-tricks: error: "), err
    return lines[0]


def test_tricks_toml_records_the_model_the_tune_ran_on(gpt2_tuned, tuned_dir):
    data = tomllib.loads((gpt2_tuned / "d" / "tricks.toml").read_text())
    assert data["model"] == {"spec": "hf:gpt2", "hf_config": GPT2_CFG, "input": ["input_ids=long:32:256"],
                             "batch": 4, "device": "cpu"}
    assert json.loads((gpt2_tuned / "d" / "report.json").read_text())["model_record"] == data["model"]
    assert tomllib.loads((gpt2_tuned / "d" / "tricks-largest-batch.toml").read_text())["model"] == data["model"]
    out, _, _ = tuned_dir  # a built-in model without --input: its default input is recorded
    assert tomllib.loads((out / "tricks.toml").read_text())["model"] == {"spec": "small_cnn", "input": ["1x8x8"],
                                                                        "batch": 32, "device": "cpu"}


def test_train_config_trains_the_recorded_gpt2_on_token_data(gpt2_tuned, capsys):
    toml = str(gpt2_tuned / "d" / "tricks.toml")
    tokens = str(gpt2_tuned / "tokens.bin")
    code, text, err = run(capsys, "train", "--config", toml, "--data", tokens, "--max-steps", "20", "--no-progress",
                          "--out", str(gpt2_tuned / "history.json"))
    assert code == 0, err
    assert text.splitlines()[0].startswith(f"hf:gpt2 on {tokens}: 20 steps"), text
    history = json.loads((gpt2_tuned / "history.json").read_text())
    recommended = tomllib.loads((gpt2_tuned / "d" / "tricks.toml").read_text())["train"]
    assert all(history["config"][k] == v for k, v in recommended.items())
    assert history["config"]["batch_size"] == recommended.get("batch_size", 4)  # else the batch the tune ran
    # a 256-token LM on uniform random tokens: its loss stays near ln 256 = 5.55 (digits' 10 classes: ln 10 = 2.3)
    assert 5.0 < history["final"]["train_loss"] < 6.2, history["final"]


def test_train_config_of_a_token_model_without_data_is_one_line(gpt2_tuned, capsys):
    line = _error_line(capsys, "train", "--config", str(gpt2_tuned / "d" / "tricks.toml"), "--max-steps", "1")
    assert "model hf:gpt2 trains on token data: give --data TOKENS, a 1-D token file: FILE.bin of uint16" in line


def test_model_on_the_command_line_wins_and_a_recorded_image_model_takes_digits(tuned_dir, gpt2_tuned, capsys):
    code, text, err = run(capsys, "train", "--config", str(gpt2_tuned / "d" / "tricks.toml"), "--model",
                          "small_cnn", "--max-steps", "1", "--no-progress")
    assert code == 0 and text.startswith("small_cnn on digits: 1 steps"), err
    out, _, _ = tuned_dir
    code, text, err = run(capsys, "train", "--config", str(out / "tricks.toml"), "--max-steps", "1", "--no-progress")
    assert code == 0 and text.startswith("small_cnn on digits: 1 steps"), err  # recorded, and digits fit it


def _with_model(gpt2_tuned, name, table_lines):
    """The tune's tricks.toml with its [model] table replaced by ``table_lines``."""
    text = (gpt2_tuned / "d" / "tricks.toml").read_text()
    head = text[: text.index("\n# the model the tune measured")]
    path = gpt2_tuned / name
    path.write_text(head + "\n" + "\n".join(table_lines) + "\n")
    return str(path)


def _bad_token_files(root):
    import numpy as np

    np.save(root / "two_d.npy", np.zeros((4, 64), dtype=np.int64))
    np.arange(10, dtype=np.uint16).tofile(root / "short.bin")
    np.arange(1000, dtype=np.uint16).tofile(root / "big_ids.bin")


@pytest.mark.parametrize("extra,needle", [
    (["--data", "two_d.npy"], "token file two_d.npy holds a 2-D array of shape (4, 64): token ids must be 1-D"),
    (["--data", "tokens.bin:int8"], "unknown token dtype 'int8'"),
    (["--data", "short.bin"], "token file short.bin holds 10 tokens, fewer than one sequence of --seq 32"),
    (["--data", "big_ids.bin"], "holds the id 999, but the model's vocabulary has 256 ids"),
    (["--data", "tokens.bin", "--seq", "65"], "--seq 65 is longer than hf:gpt2's 64 positions"),
    (["--data", "digits"], "--data digits holds images, and hf:gpt2 trains on token ids: give --data TOKENS"),
    (["--data", "tokens.bin", "--model", "small_cnn"],
     "is token data, for a transformers causal LM (e.g. --model hf:gpt2); small_cnn (SmallCNN) is not one"),
    (["--data", "nope"], "unknown --data 'nope': a built-in data set (digits), or a 1-D token file"),
])
def test_token_data_that_does_not_fit_is_one_line(gpt2_tuned, capsys, monkeypatch, extra, needle):
    _bad_token_files(gpt2_tuned)
    monkeypatch.chdir(gpt2_tuned)
    line = _error_line(capsys, "train", "--config", "d/tricks.toml", "--max-steps", "1", "--no-progress", *extra)
    assert needle in line, line


def test_a_recorded_model_that_cannot_be_built_here_is_one_line(gpt2_tuned, capsys, monkeypatch):
    import sys

    from torch_tricks.tuning.record import model_table

    missing = _with_model(gpt2_tuned, "mypkg.toml", ["[model]", 'spec = "mypkg.nets:build"', 'input = ["1x8x8"]'])
    line = _error_line(capsys, "train", "--config", missing, "--max-steps", "1")
    assert "mypkg.toml's [model] mypkg.nets:build cannot be built here: cannot import 'mypkg.nets'" in line, line
    assert line.endswith("(or give --model)")
    python = _with_model(gpt2_tuned, "python.toml", model_table(None, "MyNet"))
    line = _error_line(capsys, "train", "--config", python, "--max-steps", "1")
    assert "python.toml was tuned from Python and does not name a model this command can build: give --model" in line
    other = _with_model(gpt2_tuned, "resnet.toml", ["[model]", 'spec = "resnet18"', 'input = ["3x224x224"]'])
    line = _error_line(capsys, "train", "--config", other, "--max-steps", "1")
    assert "resnet18 takes 3x224x224 inputs, which no built-in data set holds (digits: 1x8x8 images)" in line
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    line = _error_line(capsys, "train", "--config", str(gpt2_tuned / "d" / "tricks.toml"), "--data",
                       str(gpt2_tuned / "tokens.bin"), "--max-steps", "1")
    assert "[model] hf:gpt2 cannot be built here: hf: models needs transformers: pip install" in line, line


def test_a_fit_seq_tune_records_the_sequence_it_ran():
    from torch_tricks.cli.cmd_train import _as_run

    assert _as_run(["input_ids=long:32:256"], [[32]]) == ["input_ids=long:32:256"]  # as given
    assert _as_run(["input_ids=long:32:256", "attention_mask=ones:32"], [[128], [128]]) == \
        ["input_ids=int64:128:256", "attention_mask=ones:128"]  # --fit seq=128 ran 128 tokens


# -- --threads: the tune's intra-op threads, checked against the cores here (issue 35) -------------------

@pytest.mark.parametrize("n", ["0", "999", "-2"])
def test_tune_threads_outside_the_cores_is_one_line_and_exit_2(capsys, n):
    import torch

    from torch_tricks.machine import available_cores

    before = torch.get_num_threads()
    code, out, err = run(capsys, "tune", "--model", "mlp", "--threads", n, "--no-progress")
    cores = available_cores()
    span = "1" if cores == 1 else f"1 to {cores}"
    assert code == 2 and out == "" and torch.get_num_threads() == before
    assert err.strip().splitlines() == [f"torch-tricks: error: --threads {n}: give {span}, the cores this process may "
                                        "use"]


def test_tune_threads_are_set_before_the_tune_starts(capsys):
    """A valid --threads is the process's thread count when the tune begins (here the tune's own first check, a bad
    --steps, stops it at once: the thread count was set before)."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not 1 already (one thread per xdist worker): --threads must change it
        code, _, err = run(capsys, "tune", "--model", "mlp", "--threads", "1", "--steps", "0", "--no-progress")
        assert code == 2 and "steps" in err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n,needle", [("999", "threads = 999: give 1"), ("-1", "threads must be >= 0")])
def test_train_threads_outside_the_cores_is_one_line_and_exit_2(capsys, n, needle):
    code, out, err = run(capsys, "train", "--model", "small_cnn", "--data", "digits", "--max-steps", "1",
                         "--threads", n, "--no-progress")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and needle in lines[0], err


def test_train_threads_runs_at_that_count(capsys):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not 1 already (one thread per xdist worker): --threads must change it
        code, text, err = run(capsys, "train", "--model", "small_cnn", "--data", "digits", "--max-steps", "2",
                              "--threads", "1", "--no-progress", "--json")
        assert code == 0, err
        assert json.loads(text)["config"]["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
