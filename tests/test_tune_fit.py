"""tune --fit (issue 21, T32): batch=N and seq=N tune at that size; seq runs the longest sequence that fits
for plain, the recommendation and the memory tricks together, and a fresh process confirms the stated length
fits (and the first one that did not, does not); bad targets are one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torch_tricks.cli import main
from torch_tricks.errors import UserError
from torch_tricks.tuning.fit import FitTarget, parse_fit, sequence_length, with_sequence_length

pytest.importorskip("transformers")

HF = "n_layer=2,n_embd=64,n_head=2,n_positions=1024,vocab_size=2000"
_SKIP = [a for t in ("compile", "ema", "deterministic", "optimizer_in_backward", "gradient_accumulation",
                     "fused_optimizer", "mixed_precision") for a in ("--skip", t)]


def test_targets_parse_and_bad_ones_say_what_to_give():
    assert parse_fit("seq") == FitTarget("seq") and parse_fit("seq").search_seq
    assert parse_fit("seq=256") == FitTarget("seq", 256) and parse_fit("batch=64") == FitTarget("batch", 64)
    for bad, needle in [("width=3", "give batch=N"), ("batch", "give batch=N"), ("seq=0", "whole number >= 1"),
                        ("seq=long", "whole number")]:
        with pytest.raises(UserError, match=needle):
            parse_fit(bad)


def test_a_token_batch_changes_length_with_its_mask_and_labels_in_step():
    ids = torch.arange(12).reshape(2, 6)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    longer = with_sequence_length(batch, 15)
    assert sequence_length(batch) == 6 and sequence_length(longer) == 15
    assert torch.equal(longer["input_ids"], longer["labels"]) and longer["attention_mask"].shape == (2, 15)
    assert torch.equal(longer["input_ids"][:, 6:12], ids)  # the ids repeat
    assert torch.equal(with_sequence_length(batch, 4)["input_ids"], ids[:, :4])
    assert sequence_length((torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))) is None  # an image batch


@pytest.mark.parametrize("argv,needle", [
    (["--model", "small_cnn", "--fit", "seq", "--memory-limit", "1GiB"], "not token ids of shape (batch, sequence)"),
    (["--model", "hf:gpt2", "--hf-config", HF, "--input", "input_ids=long:64:2000", "--fit", "seq"],
     "--fit seq searches the longest sequence under --memory-limit"),
    (["--model", "hf:gpt2", "--hf-config", HF, "--input", "input_ids=long:64:2000", "--fit", "seq=4096"],
     "the model has 1024 positions"),
    (["--model", "small_cnn", "--fit", "depth=2"], "give batch=N"),
])
def test_bad_fit_targets_are_one_line_and_exit_2(capsys, argv, needle):
    code = main(["tune", "--no-progress", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_fit_batch_tunes_at_that_batch(capsys):
    code = main(["tune", "--model", "mlp", "--batch", "16", "--fit", "batch=24", "--budget-seconds", "6", "--json",
                 "--no-progress", *_SKIP])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["batch"] == 24


_FRESH = """
import json, sys
import torch
from torch_tricks.models import load_model
from torch_tricks.tuning.measure import measure_memory
cfg, lengths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
torch.manual_seed(0)
model = load_model("hf:gpt2", hf_config={"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 1024,
                                         "vocab_size": 2000})[0]
peaks = []
for t in lengths:
    ids = torch.randint(0, 2000, (4, t), generator=torch.Generator().manual_seed(1))
    peaks.append(measure_memory(model, cfg, {"input_ids": ids, "labels": ids}, loss_fn=None, optimizer_fn=None,
                                per_sample=False).peak_bytes)
print(json.dumps(peaks))
"""


def test_fit_seq_runs_the_longest_sequence_for_plain_and_the_memory_tricks(tmp_path, capsys):
    limit = 24 << 20
    code = main(["tune", "--model", "hf:gpt2", "--hf-config", HF, "--input", "input_ids=long:64:2000", "--batch", "4",
                 "--memory-limit", str(limit), "--fit", "seq", "--budget-seconds", "10", "--no-progress",
                 "--out", str(tmp_path), *_SKIP])
    text = capsys.readouterr().out
    assert code == 0
    line = next(x for x in text.splitlines() if x.startswith("longest sequence under the limit: plain "))
    report = json.loads((tmp_path / "report.json").read_text())
    plain = report["baseline"]
    together = next(r for r in report["results"] + report["combinations"] if r["name"] == report["best_batch"])
    assert plain["max_seq"] and together["max_seq"] and together["name"] != "plain"
    assert together["max_seq"] > plain["max_seq"] >= 64  # the memory tricks fit a longer context
    assert f"{together['max_seq'] / plain['max_seq']:.2f}x plain's" in line, line
    for row in (plain, together):  # each stated length was run: a fresh process measures it under the limit
        lengths = [row["max_seq"]] + ([row["max_seq_bound"]] if row["max_seq_bound"] else [])
        cfg = {"device": "cpu", "fused_optimizer": False, "seed": 0, "batch_size": 4, **row["changes"]}
        out = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(cfg), json.dumps(lengths)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks = json.loads(out.stdout.strip().splitlines()[-1])
        assert peaks[0] <= limit, (row["name"], peaks, limit)
        if len(peaks) > 1:
            assert peaks[1] > limit, (row["name"], peaks, limit)
