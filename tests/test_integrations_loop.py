"""The tune's configuration in a loop of your own (issue 34): the printed lines run, and a run stopped after 4
optimizer steps and resumed from ``tricks.save`` reaches step 8 with the EMA, its update count and the lr at
every step equal to an uninterrupted run's (accumulation 2, a cosine schedule)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _trainer_data import assert_resumed_like, gpt2, lm_data  # noqa: E402
from torch_tricks.integrations import emit_lines  # noqa: E402
from torch_tricks.train import Tricks  # noqa: E402

CFG = {"ema": True, "ema_decay": 0.9, "accumulate": 2, "schedule": "cosine", "lr": 1e-2, "max_steps": 8,
       "device": "cpu", "progress": False}


def _run(stop_at: int = 0, resume: Path | None = None, save: Path | None = None):
    """8 optimizer steps over 16 micro-batches of 2; stops after ``stop_at`` steps, saving the Tricks' state."""
    tricks = Tricks(CFG)
    model, _ = tricks.prepare(gpt2())  # the configuration's AdamW, its cosine schedule over max_steps
    if resume is not None:
        tricks.load(resume)
    data = lm_data(32)
    lrs = []
    for i in range(2 * tricks.step_count, 16):  # the micro-batches a resumed run has not seen
        batch = {k: torch.stack([d[k] for d in data[2 * i:2 * i + 2]]) for k in ("input_ids", "labels")}
        with tricks.autocast():
            loss = model(**batch).loss
        tricks.backward(loss)
        if tricks.step():
            lrs.append(tricks.optimizer.param_groups[0]["lr"])
        if stop_at and tricks.step_count == stop_at:
            tricks.save(save)
            break
    return tricks, lrs


def test_stopped_and_resumed_the_ema_and_the_lr_equal_an_uninterrupted_run(tmp_path):
    whole, whole_lrs = _run()
    _, first = _run(stop_at=4, save=tmp_path / "state.pt")
    resumed, second = _run(resume=tmp_path / "state.pt")
    assert resumed.step_count == whole.step_count == 8
    assert_resumed_like(whole.ema, resumed.ema, whole_lrs, first, second)


def test_the_printed_loop_runs(tmp_path, run_script):
    toml = tmp_path / "tricks.toml"
    toml.write_text('[train]\naccumulate = 2\nema = true\n')
    lines = emit_lines(str(toml), "loop", source=str(toml))
    assert lines[2] == f"cfg = {str(toml)!r}"
    script = tmp_path / "loop.py"
    script.write_text("\n".join([
        "import sys", f"sys.path.insert(0, {str(Path(__file__).parent)!r})",
        "import torch",
        "from torch.utils.data import DataLoader",
        "from _trainer_data import gpt2, lm_data",
        "model, epochs = gpt2(), 1",
        "loader = DataLoader(lm_data(12), batch_size=2)",
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)",
        *lines,
        "print('steps', tricks.step_count, tricks.ema.num_updates)"]))
    run = run_script(script, cwd=tmp_path)  # as `python loop.py` in tmp_path (conftest.py)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "steps 3 3", run.stdout[-2000:]
