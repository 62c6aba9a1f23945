"""The tune's token phase (tuning.token_phase): T39-T41 measured on the user's rows, in real tokens a second."""

from __future__ import annotations

import pytest
import torch

from torch_tricks.tuning.report import TuneReport
from torch_tricks.tuning.token_phase import _decide, measure_token_batches

transformers = pytest.importorskip("transformers")


# the race's tricks left out: the largest batch is what this test needs of the tune, in time under load too
_ALL_BUT_THE_SEARCH = ("compile", "ema", "deterministic", "checkpointing", "optimizer_in_backward", "attention",
                       "fused_optimizer", "mixed_precision", "threads", "low_precision_optimizer_state",
                       "gradient_accumulation", "chunked_lm_loss")


def _gpt2(positions=128):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=positions, vocab_size=64,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, loss_type="ForCausalLM")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _rows(n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=gen) * 0.8 + 3.0).clamp(4, 128).long()
    return [{"input_ids": torch.randint(0, 64, (int(k),), generator=gen)} for k in lengths]


def test_every_way_is_measured_on_the_same_rows_and_padding_is_not_counted():
    rows = _rows()
    out = measure_token_batches(_gpt2(), rows, batch_size=4, device=torch.device("cpu"), seconds=5.0)
    assert out["status"] == "measured" and out["sample_rows"] == 16
    ways = {w["way"]: w for w in out["ways"]}
    assert set(ways) == {"max", "padded", "grouped", "packed"}
    assert all(w["status"] == "measured" for w in ways.values()), ways
    assert ways["max"]["real_share"] < ways["padded"]["real_share"] <= 1.0
    assert ways["packed"]["real_share"] > 0.8  # packed rows hold almost no padding
    assert ways["max"]["tokens_per_step"] == 4 * 128  # padded to the model's positions
    assert out["packing_leak"] < 1e-4 and out["noise"] is not None
    # the same rows at the same weights: the same per-token loss whichever way batched them (fp32 sums)
    assert all(w["loss_drift"] < 1e-5 for w in ways.values()), {k: w["loss_drift"] for k, w in ways.items()}
    assert ways["max"]["peak_bytes"] > ways["padded"]["peak_bytes"] > 0  # padding to the positions costs memory
    assert out["choice"] in ("padded", "grouped", "packed") and out["reason"]


def test_packing_is_refused_for_a_model_that_lets_packed_sequences_see_each_other(monkeypatch):
    import torch_tricks.tuning.token_phase as tp

    monkeypatch.setattr(tp, "packing_keywords", lambda model: {})  # the cache stays on: transformers ignores packing
    monkeypatch.setattr(tp, "_leak", lambda model, device: tp.packing_leak(model, vocab_size=64, keywords={}))
    out = measure_token_batches(_gpt2(), _rows(), batch_size=4, device=torch.device("cpu"), seconds=4.0)
    packed = next(w for w in out["ways"] if w["way"] == "packed")
    assert packed["status"] == "refused" and "attend to each other" in packed["reason"]
    assert out["choice"] != "packed"


def test_the_choice_needs_a_gain_beyond_the_noise():
    rows = [{"way": "max", "status": "measured", "real_tokens_per_s": 100.0},
            {"way": "padded", "status": "measured", "real_tokens_per_s": 200.0},
            {"way": "grouped", "status": "measured", "real_tokens_per_s": 206.0},
            {"way": "packed", "status": "measured", "real_tokens_per_s": 240.0}]
    times = {"max": [1.0, 1.0], "max (again)": [1.1, 1.1]}  # A/A: 9% noise
    assert _decide(rows, times, 0.02)["choice"] == "packed"
    rows[3]["real_tokens_per_s"] = 210.0  # 5%: inside the noise
    d = _decide(rows, times, 0.02)
    assert d["choice"] == "padded" and "no way beat padded beyond the noise" in d["reason"]


def test_the_choice_reaches_tricks_toml_and_the_report():
    report = TuneReport(model="gpt2", batch=4, device="cpu", optimizer="adamw", memory_limit=1 << 30,
                        memory_limit_source="given", budget_s=60.0)
    report.tokens = {"status": "measured", "sample_rows": 16, "real_tokens": 500, "choice": "packed",
                     "reason": "packed 1.80x the real tokens a second of padded (beyond the noise, 2%)",
                     "ways": [{"way": w, "status": "measured", "real_tokens_per_s": r, "real_share": 0.5,
                               "vs_max": r / 100, "tokens_per_step": 512}
                              for w, r in (("max", 100.0), ("padded", 150.0), ("grouped", 160.0), ("packed", 270.0))]}
    assert report.recommended_config()["token_batches"] == "packed"
    toml = report.tricks_toml()
    assert 'token_batches = "packed"' in toml and "# token_batches = packed: packed 1.80x" in toml.replace("#   ", "# ")
    text = "\n".join(report.summary_lines())
    assert "token batches (16 rows" in text and "token_batches = packed" in text
    report.tokens = {"status": "skipped", "reason": "over --budget-seconds"}
    assert "token_batches" not in report.recommended_config()


def test_cli_tune_on_a_token_set_tunes_the_longest_rows_and_writes_token_batches(tmp_path, monkeypatch, capsys):
    import json

    from torch_tricks.cli import main

    monkeypatch.chdir(tmp_path)
    with open("rows.jsonl", "w") as f:
        for r in _rows(40):
            f.write(json.dumps({"input_ids": r["input_ids"].tolist()}) + "\n")
    longest = max(len(r["input_ids"]) for r in _rows(40))
    code = main(["tune", "--model", "hf:gpt2", "--hf-config", "n_layer=1,n_embd=32,n_head=2,n_positions=128,"
                 "vocab_size=64", "--data", "rows.jsonl", "--batch", "4", "--budget-seconds", "20", "--no-progress",
                 "--out", "rep", "--threads", "1", *(a for name in _ALL_BUT_THE_SEARCH for a in ("--skip", name))])
    assert code == 0
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["inputs"][0][-1] == -(-longest // 8) * 8  # the batch of the longest rows, padded to x8
    assert any("longest rows" in n for n in report["notes"])
    assert report["tokens"]["status"] == "measured", report["tokens"]
    assert f'token_batches = "{report["tokens"]["choice"]}"' in (tmp_path / "rep" / "tricks.toml").read_text()
    assert "data: rows.jsonl" in capsys.readouterr().err


def test_the_largest_batch_found_on_the_longest_rows_fits_a_whole_epoch_in_its_worst_order():
    """Worst case first: tuned on the batch of the data's longest rows, the largest batch under the limit is then
    run afresh over every batch of an epoch, longest rows first; no step's measured peak is over the limit."""
    from torch_tricks import tune
    from torch_tricks.data.token_batches import TokenRowList, longest_batch, pad_collate
    from torch_tricks.tuning.measure import measure_memory

    rows = TokenRowList(_rows(96, seed=3))
    model = _gpt2()
    base = {"optimizer": "adamw", "lr": 1e-3, "fused_optimizer": False, "device": "cpu", "seed": 0}
    at4 = measure_memory(model, {**base, "batch_size": 4}, longest_batch(rows, 4), loss_fn=None, optimizer_fn=None)
    limit = int(at4.state_bytes + 3.5 * (at4.peak_bytes - at4.state_bytes))  # room for a few times the batch
    report = tune(model, longest_batch(rows, 4), data=rows, memory_limit=limit, budget_s=30, progress=False,
                  skip=_ALL_BUT_THE_SEARCH, threads=1)  # one thread: steady steps on a busy machine too
    best = report.best_batch
    assert best is not None and best.max_batch and best.max_batch >= 4, report.to_text()
    n = best.max_batch
    order = sorted(range(len(rows)), key=lambda i: -rows.lengths[i])  # the worst order: longest rows first
    config = {**base, **best.changes, "batch_size": n}
    peaks = [measure_memory(model, config, pad_collate()([rows[i] for i in order[s:s + n]]), loss_fn=None,
                            optimizer_fn=None, per_sample=False).peak_bytes for s in range(0, len(rows), n)]
    assert max(peaks) <= limit and peaks[0] == max(peaks), (peaks, limit)
