"""The training loop: accuracy on a real data set, accumulation, NaN guard, OOM retry,
kill-and-resume, config files. Distributed equivalence lives in test_train_fit_ddp.py."""

import contextlib
import csv
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.train import TrainConfig, TrainingDiverged, fit, load_config

pytest.importorskip("sklearn", reason="the digits data set ships with scikit-learn ([dev] installs it)")

QUIET = dict(progress=False, device="cpu")


def digits():
    from torch_tricks.data import load_dataset

    return load_dataset("digits")


def test_small_cnn_learns_digits():
    train, val = digits()
    h = fit(get_model("small_cnn"), train, val, config=TrainConfig(**QUIET))
    assert h.final["acc"] >= 0.97, h.final
    assert h.steps == h.epochs * 23  # 1438 samples / 64 per batch = 23 batches per epoch


def test_small_cnn_learns_digits_with_tricks():
    train, val = digits()
    h = fit(get_model("small_cnn"), train, val,
            config=TrainConfig(precision="bf16", ema=True, accumulate=2, checkpointing="blocks", **QUIET))
    assert h.final["acc"] >= 0.97 and h.final["acc_ema"] >= 0.97, h.final
    assert {"ema", "precision=bf16"} <= set(h.applied) and any(a.startswith("checkpointing") for a in h.applied)
    assert h.steps == h.epochs * 12  # 23 batches in groups of 2: the short last group is flushed


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def _batches(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def _cat(batches):
    return [(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))]


@pytest.mark.parametrize("sizes,k", [([8, 8, 8, 8], 4), ([8, 8, 8, 8, 5], 2), ([3, 9, 4], 3)])
def test_accumulation_equals_one_large_batch(sizes, k):
    """k micro-batches (unequal sizes included, short last group flushed) == one k-times batch."""
    batches = _batches(sizes)
    cfg = TrainConfig(epochs=1, optimizer="sgd", lr=0.1, momentum=0.0, **QUIET)
    accumulated = _mlp()
    fit(accumulated, batches, config=cfg.replace(accumulate=k))
    reference = _mlp()
    groups = [batches[i:i + k] for i in range(0, len(batches), k)]
    fit(reference, [b for g in groups for b in _cat(g)], config=cfg)
    for p, q in zip(accumulated.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_nan_at_step_k_stops_naming_step_k(tmp_path):
    calls = {"n": 0}
    ce = nn.CrossEntropyLoss()

    def loss_fn(out, y):
        calls["n"] += 1
        loss = ce(out, y)
        return loss * float("nan") if calls["n"] == 5 else loss

    cfg = TrainConfig(epochs=1, optimizer="sgd", checkpoint_dir=str(tmp_path), checkpoint_every=2, **QUIET)
    with pytest.raises(TrainingDiverged) as err:
        fit(_mlp(), _batches([4] * 8), loss_fn=loss_fn, config=cfg)
    msg = str(err.value)
    assert "at step 5" in msg and "nan" in msg
    assert f"{tmp_path / 'last.pt'} (step 4)" in msg
    assert isinstance(err.value, UserError) and "\n" not in msg


class OOMAbove(nn.Module):
    """Raises an out-of-memory error for micro-batches above ``limit`` samples."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.net = _mlp()

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.net(x)


def test_out_of_memory_halves_micro_batch_and_keeps_the_update():
    batches = _batches([16, 16, 16])
    cfg = TrainConfig(epochs=1, optimizer="sgd", lr=0.1, momentum=0.0, **QUIET)
    model = OOMAbove(limit=4)
    h = fit(model, batches, config=cfg.replace(auto_micro_batch=True))
    assert h.micro_batches == 4 and h.steps == 3
    reference = _mlp()
    fit(reference, batches, config=cfg)
    for p, q in zip(model.net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    with pytest.raises(UserError, match="out of memory at step 1"):
        fit(OOMAbove(limit=4), batches, config=cfg)


def _train_rows(log_dir):
    with open(Path(log_dir) / "metrics.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"}


def _cli(*args):
    return [sys.executable, "-m", "torch_tricks.cli", "train", "--model", "small_cnn", "--data", "digits",
            "--optimizer", "sgd", "--lr", "0.05", "--log-every", "1", "--no-progress", "--device", "cpu", *args]


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    steps = 60
    full, part = tmp_path / "full", tmp_path / "part"
    from torch_tricks.cli import main

    with contextlib.redirect_stdout(io.StringIO()):  # the uninterrupted run needs no process of its own
        assert main(_cli("--max-steps", str(steps), "--log-dir", str(full))[3:]) == 0
    expected = _train_rows(full)
    assert len(expected) == steps

    # the killed and the resumed run take this process's thread count: CPU sums split over another number of
    # threads round differently, and a test may have changed this process's (a 16-core GPU machine's suite run
    # had the resumed losses off by 1e-3 from the first step compared)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen(_cli("--max-steps", str(steps), "--log-dir", str(part), "--checkpoint-dir", str(part),
                                 "--checkpoint-every", "1"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    deadline = time.time() + 240
    while time.time() < deadline:
        if (part / "metrics.csv").exists() and len(_train_rows(part)) >= 25:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    from torch_tricks.train.checkpoint import latest_checkpoint, load_checkpoint

    assert latest_checkpoint(part) == part / "last.pt"
    report = load_checkpoint(part / "last.pt")  # never corrupt, whenever the kill landed
    assert 20 <= report.step < steps  # the kill may land between a step and its save

    resumed = subprocess.run(_cli("--max-steps", str(steps), "--log-dir", str(part), "--checkpoint-dir", str(part),
                                  "--checkpoint-every", "1", "--resume", "--out", str(tmp_path / "h.json")),
                             check=True, timeout=300, capture_output=True, text=True, env=env)
    import json

    history = json.loads((tmp_path / "h.json").read_text())
    start = history["resumed_from_step"]
    assert start == report.step
    after = {r["step"]: r["loss"] for r in history["rows"] if r.get("split") == "train"}
    assert sorted(after) == list(range(start + 1, steps + 1))
    for step, loss in after.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    assert resumed.returncode == 0


def test_config_file_keys_equal_flags(tmp_path):
    toml = tmp_path / "tricks.toml"
    toml.write_text('[train]\nprecision = "bf16"\naccumulate = 2\nema = true\ncheckpointing = "blocks"\nlr = 0.002\n')
    cfg = TrainConfig.from_dict(load_config(toml))
    assert (cfg.precision, cfg.accumulate, cfg.ema, cfg.checkpointing, cfg.lr) == ("bf16", 2, True, "blocks", 0.002)
    bad = tmp_path / "bad.toml"
    bad.write_text("acumulate = 2\n")
    with pytest.raises(UserError, match="unknown training option 'acumulate'"):
        load_config(bad)
    with pytest.raises(UserError, match="must be int"):
        TrainConfig().replace(accumulate="two")
    with pytest.raises(UserError, match="precision must be"):
        TrainConfig(precision="fp8").validate()


def test_cli_train_bad_config_exits_2(tmp_path, capsys):
    from torch_tricks.cli import main

    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_fp16_step_skipped_by_scaler_does_not_step_the_scheduler():
    from torch_tricks.train.precision import check_precision

    try:
        check_precision("fp16", "cpu")
    except UserError as exc:
        pytest.skip(f"fp16 cannot run on this CPU torch: {exc}")
    calls = {"n": 0}
    ce = nn.CrossEntropyLoss()

    def loss_fn(out, y):
        calls["n"] += 1
        loss = ce(out.float(), y)
        return loss * float("inf") if calls["n"] == 3 else loss  # inf gradients at step 3

    cfg = TrainConfig(epochs=1, optimizer="sgd", lr=0.1, precision="fp16", schedule="linear", log_every=1, **QUIET)
    h = fit(_mlp(), _batches([4] * 6), loss_fn=loss_fn, config=cfg)
    assert h.skipped_steps == 1 and h.steps == 6
    lrs = [r["lr"] for r in h.rows if r["split"] == "train"]
    assert lrs[2] == lrs[1]  # the skipped step left the schedule where it was
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))  # the others moved it on


# --------------------------------------------------------------------------- runs you can recover (issue 16)


def _losses(h):
    return {r["step"]: r["loss"] for r in h.rows if r["split"] == "train"}


def _files(d):
    return sorted(p.name for p in Path(d).iterdir())


def test_resume_over_a_damaged_last_pt_falls_back_to_the_previous_checkpoint(tmp_path):
    """fit(resume=True): last.pt truncated after the run; the checkpoint kept before it resumes, to the losses
    of the uninterrupted run (rel 1e-5), and one warning (also in History.notes) says so."""
    batches = _batches([4] * 8)
    base = dict(epochs=2, optimizer="adamw", lr=0.01, log_every=1, **QUIET)
    full = fit(_mlp(), batches, config=TrainConfig(**base))
    expected = _losses(full)
    assert sorted(expected) == list(range(1, 17))

    ck = tmp_path / "ck"
    saving = dict(checkpoint_dir=str(ck), checkpoint_every=1)
    fit(_mlp(), batches, config=TrainConfig(**base, **saving, max_steps=6))
    assert _files(ck) == ["last.pt", "last.step-00000005.pt"]  # keep_checkpoints=2 by default, no temp files
    data = (ck / "last.pt").read_bytes()
    (ck / "last.pt").write_bytes(data[: len(data) // 3])

    with pytest.warns(UserWarning) as caught:
        h = fit(_mlp(), batches, config=TrainConfig(**base, **saving, resume=True))
    lines = [str(w.message) for w in caught if "resume:" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"{ck / 'last.pt'} is corrupt or truncated" in lines[0]
    assert f"{ck / 'last.step-00000005.pt'} (step 5)" in lines[0]
    assert h.notes == lines and h.resumed_from_step == 5 and h.resumed_from == str(ck / "last.step-00000005.pt")
    after = _losses(h)
    assert sorted(after) == list(range(6, 17))
    for step, loss in after.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    assert _files(ck) == ["last.pt", "last.step-00000015.pt"]  # the damaged file was replaced, not kept

    for name in _files(ck):  # nothing loads: the one-line error of before, naming what to do
        (ck / name).write_bytes((ck / name).read_bytes()[:200])
    with pytest.raises(UserError) as err:
        fit(_mlp(), batches, config=TrainConfig(**base, **saving, resume=True))
    msg = str(err.value)
    assert "\n" not in msg and "corrupt or truncated" in msg and "use another checkpoint" in msg, msg


def test_cli_resume_over_a_damaged_last_pt_falls_back(tmp_path):
    """torch-tricks train --resume (main([...]) in this process), --keep-checkpoints 3: last.pt truncated, the
    run resumes from the newest kept checkpoint and ends with the uninterrupted run's losses (rel 1e-5)."""
    import json

    from torch_tricks.cli import main

    def train(*args):
        flags = ["train", "--model", "small_cnn", "--data", "digits", "--optimizer", "sgd", "--lr", "0.05",
                 "--log-every", "1", "--no-progress", "--device", "cpu", *args]
        assert main(flags) == 0

    train("--max-steps", "12", "--out", str(tmp_path / "full.json"))
    expected = _losses_json(tmp_path / "full.json")
    ck = tmp_path / "ck"
    train("--max-steps", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--keep-checkpoints", "3")
    assert _files(ck) == ["last.pt", "last.step-00000006.pt", "last.step-00000007.pt"]
    (ck / "last.pt").write_bytes((ck / "last.pt").read_bytes()[:4096])

    with pytest.warns(UserWarning, match=r"resume: checkpoint .*last\.pt is corrupt or truncated .*"
                                         r"last\.step-00000007\.pt \(step 7\)"):
        train("--max-steps", "12", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--resume",
              "--out", str(tmp_path / "resumed.json"))
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed["resumed_from_step"] == 7 and len(resumed["notes"]) == 1
    after = _losses_json(tmp_path / "resumed.json")
    assert sorted(after) == list(range(8, 13))
    for step, loss in after.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    assert resumed["final"]["train_loss"] == pytest.approx(expected[12], rel=1e-5)


def _losses_json(path):
    import json

    return {r["step"]: r["loss"] for r in json.loads(Path(path).read_text())["rows"] if r.get("split") == "train"}


def test_history_final_has_the_train_loss_with_and_without_validation_data(tmp_path):
    batches = _batches([4] * 8)
    per_step = _losses(fit(_mlp(), batches, config=TrainConfig(epochs=1, optimizer="sgd", log_every=1, **QUIET)))

    h = fit(_mlp(), batches, config=TrainConfig(epochs=1, optimizer="sgd", log_every=3, **QUIET))
    assert set(h.final) == {"train_loss"}  # no validation data: still the last training loss
    assert h.final["train_loss"] == pytest.approx(sum(per_step[s] for s in (6, 7, 8)) / 3, rel=1e-5)  # last 3 steps

    val = _batches([5, 5], seed=2)
    h = fit(_mlp(), batches, val, config=TrainConfig(epochs=1, optimizer="sgd", log_every=4, **QUIET))
    last_val = [r for r in h.rows if r["split"] == "val"][-1]
    assert set(h.final) == {"train_loss", "loss", "acc"}
    assert h.final["loss"] == last_val["loss"] and h.final["acc"] == last_val["acc"]
    assert h.final["train_loss"] == pytest.approx(_losses(h)[8], rel=1e-5)  # the last logged window, steps 5-8

    # the window is carried across a resume: stopped at step 6, resumed, the same final train_loss
    cfg = TrainConfig(epochs=1, optimizer="sgd", log_every=4, checkpoint_dir=str(tmp_path), **QUIET)
    fit(_mlp(), batches, val, config=cfg.replace(max_steps=6))
    h2 = fit(_mlp(), batches, val, config=cfg.replace(resume=True))
    assert h2.resumed_from_step == 6 and h2.final["train_loss"] == pytest.approx(h.final["train_loss"], rel=1e-5)


def test_the_cli_prints_the_historys_own_text(tmp_path, monkeypatch, capsys):
    """``torch-tricks train`` prints History.to_text(--model, --data) (and --json its to_dict())."""
    import json

    import torch_tricks.train as T
    from torch_tricks.cli import main

    real, histories = T.fit, []
    monkeypatch.setattr(T, "fit", lambda *a, **k: histories.append(real(*a, **k)) or histories[-1])
    assert main(["train", "--model", "small_cnn", "--data", "digits", "--max-steps", "2", "--no-progress",
                 "--checkpoint-dir", str(tmp_path)]) == 0
    h = histories[-1]
    text = h.to_text("small_cnn", "digits")
    assert capsys.readouterr().out == text + "\n"
    assert text.startswith("small_cnn on digits: 2 steps, 1 epochs in ")
    assert "\nfinal validation: loss " in text and text.endswith(f"\ncheckpoint: {h.checkpoint}")
    assert main(["train", "--model", "small_cnn", "--data", "digits", "--max-steps", "1", "--no-progress",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == histories[-1].to_dict()["steps"] == 1


def test_history_text_lists_skipped_steps_compile_time_and_checkpoint():
    from torch_tricks.train import History

    h = History(steps=300, epochs=3, wall_s=42.25, applied=["ema", "precision=fp16"], skipped_steps=2,
                compile_s=9.96, step_s=0.0123, checkpoint="ck/last.pt",
                final={"train_loss": 0.5, "loss": 0.25, "acc": 0.9})
    assert h.to_text("net", "cifar") == "\n".join([
        "net on cifar: 300 steps, 3 epochs in 42.2 s (switches: ema, precision=fp16)",
        "final training loss: 0.5000 (mean of the last logged steps)",
        "final validation: loss 0.2500, acc 0.9000",
        "fp16 steps skipped by the grad scaler: 2",
        "compile: 10.0 s (apart from the 12.3 ms steps)",
        "checkpoint: ck/last.pt",
    ])
    assert History().to_text() == "model on data: 0 steps, 0 epochs in 0.0 s"


# -- a list of per-sample dicts, as the transformers Trainer takes them (issue 34) -------------------

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _gpt2():
    pytest.importorskip("transformers")
    from torch_tricks.models import load_model

    torch.manual_seed(0)
    return load_model("hf:gpt2", hf_config=GPT2)[0]


def _samples(n=8, length=16):
    ids = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def test_fit_collates_per_sample_dicts_into_batches_with_the_update_of_the_stacked_batch():
    samples = _samples()
    cfg = TrainConfig(epochs=1, batch_size=8, optimizer="sgd", lr=0.1, log_every=1, **QUIET)
    per_sample, stacked, start = _gpt2(), _gpt2(), _gpt2()
    h = fit(per_sample, samples, config=cfg)
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    h_ref = fit(stacked, [batch], config=cfg)
    assert h.steps == h_ref.steps == 1
    assert h.final["train_loss"] == pytest.approx(h_ref.final["train_loss"], rel=1e-5)  # the batch's rows permuted
    for (n, a), b, p0 in zip(per_sample.named_parameters(), stacked.parameters(), start.parameters()):
        delta, ref = (a - p0).detach(), (b - p0).detach()
        assert (delta - ref).norm() <= 1e-4 * ref.norm() + 1e-8, n


def test_fit_takes_samples_of_lists_as_of_tensors_and_batches_them_by_batch_size():
    samples = _samples()
    as_lists = [{k: v.tolist() for k, v in s.items()} for s in samples]
    cfg = TrainConfig(epochs=1, batch_size=4, log_every=1, **QUIET)
    h_tensors, h_lists = fit(_gpt2(), samples, config=cfg), fit(_gpt2(), as_lists, config=cfg)
    assert h_tensors.steps == h_lists.steps == 2  # 8 samples in batches of 4
    assert [r["loss"] for r in h_tensors.rows] == [r["loss"] for r in h_lists.rows]


@pytest.mark.parametrize("broken,needle", [
    (lambda s: s[:3] + [{"input_ids": s[3]["input_ids"][:10], "labels": s[3]["labels"][:10]}],
     "sample 3's 'input_ids' has shape (10,), sample 0's (16,): samples of unequal length do not stack into a "
     "batch; pad them to one length, or pass a DataLoader with a collate_fn that pads"),
    (lambda s: s[:2] + [{"input_ids": s[2]["input_ids"]}], "sample 2 has the keys input_ids, sample 0 input_ids, "
                                                          "labels: give every sample the same keys"),
    (lambda s: s[:1] + [(s[1]["input_ids"], s[1]["labels"])], "item 1 of the data is a tuple"),
    (lambda s: [{"input_ids": [1, 2, 3], "labels": [1, 2]}, {"input_ids": [[1], [2, 3]], "labels": [1, 2]}],
     "sample 1's 'input_ids' is a list that does not make a tensor"),
])
def test_samples_that_do_not_collate_are_one_line(broken, needle):
    with pytest.raises(UserError) as err:
        fit(_gpt2(), broken(_samples()), config=TrainConfig(epochs=1, batch_size=4, **QUIET))
    assert needle in str(err.value) and "\n" not in str(err.value), err.value
