"""T29 low-precision optimizer state: torchao's 8-bit and 4-bit AdamW train a small GPT-2 for 50 steps
within the tune's drift tolerance of fp32 AdamW, with the state bytes measured to drop; bad use is one
line. torchao compiles its step per parameter shape (tens of seconds with a cold inductor cache on a
CPU); the numerics are the same uncompiled, so these tests run under ``set_stance("force_eager")``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchao.optim")

from torch_tricks.cli import main  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.models import load_model  # noqa: E402
from torch_tricks.train import TrainConfig, Tricks  # noqa: E402
from torch_tricks.train.optim_state import low_precision_state, state_bytes  # noqa: E402
from torch_tricks.tuning.tuner import DRIFT_TOLERANCE  # noqa: E402

GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 64, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture(autouse=True)
def _eager():
    with torch.compiler.set_stance("force_eager"):
        yield


def _gpt2():
    torch.manual_seed(0)
    return load_model("hf:gpt2", hf_config=GPT2)[0].train()


def _train(state: str, steps: int = 50) -> tuple[list[float], Tricks]:
    tricks = Tricks(device="cpu", progress=False, nan_guard=False, lr=3e-3, weight_decay=0.01, optimizer_state=state)
    model, opt = tricks.prepare(_gpt2())
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = _sequences(g)
        with tricks.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        tricks.backward(loss)
        tricks.step()
        losses.append(float(loss))
    return losses, tricks


def _sequences(g: torch.Generator, batch: int = 8, length: int = 32) -> torch.Tensor:
    """A new batch each step of a language with something to learn: each token follows from the one before
    (t -> 5t + 3 mod 512), one in ten replaced at random."""
    ids = torch.empty(batch, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, 512, (batch,), generator=g)
    for i in range(1, length):
        ids[:, i] = (5 * ids[:, i - 1] + 3) % 512
    noise = torch.rand(batch, length, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, 512, (batch, length), generator=g), ids)


@pytest.fixture(scope="module")
def fp32_adamw():
    """The reference run: fp32 AdamW state (once for the module)."""
    with torch.compiler.set_stance("force_eager"):
        return _train("")


@pytest.mark.parametrize("state", ["8bit", "4bit"])
def test_low_bit_state_trains_within_the_drift_tolerance_of_fp32_adamw_and_holds_fewer_bytes(state, fp32_adamw):
    ref, ref_tricks = fp32_adamw
    got, tricks = _train(state)
    assert f"optimizer_state={state}" in tricks.applied
    assert type(tricks.optimizer).__name__ == f"AdamW{state}"
    drift = max(abs(a - b) for a, b in zip(got, ref)) / ref[0]  # the tune's measure: over the first fp32 loss
    assert drift <= DRIFT_TOLERANCE["loss"], (drift, got[-5:], ref[-5:])
    assert ref[-1] < 0.7 * ref[0] and got[-1] < 0.7 * got[0], (got[-5:], ref[-5:])  # both learned
    fp32, low = state_bytes(ref_tricks.optimizer), state_bytes(tricks.optimizer)
    params = sum(p.numel() for p in tricks.unwrapped_model.parameters())
    assert fp32 >= 8 * params  # two fp32 moments a parameter
    assert low < (0.35 if state == "8bit" else 0.25) * fp32, (low, fp32)


def test_groups_and_settings_carry_over():
    model = _gpt2()
    opt = torch.optim.AdamW([{"params": [model.transformer.wte.weight], "weight_decay": 0.1, "lr": 2e-3},
                             {"params": [model.transformer.ln_f.weight], "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.8, 0.95), eps=1e-6)
    low = low_precision_state(opt, "4bit")
    assert [g["weight_decay"] for g in low.param_groups] == [0.1, 0.0]
    assert [float(g["lr"]) for g in low.param_groups] == pytest.approx([2e-3, 1e-3])
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in low.param_groups)
    assert [g["params"] for g in low.param_groups] == [g["params"] for g in opt.param_groups]


def test_bad_uses_are_one_line():
    model = _gpt2()
    with pytest.raises(UserError, match="needs Adam or AdamW.*not SGD"):
        low_precision_state(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UserError, match="optimizer_state must be 8bit or 4bit"):
        low_precision_state(torch.optim.AdamW(model.parameters()), "2bit")
    with pytest.raises(UserError, match="optimizer_state = 8bit needs optimizer = adamw or adam"):
        TrainConfig(optimizer="sgd", optimizer_state="8bit").validate()
    with pytest.raises(UserError, match="builds the optimizer on quantized state: pass prepare"):
        Tricks(device="cpu", optimizer_state="8bit").prepare(model, torch.optim.AdamW(model.parameters()))


def test_without_torchao_it_is_one_line_naming_the_install(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # an import of it now fails
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(UserError, match=r'optimizer_state = 8bit needs torchao.*pip install "torch-tricks\[deploy\]"'):
        low_precision_state(torch.optim.AdamW(copy.deepcopy(_gpt2()).parameters()), "8bit")
    code = main(["train", "--model", "mlp", "--max-steps", "1", "--optimizer-state", "8bit", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "needs torchao" in err, err


def test_a_saved_8bit_state_loads_back_as_it_was(tmp_path):
    _, tricks = _train("8bit", steps=3)
    tricks.save(tmp_path / "t.pt")
    fresh = Tricks(device="cpu", progress=False, nan_guard=False, lr=3e-3, weight_decay=0.01, optimizer_state="8bit")
    _, opt = fresh.prepare(_gpt2())
    fresh.load(tmp_path / "t.pt")  # weights_only: torchao's state classes are allowed globals
    assert fresh.step_count == 3
    saved = list(tricks.optimizer.state.values())
    loaded = list(opt.state.values())
    assert len(loaded) == len(saved) > 0
    quantized = 0
    for a, b in zip(saved, loaded):
        for key in ("exp_avg", "exp_avg_sq"):
            quantized += type(b[key]).__name__ == "OptimState8bit"
            torch.testing.assert_close(_values(b[key]), _values(a[key]), rtol=0, atol=0)
    assert quantized > 0


def _values(t: torch.Tensor) -> torch.Tensor:
    """A state tensor's values: a quantized one dequantized."""
    return t.dequantize() if type(t) is not torch.Tensor else t.float()
