"""T33, fp32 matmuls in a faster mode (issue 36): when each mode can run (refused in one line where the hardware
would ignore it), the process's setting put back, the key through TrainConfig, Tricks, the CLI and the tune."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_tricks.train.matmul_mode as mm
from torch_tricks.errors import UserError
from torch_tricks.train import TrainConfig, Tricks


def _settings() -> tuple[str, ...]:
    b = torch.backends
    return (b.mkldnn.matmul.fp32_precision, b.mkldnn.conv.fp32_precision, b.cuda.matmul.fp32_precision,
            b.cudnn.conv.fp32_precision)


@pytest.fixture
def bf16_cpu(monkeypatch):
    """A CPU with bf16 units, as torch and oneDNN see it."""
    monkeypatch.setattr(mm, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


def test_each_mode_runs_only_where_the_hardware_has_it(monkeypatch, bf16_cpu):
    assert mm.fp32_matmul_support("ieee", "cpu") == (True, "")
    assert mm.fp32_matmul_support("bf16", "cpu") == (True, "")
    assert mm.fast_fp32_matmul_mode("cpu") == ("bf16", "")
    ok, why = mm.fp32_matmul_support("tf32", "cpu")
    assert not ok and "TF32 is a CUDA tensor-core format" in why and "\n" not in why
    ok, why = mm.fp32_matmul_support("bf16", "cuda")
    assert not ok and "tf32" in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the AVX2 kernels: oneDNN has no bf16 units to use
    ok, why = mm.fp32_matmul_support("bf16", "cpu")
    assert not ok and "held to AVX2" in why and "change nothing" in why
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(mm, "cpu_has_bf16", lambda: False)
    ok, why = mm.fp32_matmul_support("bf16", "cpu")
    assert not ok and "no AVX512-BF16 or AMX" in why
    assert mm.fast_fp32_matmul_mode("cpu") == (None, why)
    assert not mm.fp32_matmul_support("fast", "cpu")[0]


def test_the_context_sets_the_mode_and_puts_the_process_setting_back(bf16_cpu):
    before = _settings()
    with mm.fp32_matmul("bf16", "cpu"):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16" == torch.backends.mkldnn.conv.fp32_precision
        assert _settings()[2:] == before[2:]  # the CPU's switches only
    assert _settings() == before
    with mm.fp32_matmul("", "cpu"):  # "": the process's own, untouched
        assert _settings() == before
    with pytest.raises(UserError, match=r"^fp32_matmul = tf32: TF32 is a CUDA"):
        with mm.fp32_matmul("tf32", "cpu"):
            pass
    assert _settings() == before


def test_the_key_is_checked_by_the_config_and_applied_by_tricks(bf16_cpu):
    with pytest.raises(UserError, match="fp32_matmul must be ieee, tf32 or bf16"):
        TrainConfig(fp32_matmul="fast").validate()
    with pytest.raises(UserError, match="fp32_matmul = tf32: TF32 is a CUDA tensor-core format"):
        Tricks({"fp32_matmul": "tf32", "device": "cpu", "progress": False}).prepare(nn.Linear(4, 4))
    before = _settings()
    try:
        tricks = Tricks({"fp32_matmul": "bf16", "device": "cpu", "progress": False})
        tricks.prepare(nn.Linear(4, 4))
        assert "fp32_matmul=bf16" in tricks.applied
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # a setting of the process, as threads
    finally:
        mm._restore({"mkldnn.matmul": before[0], "mkldnn.conv": before[1]})


def test_tf32_on_a_cpu_is_one_line_and_exit_2(capsys, tmp_path):
    from torch_tricks.cli import main

    code = main(["train", "--model", "mlp", "--data", "digits", "--epochs", "1", "--device", "cpu",
                 "--fp32-matmul", "tf32", "--no-progress"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("torch-tricks: error:")]
    assert code == 2 and len(lines) == 1 and "fp32_matmul = tf32" in lines[0] and "Traceback" not in err, err


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.body(x)


def test_the_tune_skips_it_with_the_reason_where_the_mode_is_missing(monkeypatch):
    from torch_tricks.tuning import tune

    monkeypatch.setattr(mm, "cpu_has_bf16", lambda: False)
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    report = tune(_Net, batch, budget_s=6, progress=False, threads=1,
                  skip=["compile", "mixed_precision", "ema", "deterministic", "checkpointing", "fused_optimizer",
                        "gradient_accumulation", "low_precision_optimizer_state", "optimizer_in_backward"])
    row = next(s for s in report.skipped if s.name == "fp32_matmul")
    assert "no AVX512-BF16 or AMX" in row.reason and "T33" in row.ids


def test_the_tune_times_the_mode_in_its_own_lane_and_leaves_the_process_as_it_was(monkeypatch):
    """With the mode planted as available (ieee: the same numbers, so the drift is known), it is raced like
    any speed trick, and every lane's setting is its own: the process's is back after the tune."""
    import torch_tricks.tuning.candidates as cands
    from torch_tricks.tuning import tune

    monkeypatch.setattr(mm, "fast_fp32_matmul_mode", lambda dev: ("ieee", ""))
    monkeypatch.setattr(cands, "fast_fp32_matmul_mode", lambda dev: ("ieee", ""))
    before = _settings()
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    report = tune(_Net, batch, budget_s=8, progress=False, threads=1,
                  skip=["compile", "mixed_precision", "ema", "deterministic", "checkpointing", "fused_optimizer",
                        "gradient_accumulation", "low_precision_optimizer_state", "optimizer_in_backward"])
    row = next(r for r in report.results if r.name == "fp32_matmul:ieee")
    assert row.status == "measured" and row.ratio is not None and row.loss_drift == 0.0, row
    assert _settings() == before
    cfg = report.recommended_config()
    assert cfg.get("fp32_matmul", "") in ("", "ieee")  # decided: plain's ("") unless chosen
