"""T29 low-precision optimizer state: torchao's 8-bit and 4-bit AdamW, and bf16 state rounded stochastically,
train a small GPT-2 for 50 steps within the tune's drift tolerance of fp32 AdamW, with the state bytes measured
to drop; bad use is one line. torchao compiles its step per parameter shape (tens of seconds with a cold
inductor cache on a CPU); the numerics are the same uncompiled, so these tests run under
``set_stance("force_eager")``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from torch_tricks.cli import main  # noqa: E402
from torch_tricks.errors import UserError  # noqa: E402
from torch_tricks.models import load_model  # noqa: E402
from torch_tricks.train import TrainConfig, Tricks  # noqa: E402
from torch_tricks.train.in_backward import optimizer_in_backward  # noqa: E402
from torch_tricks.train.optim_state import Bf16StateAdam, low_precision_state, state_bytes  # noqa: E402
from torch_tricks.tuning.tuner import DRIFT_TOLERANCE  # noqa: E402

GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 64, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture
def torchao():
    return pytest.importorskip("torchao.optim")


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
def test_low_bit_state_trains_within_the_drift_tolerance_of_fp32_adamw_and_holds_fewer_bytes(state, fp32_adamw,
                                                                                             torchao):
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


def test_bf16_state_trains_within_the_drift_tolerance_of_fp32_adamw_and_holds_half_the_bytes(fp32_adamw):
    ref, ref_tricks = fp32_adamw
    got, tricks = _train("bf16")
    assert "optimizer_state=bf16" in tricks.applied and type(tricks.optimizer) is Bf16StateAdam
    drift = max(abs(a - b) for a, b in zip(got, ref)) / ref[0]
    assert drift <= DRIFT_TOLERANCE["loss"], (drift, got[-5:], ref[-5:])
    assert got[-1] < 0.7 * got[0], got[-5:]
    moments = [s[k] for s in tricks.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.dtype == torch.bfloat16 for m in moments)
    params = sum(p.numel() for p in tricks.unwrapped_model.parameters())
    assert state_bytes(tricks.optimizer) <= 4 * params + 4 * len(tricks.optimizer.state)  # + a step count each
    assert state_bytes(ref_tricks.optimizer) >= 8 * params


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_bf16_state_makes_the_same_first_steps_as_torch_from_the_same_state(cls, device):
    """The update is computed in fp32 from the moments it read: the first step (zero moments, exact in bf16)
    equals torch's to fp32 rounding; later steps differ only by the stored moments' rounding."""
    torch.manual_seed(0)
    # 300,000 values: over one slice of Bf16StateAdam.SLICE, so the slices are stitched back
    w = torch.randn(300, 1000, device=device)
    grads = [torch.randn_like(w) for _ in range(3)]
    ref_p, p = nn_param(w), nn_param(w)
    ref = cls([ref_p], lr=1e-2, weight_decay=0.1, foreach=False)
    ours = low_precision_state(cls([p], lr=1e-2, weight_decay=0.1), "bf16")
    assert ours.param_groups[0]["decoupled"] is (cls is torch.optim.AdamW)
    for i, g in enumerate(grads):
        ref_p.grad, p.grad = g.clone(), g.clone()
        ref.step(), ours.step()
        if i == 0:
            torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)
        else:  # each stored moment within a bf16 step (2**-7) of torch's: the update within a percent
            torch.testing.assert_close(p - w, ref_p - w, rtol=2e-2, atol=2e-4)
    ref_m = ref.state[ref_p]["exp_avg"]
    err = ours.state[p]["exp_avg"].float() - ref_m
    assert err.abs().max() <= 2 ** -6 * ref_m.abs().max()  # within two bf16 steps of the largest moment
    assert abs(float(err.mean())) < 2e-5  # and unbiased: stochastic rounding, not truncation


def nn_param(w: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(w.clone())


def test_bf16_rounding_is_stochastic_and_unbiased():
    """A value between two bf16 neighbours is stored as one of them, as often as its distance says: the mean of
    many roundings is the value (round-to-nearest would always give the lower one here)."""
    opt = Bf16StateAdam([torch.nn.Parameter(torch.zeros(1))])
    x = torch.full((200_000,), 1 + 2 ** -10)  # bf16 neighbours: 1 and 1 + 2**-7
    out = torch.empty_like(x, dtype=torch.bfloat16)
    opt._store(out, x)
    assert set(out.float().unique().tolist()) == {1.0, 1 + 2 ** -7}
    assert abs(out.float().mean().item() - x[0].item()) < 2e-5  # 8 sigma of 200,000 draws
    neg = torch.empty_like(out)
    opt._store(neg, -x)
    assert set(neg.float().unique().tolist()) == {-1.0, -1 - 2 ** -7}
    assert torch.equal(torch.tensor([1.5, -3.0, 0.0]).to(torch.bfloat16).float(),
                       _stored(opt, torch.tensor([1.5, -3.0, 0.0])))  # exact values stay exact


def _stored(opt: Bf16StateAdam, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x, dtype=torch.bfloat16)
    opt._store(out, x)
    return out.float()


def test_bf16_state_steps_in_backward_as_adam_or_adamw():
    model = torch.nn.Linear(8, 4)
    inner = low_precision_state(torch.optim.Adam(model.parameters(), weight_decay=0.1), "bf16")
    opt = optimizer_in_backward(inner)
    assert all(type(o) is Bf16StateAdam and o.param_groups[0]["decoupled"] is False for o in opt.optimizers)
    before = model.weight.detach().clone()
    model(torch.randn(2, 8)).sum().backward()
    assert not torch.equal(model.weight, before) and model.weight.grad is None  # stepped, gradient freed


def test_a_saved_bf16_state_loads_back_as_it_was(tmp_path):
    _, tricks = _train("bf16", steps=3)
    tricks.save(tmp_path / "t.pt")
    fresh = Tricks(device="cpu", progress=False, nan_guard=False, lr=3e-3, weight_decay=0.01, optimizer_state="bf16")
    _, opt = fresh.prepare(_gpt2())
    fresh.load(tmp_path / "t.pt")
    saved, loaded = list(tricks.optimizer.state.values()), list(opt.state.values())
    assert len(loaded) == len(saved) > 0
    for a, b in zip(saved, loaded):
        assert b["exp_avg"].dtype == torch.bfloat16 and torch.equal(a["exp_avg"], b["exp_avg"])
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and float(a["step"]) == float(b["step"]) == 3


def test_the_tune_measures_bf16_state_and_says_why_not_8_or_4_bits():
    from torch_tricks.tuning.candidates import training_candidates

    model, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    cands, skipped = training_candidates(model, (x,), torch.device("cpu"), batch=2)
    (bf16,) = [c for c in cands if c.changes.get("optimizer_state")]
    assert bf16.changes == {"optimizer_state": "bf16"} and bf16.goal == "memory" and bf16.ids == ("T29",)
    low = {s.name: s.reason for s in skipped if s.name.startswith("low_precision_optimizer_state:")}
    assert set(low) == {"low_precision_optimizer_state:8bit", "low_precision_optimizer_state:4bit"}
    assert all("benchmarks/memory.py" in r or "needs torchao" in r for r in low.values()), low
    _, sgd = training_candidates(model, (x,), torch.device("cpu"), batch=2, optimizer="sgd")
    assert any(s.name == "low_precision_optimizer_state" and "the optimizer is sgd" in s.reason for s in sgd)
    _, own = training_candidates(model, (x,), torch.device("cpu"), batch=2, own_optimizer=True)
    assert any(s.name == "low_precision_optimizer_state" and "wrap it yourself" in s.reason for s in own)


def test_groups_and_settings_carry_over(torchao):
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
    with pytest.raises(UserError, match="has no amsgrad"):
        low_precision_state(torch.optim.AdamW(model.parameters(), amsgrad=True), "bf16")
    with pytest.raises(UserError, match="optimizer_state must be 8bit or 4bit or bf16"):
        low_precision_state(torch.optim.AdamW(model.parameters()), "2bit")
    with pytest.raises(UserError, match="optimizer_state = 8bit needs optimizer = adamw or adam"):
        TrainConfig(optimizer="sgd", optimizer_state="8bit").validate()
    with pytest.raises(UserError, match="has no maximize"):
        low_precision_state(torch.optim.AdamW(model.parameters(), maximize=True), "bf16")
    with pytest.raises(UserError, match="mix decoupled"):
        low_precision_state(torch.optim.Adam([{"params": [model.transformer.wte.weight]},
                                              {"params": [model.transformer.ln_f.weight],
                                               "decoupled_weight_decay": True}]), "bf16")
    stepped = torch.optim.AdamW(model.parameters())
    stepped.state[model.transformer.wte.weight]["step"] = torch.tensor(1.0)
    with pytest.raises(UserError, match="cannot carry over: convert it before its first step"):
        low_precision_state(stepped, "bf16")


def test_without_torchao_it_is_one_line_naming_the_install(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # an import of it now fails
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(UserError, match=r'optimizer_state = 8bit needs torchao.*pip install "torch-tricks\[deploy\]"'):
        low_precision_state(torch.optim.AdamW(copy.deepcopy(_gpt2()).parameters()), "8bit")
    code = main(["train", "--model", "mlp", "--max-steps", "1", "--optimizer-state", "8bit", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "needs torchao" in err, err


def test_a_saved_8bit_state_loads_back_as_it_was(tmp_path, torchao):
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


def test_extra_group_keys_carry_over_and_adams_decoupled_decay_is_adamw():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam([{"params": [model.weight], "name": "w"}, {"params": [model.bias], "name": "b"}],
                           lr=2e-3, weight_decay=0.1, decoupled_weight_decay=True)
    torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)  # sets each group's initial_lr
    low = low_precision_state(opt, "bf16")
    assert low.defaults["decoupled"] is True  # Adam(decoupled_weight_decay=True) steps as AdamW
    assert [(g["name"], g["initial_lr"]) for g in low.param_groups] == [("w", 2e-3), ("b", 2e-3)]
    assert not {"fused", "foreach", "maximize", "decoupled_weight_decay"} & set(low.param_groups[0])


def test_a_bf16_state_resumes_to_the_same_rounding():
    """The stochastic rounding's generator is part of the state: a loaded optimizer draws what the saved one
    would have, so its next steps are the same to the bit."""
    def run(opt, model, steps):
        for i in range(steps):
            model(torch.full((2, 8), float(i + 1))).square().sum().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = Bf16StateAdam(model.parameters(), lr=1e-2)
    run(opt, model, 2)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run(opt, model, 2)
    other = torch.nn.Linear(8, 4)
    other.load_state_dict(saved_model)
    resumed = Bf16StateAdam(other.parameters(), lr=1e-2)
    resumed.load_state_dict(saved)
    run(resumed, other, 2)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), resumed.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
