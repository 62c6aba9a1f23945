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
    head = text.splitlines()[0].split()
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
    assert data["inputs"] == [[784]] and data["recommended"]["batch_size"] * data["recommended"]["accumulate"] == 16
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
