"""``Tricks`` in a loop the user keeps: a nanoGPT-style loop, changed in at most 6 lines, trains
exactly as ``fit()`` does under the same config (fp32, bf16, accumulate=4, EMA, kill + resume)."""

from __future__ import annotations

import difflib
import inspect
import math
import textwrap
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks import Tricks
from torch_tricks.errors import UserError
from torch_tricks.train import fit
from torch_tricks.train.precision import precision_available

REL = 1e-5  # the loop and fit run the same ops in the same order: only float summation order may differ
VOCAB, T, B = 64, 16, 4


class TinyGPT(nn.Module):
    """nanoGPT's shape in miniature: forward(idx, targets=None) -> (logits, loss)."""

    def __init__(self, n_layer: int = 2, d: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, 2, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        x = self.blocks(self.wte(idx) + self.wpe(pos), mask=mask, is_causal=True)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def make_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches cycling over 4 distinct ones (so a few steps visibly lower the loss)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (4, B, T + 1), generator=g)
    return [(data[i % 4, :, :-1].contiguous(), data[i % 4, :, 1:].contiguous()) for i in range(n)]


def new_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


# -- the user's loop, before and after ----------------------------------------------------------------

def plain_loop(model, get_batch, config, steps, lr=3e-3):
    accumulate = config.get("accumulate", 1)
    ctx = nullcontext()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for it in range(steps):
        total = 0.0
        for micro_step in range(accumulate):
            x, y = get_batch(it * accumulate + micro_step)
            with ctx:
                logits, loss = model(x, y)
                loss = loss / accumulate
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, locals()  # the loop's objects, for the test to look at


def tricks_loop(model, get_batch, config, steps, lr=3e-3):
    accumulate = config.get("accumulate", 1)
    tricks = Tricks(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model, optimizer = tricks.prepare(model, optimizer)
    losses = []
    for it in range(steps):
        total = 0.0
        for micro_step in range(accumulate):
            x, y = get_batch(it * accumulate + micro_step)
            with tricks.autocast():
                logits, loss = model(x, y)
            loss = tricks.backward(loss)
            total += loss.item()
        tricks.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, locals()  # the loop's objects, for the test to look at


def resumable_loop(model, get_batch, config, steps, lr=3e-3, checkpoint=None, stop_after=None):
    """``tricks_loop`` with nanoGPT's checkpoint: ``tricks.state_dict()`` in place of model + optimizer state."""
    accumulate = config.get("accumulate", 1)
    tricks = Tricks(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model, optimizer = tricks.prepare(model, optimizer)
    start = 0
    if checkpoint is not None:
        tricks.load_state_dict(checkpoint["tricks"])
        start = checkpoint["iter_num"]
    losses = []
    for it in range(start, steps):
        total = 0.0
        for micro_step in range(accumulate):
            x, y = get_batch(it * accumulate + micro_step)
            with tricks.autocast():
                logits, loss = model(x, y)
            loss = tricks.backward(loss)
            total += loss.item()
        tricks.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        if stop_after is not None and it + 1 == stop_after:  # "killed" here, after saving
            return losses, {"tricks": tricks.state_dict(), "iter_num": it + 1}
    return losses, tricks


def _changed_lines(a, b) -> int:
    """Lines changed between two functions' bodies: per diff hunk, the larger of lines removed and added."""
    body = lambda f: textwrap.dedent(inspect.getsource(f)).splitlines()[1:]  # noqa: E731  (the def line differs)
    ops = difflib.SequenceMatcher(None, body(a), body(b), autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def _fit_losses(config, batches, steps, **kw):
    h = fit(new_model(), batches, config={**config, "lr": 3e-3, "optimizer": "adamw", "weight_decay": 0.0,
                                          "no_decay_norm_bias": False, "log_every": 1, "progress": False,
                                          "epochs": 1, "max_steps": steps}, **kw)
    return [r["loss"] for r in h.rows if r["split"] == "train"], h


def _close(a, b, rel=REL):
    assert len(a) == len(b) and len(a) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=rel), f"step {i + 1}: {x} vs {y}"


# -- the checks ---------------------------------------------------------------------------------------

def test_the_loop_changes_in_at_most_six_lines():
    assert _changed_lines(plain_loop, tricks_loop) <= 6


@pytest.mark.parametrize("config", [
    {},
    {"precision": "bf16"},
    {"accumulate": 4},
    {"ema": True, "ema_decay": 0.9},
], ids=["fp32", "bf16", "accumulate4", "ema"])
def test_your_loop_with_tricks_trains_exactly_as_fit(config):
    if config.get("precision") == "bf16" and not precision_available(torch.device("cpu"))[0]:
        pytest.skip("bf16 autocast does not run on this CPU")
    steps = 6
    batches = make_batches(steps * config.get("accumulate", 1))
    cfg = {**config, "device": "cpu", "fused_optimizer": False}
    mine, objects = tricks_loop(new_model(), lambda i: batches[i], cfg, steps)
    tricks = objects["tricks"]
    theirs, h = _fit_losses(cfg, batches, steps, val_data=batches[:2])
    _close(mine, theirs)
    assert mine[-1] < mine[0]  # it trains
    if config.get("ema"):
        ema = tricks.ema_model
        val = [ema(x, y)[1].item() for x, y in batches[:2]]
        assert math.isclose(sum(val) / len(val), h.final["loss_ema"], rel_tol=REL)
    # the plain loop trains the same in fp32 without accumulation tricks (sanity of the reference)
    if not config:
        _close(plain_loop(new_model(), lambda i: batches[i], cfg, steps)[0], theirs)


@pytest.mark.parametrize("config", [{"accumulate": 4, "ema": True, "ema_decay": 0.9},
                                    {"precision": "bf16", "grad_clip": 0.5}], ids=["accumulate4-ema", "bf16-clip"])
def test_a_killed_loop_resumes_from_tricks_state_dict(config, tmp_path):
    if config.get("precision") == "bf16" and not precision_available(torch.device("cpu"))[0]:
        pytest.skip("bf16 autocast does not run on this CPU")
    steps = 6
    batches = make_batches(steps * config.get("accumulate", 1))
    cfg = {**config, "device": "cpu"}
    whole, _ = resumable_loop(new_model(), lambda i: batches[i], cfg, steps)
    first, ckpt = resumable_loop(new_model(), lambda i: batches[i], cfg, steps, stop_after=3)
    torch.save(ckpt, tmp_path / "ckpt.pt")  # through a file, as a killed process would
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    torch.manual_seed(123)  # a new process: other initial weights, which the state replaces
    rest, _ = resumable_loop(TinyGPT(), lambda i: batches[i], cfg, steps, checkpoint=ckpt)
    _close(first + rest, whole)
    theirs, _ = _fit_losses({**cfg, "fused_optimizer": True}, batches, steps)
    _close(whole, theirs)


def test_state_dict_keeps_a_half_done_accumulation_group():
    batches = make_batches(8)
    cfg = {"accumulate": 4, "device": "cpu"}

    def run(split_at=None):
        tricks = Tricks(cfg)
        model, _ = tricks.prepare(new_model(), torch.optim.SGD(new_model().parameters(), lr=0.1))
        for i, (x, y) in enumerate(batches):
            if i == split_at:
                state = tricks.state_dict()
                tricks = Tricks(cfg)
                model, _ = tricks.prepare(TinyGPT(), torch.optim.SGD(TinyGPT().parameters(), lr=0.1))
                tricks.load_state_dict(state)
            with tricks.autocast():
                _, loss = model(x, y)
            tricks.backward(loss)
            tricks.step()
        return tricks

    whole, split = run(), run(split_at=2)  # two micro-batches of the first group done at the split
    assert whole.step_count == split.step_count == 2
    for p, q in zip(whole.unwrapped_model.parameters(), split.unwrapped_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_step_is_a_no_op_between_accumulation_boundaries_and_scheduler_follows_real_steps():
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tricks = Tricks({"accumulate": 3, "device": "cpu"})
    model, opt, sched2 = tricks.prepare(model, opt, sched)
    assert sched2 is sched and tricks.scheduler is sched
    x, y = make_batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    stepped = []
    for _ in range(6):
        assert tricks.sync_gradients == (len(stepped) % 3 == 2)
        with tricks.autocast():
            _, loss = model(x, y)
        tricks.backward(loss)
        stepped.append(tricks.step())
        if not stepped[-1]:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # weights untouched
        else:
            before = [p.detach().clone() for p in model.parameters()]
    assert stepped == [False, False, True, False, False, True]
    assert tricks.step_count == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)


def test_a_skipped_fp16_step_does_not_step_the_scheduler():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tricks = Tricks({"device": "cpu", "precision": "fp16"}) if precision_available(torch.device("cpu"))[0] \
        and _fp16_cpu_ok() else None
    if tricks is None:
        pytest.skip("fp16 autocast / GradScaler does not run on this CPU")
    model, opt, sched = tricks.prepare(model, opt, sched)
    x = torch.randn(8, 4)
    with tricks.autocast():
        loss = model(x).float().mean() * float("inf")  # inf gradients: the scaler skips this step
    tricks.backward(loss)
    assert tricks.step() is False and tricks.skipped_steps == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # not stepped
    with tricks.autocast():
        loss = model(x).float().mean()
    tricks.backward(loss)
    assert tricks.step() is True and opt.param_groups[0]["lr"] == pytest.approx(0.05)


def _fp16_cpu_ok() -> bool:
    try:
        torch.amp.GradScaler("cpu", enabled=True)
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except Exception:
        return False


def test_the_nan_guard_names_the_step():
    tricks = Tricks({"device": "cpu"})
    model, _ = tricks.prepare(nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    for i in range(3):
        loss = model(torch.randn(2, 4)).mean() * (float("nan") if i == 2 else 1.0)
        tricks.backward(loss)
        if i < 2:
            assert tricks.step()
    with pytest.raises(UserError, match="loss is nan at step 3"):
        tricks.step()


def test_your_optimizer_gets_its_fused_step_in_place_and_trains_as_a_fused_one_built_so():
    batches = make_batches(4)
    runs = {}
    for how in ("built fused", "switched by Tricks"):
        model = new_model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=how == "built fused")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        tricks = Tricks({"device": "cpu", "fused_optimizer": how != "built fused"})
        model, opt2, sched2 = tricks.prepare(model, opt, sched)
        assert opt2 is opt and sched2.optimizer is opt  # in place: the user's scheduler stays bound
        for x, y in batches:
            with tricks.autocast():
                _, loss = model(x, y)
            tricks.backward(loss)
            tricks.step()
        runs[how] = [p.detach().clone() for p in model.parameters()]
        assert opt.defaults.get("fused") is True
    assert "fused_optimizer" in tricks.applied
    for p, q in zip(runs["built fused"], runs["switched by Tricks"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_tricks_reads_a_tune_toml_and_dict_batches_with_labels(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=T,
                                  bos_token_id=0, eos_token_id=0)
    (tmp_path / "tricks.toml").write_text('[train]\naccumulate = 2\ndevice = "cpu"\nlr = 0.003\n'
                                          'optimizer = "adamw"\nweight_decay = 0.0\nno_decay_norm_bias = false\n')
    ids = [x for x, _ in make_batches(8)]
    data = [{"input_ids": x, "labels": x} for x in ids]

    def model_fn():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(cfg)

    model = model_fn()  # GPT-2's dropout is on: the RNG stream after Tricks() (which seeds, as fit does) must match
    tricks = Tricks(tmp_path / "tricks.toml")
    assert tricks.config.accumulate == 2
    model, optimizer = tricks.prepare(model)  # optimizer built from the config
    mine = []
    for i, batch in enumerate(data):
        with tricks.autocast():
            loss = model(**batch).loss
        tricks.backward(loss)
        if tricks.step():
            mine.append(tricks.group_loss.item())
    h = fit(model_fn(), data, config=tmp_path / "tricks.toml", max_steps=4, epochs=1, log_every=1, progress=False)
    _close(mine, [r["loss"] for r in h.rows if r["split"] == "train"])


def test_bad_use_is_one_line():
    tricks = Tricks({"device": "cpu"})
    with pytest.raises(UserError, match="prepare"):
        tricks.backward(torch.ones((), requires_grad=True))
    model, _ = tricks.prepare(nn.Linear(4, 2))
    with pytest.raises(UserError, match=r"shape \(2, 2\), not a scalar"):
        tricks.backward(model(torch.randn(2, 4)))
    with pytest.raises(UserError, match="called already"):
        tricks.prepare(nn.Linear(4, 2))
    with pytest.raises(UserError, match="not a Tricks state"):
        tricks.load_state_dict({"weights": 1})
    with pytest.raises(UserError, match="config"):
        Tricks(3)
    with pytest.raises(UserError, match="prepare\\(\\) takes"):
        Tricks({"device": "cpu"}).prepare(nn.Linear(2, 2), None, "not a scheduler")
    with pytest.raises(UserError, match="no Tricks state"):
        tricks.load("/nonexistent/state.pt")


def test_threads_is_the_process_intra_op_count_checked_against_the_cores_here(tmp_path):
    """``threads`` (issue 35): applied by Tricks and so by fit, listed in applied; 0 leaves the process's own; a
    count this machine cannot serve is one line where it is applied (a file may come from another machine)."""
    from torch_tricks.machine import available_cores
    from torch_tricks.train import TrainConfig

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not 1 already (one thread per xdist worker): Tricks must change it
        tricks = Tricks({"device": "cpu", "threads": 1})
        assert torch.get_num_threads() == 1 and "threads=1" in tricks.applied
        torch.set_num_threads(2)
        assert not any(a.startswith("threads") for a in Tricks({"device": "cpu"}).applied)
        assert torch.get_num_threads() == 2  # 0, the default: the process's own count stays
        toml = tmp_path / "tricks.toml"
        toml.write_text("[train]\nthreads = 1\ndevice = \"cpu\"\nmax_steps = 1\nbatch_size = 4\n")
        data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.arange(8) % 2)
        history = fit(nn.Linear(4, 2), data, config=str(toml), progress=False)
        assert torch.get_num_threads() == 1 and "threads=1" in history.applied
        torch.set_num_threads(2)
        too_many = available_cores() + 1
        with pytest.raises(UserError, match=rf"^threads = {too_many}: give 1.*, the cores this process may use, or 0 "):
            Tricks({"device": "cpu", "threads": too_many})
        assert torch.get_num_threads() == 2  # refused: nothing changed
        with pytest.raises(UserError, match="threads must be >= 0"):
            TrainConfig(threads=-1).validate()
    finally:
        torch.set_num_threads(before)


# -- a loop where an Accelerator steps the optimizer ---------------------------------------------------

class FakeAccelerator:
    """What Tricks reads of an Accelerate ``Accelerator``: whether this micro-batch ends a real step, and whether its
    fp16 scaler skipped that step."""

    def __init__(self) -> None:
        self.sync_gradients = True
        self.optimizer_step_was_skipped = False


def _accelerated(acc, **cfg):
    tricks = Tricks({"device": "cpu", "ema": True, "schedule": "cosine", "max_steps": 8, "lr": 0.1},
                    accelerator=acc, **cfg)
    torch.manual_seed(0)
    model, opt = tricks.prepare(nn.Linear(4, 2))
    return tricks, model, opt


def _accelerated_steps(tricks, model, opt, micro_batches: int) -> list[bool]:
    """Two micro-batches a real step, as ``accelerator.accumulate(model)`` gives them; what after_step returned."""
    acc, out = tricks.accelerator, []
    g = torch.Generator().manual_seed(tricks.step_count)
    for i in range(micro_batches):
        acc.sync_gradients = i % 2 == 1
        model(torch.randn(2, 4, generator=g)).square().mean().backward()
        if acc.sync_gradients:
            opt.step()
            opt.zero_grad()
        out.append(tricks.after_step())
    return out


def test_after_step_follows_only_the_accelerators_real_steps():
    acc = FakeAccelerator()
    tricks, model, opt = _accelerated(acc, ema_decay=0.9)  # keyword overrides still set config keys
    assert tricks.accelerator is acc and tricks.config.ema_decay == 0.9
    assert _accelerated_steps(tricks, model, opt, 6) == [False, True] * 3
    assert tricks.step_count == 3 and tricks.scheduler.last_epoch == 3 and tricks.ema.num_updates == 3
    acc.sync_gradients, acc.optimizer_step_was_skipped = True, True  # its fp16 scaler skipped this step
    assert tricks.after_step() is False
    assert (tricks.step_count, tricks.skipped_steps, tricks.scheduler.last_epoch, tricks.ema.num_updates) == (4, 1, 3, 3)
    plain = Tricks({"device": "cpu"})  # no accelerator: each call is a step
    plain.prepare(nn.Linear(4, 2))
    assert plain.after_step() is True and plain.after_step() is True and plain.step_count == 2


def test_checkpointable_is_the_state_an_accelerator_does_not_save(tmp_path):
    import copy

    tricks, model, opt = _accelerated(FakeAccelerator())
    tricks.scaler = torch.amp.GradScaler("cpu", init_scale=512.0)  # an enabled scaler's state goes along too
    _accelerated_steps(tricks, model, opt, 6)
    state = tricks.checkpointable().state_dict()
    assert set(state) == {"step_count", "skipped_steps", "scheduler", "ema", "scaler"}  # no model, no optimizer
    torch.save(state, tmp_path / "custom_checkpoint_0.pkl")  # as accelerator.save_state writes it
    accelerators_part = copy.deepcopy((model.state_dict(), opt.state_dict()))  # what the Accelerator saves itself
    _accelerated_steps(tricks, model, opt, 4)

    resumed, model2, opt2 = _accelerated(FakeAccelerator())
    resumed.scaler = torch.amp.GradScaler("cpu")
    model2.load_state_dict(accelerators_part[0])
    opt2.load_state_dict(accelerators_part[1])
    resumed.checkpointable().load_state_dict(torch.load(tmp_path / "custom_checkpoint_0.pkl", weights_only=False))
    assert (resumed.step_count, resumed.scheduler.last_epoch, resumed.ema.num_updates) == (3, 3, 3)
    assert resumed.scaler.get_scale() == 512.0
    _accelerated_steps(resumed, model2, opt2, 4)
    assert resumed.step_count == tricks.step_count == 5
    assert resumed.scheduler.get_last_lr() == tricks.scheduler.get_last_lr()
    assert tricks.scheduler.get_last_lr()[0] == pytest.approx(0.1 * (1 + math.cos(math.pi * 5 / 8)) / 2, rel=1e-9)
    for a, b in zip(tricks.ema_model.parameters(), resumed.ema_model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_checkpointable_refuses_a_state_that_does_not_fit():
    tricks, _, _ = _accelerated(FakeAccelerator())
    state = tricks.checkpointable().state_dict()
    with pytest.raises(UserError, match=r"not the state of tricks.checkpointable\(\) \(no step_count"):
        tricks.checkpointable().load_state_dict({"ema": None})
    bare = Tricks({"device": "cpu", "schedule": "cosine", "max_steps": 8})
    bare.prepare(nn.Linear(4, 2))
    with pytest.raises(UserError, match="the saved state has an EMA and this Tricks has none"):
        bare.checkpointable().load_state_dict(state)
    with pytest.raises(UserError, match="this Tricks has an lr schedule and the saved state has none"):
        bare.checkpointable().load_state_dict({**state, "scheduler": None, "ema": None})
