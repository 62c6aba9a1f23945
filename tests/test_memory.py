import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from torch_tricks.inspect.memory import LiveTensors, leak_check, memory_report, saved_activation_bytes
from torch_tricks.models import get_model

F32 = 4


def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))


def test_memory_report_breakdown_is_exact_for_an_mlp():
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(64, 256)
    rep = memory_report(model, x, optimizer="adamw")
    n_params = sum(p.numel() for p in model.parameters())
    assert rep.param_bytes == n_params * F32
    assert rep.grad_bytes == rep.param_bytes
    # AdamW keeps exp_avg and exp_avg_sq per parameter, plus a scalar step tensor each.
    assert 2 * rep.param_bytes <= rep.optimizer_state_bytes <= 2 * rep.param_bytes + 4 * 8
    # Saved for backward: the input x (first Linear) and the ReLU output (ReLU and second
    # Linear share that storage, counted once); weights are parameters, not activations.
    assert rep.activation_bytes == (64 * 256 + 64 * 512) * F32
    assert rep.saved_tensors == 2
    assert rep.process_peak_bytes is None or rep.process_peak_bytes > 0
    assert rep.step_tensor_peak_bytes >= rep.grad_bytes  # the step allocates fresh gradients
    for k, v in model.state_dict().items():  # the user's model is untouched
        assert torch.equal(v, before[k])


def test_sgd_momentum_state_equals_params():
    rep = memory_report(mlp(), torch.randn(8, 256), optimizer="sgd")
    assert rep.optimizer_state_bytes == rep.param_bytes


def test_activation_memory_scales_with_batch_and_names_modules():
    model = get_model("resnet50")
    one, two, three = (saved_activation_bytes(model, torch.randn(b, 3, 64, 64)) for b in (1, 2, 3))
    # Affine in the batch: per-sample activations plus BN's per-channel saved statistics.
    assert two - one == three - two > 0
    assert 0 < 2 * one - two < 0.05 * one
    rep = memory_report(get_model("resnet18"), torch.randn(2, 3, 64, 64), optimizer="sgd")
    assert rep.activation_by_module and sum(rep.activation_by_module.values()) == rep.activation_bytes
    assert any(name.startswith("layer1") for name in rep.activation_by_module)


def test_live_tensors_tracks_alloc_and_free():
    with LiveTensors() as live:
        a = torch.empty(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        assert live.live_bytes == 4000
        c = torch.empty(500)
        assert live.live_bytes == 6000 and live.peak_bytes == 6000
        del a, b
        assert live.live_bytes == 2000
        del c
        assert live.live_bytes == 0 and live.peak_bytes == 6000


def test_live_tensors_does_not_count_views_of_tensors_made_before():
    """Views, detach, .data and in-place ops of weights that existed before the region allocate nothing."""
    w = torch.randn(1000)
    model = nn.Linear(100, 10)
    with LiveTensors() as live:
        kept = [w.view(10, 100), w.detach(), w.data, w[::2]]
        w.mul_(2)
        for p in model.parameters():
            kept.append(p.data)
            kept.append(p.detach())
        assert live.live_bytes == 0 and live.peak_bytes == 0
        y = w * 2  # a new storage
        assert live.live_bytes == 4000
        del y
        assert live.live_bytes == 0 and live.peak_bytes == 4000


def test_live_tensors_follows_storage_resizes():
    """FSDP2 frees and re-allocates the unsharded parameters by resizing their storage in place."""
    before = torch.empty(100)
    with LiveTensors() as live:
        a = torch.empty(1000)  # 4000 bytes
        a.untyped_storage().resize_(0)  # freed in place, the tensor object lives on
        assert live.live_bytes == 0
        a.untyped_storage().resize_(8000)
        assert live.live_bytes == 8000 and live.peak_bytes == 8000
        before.untyped_storage().resize_(0)  # not allocated in the region: not counted either way
        assert live.live_bytes == 8000
        del a
        assert live.live_bytes == 0
    from torch_tricks.inspect import memory as M

    assert torch.UntypedStorage.resize_ is M._ORIGINAL_RESIZE  # put back after the region


_FSDP_LIVE = """
import os, tempfile, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch_tricks.inspect.memory import LiveTensors
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"), rank=0,
                        world_size=1)
torch.manual_seed(0)
with LiveTensors() as live:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    params = sum(p.to_local().numel() * 4 for p in model.parameters())
    state = sum(v.to_local().numel() * 4 for s in opt.state.values() for v in s.values() if v.dim() > 0)
    steps = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() == 0)
    print(live.live_bytes, params + state, steps)
dist.destroy_process_group()
"""


def test_live_tensors_counts_dtensor_shards_and_fsdp_frees():
    """Under FSDP2 what stays live after the steps is the local shards and the optimizer state (no unsharded
    parameters: FSDP freed them by resizing, and DTensors' local tensors are what is counted)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-c", _FSDP_LIVE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    live, shards, steps = map(int, r.stdout.split())
    # AdamW's 0-d step counters (4 bytes each): some are made by torch.tensor() outside the dispatcher
    assert shards <= live <= shards + steps, (live, shards, steps)


def _loop(accumulate):
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    state = {"total_loss": 0, "outputs": []}

    def step():
        opt.zero_grad()
        out = model(x)
        loss = out.square().mean()
        loss.backward()
        opt.step()
        accumulate(state, loss, out)

    return step


def test_leak_check_flags_total_loss_plus_equals_loss():
    def leak(state, loss, out):
        state["total_loss"] += loss  # keeps every step's graph alive

    rep = leak_check(_loop(leak), steps=6)
    assert rep.leaking
    assert rep.graph_growth_per_step >= 1
    assert "total_loss += loss" in rep.message


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
@pytest.mark.parametrize("fix", ["item", "detach", "float"])
def test_leak_check_quiet_for_item(fix):
    def ok(state, loss, out):
        if fix == "item":
            state["total_loss"] += loss.item()
        elif fix == "detach":
            state["total_loss"] += loss.detach()
        else:
            state["total_loss"] += float(loss)

    rep = leak_check(_loop(ok), steps=6)
    assert not rep.leaking, rep.message
    assert rep.growth_per_step_bytes <= 1024 and rep.graph_growth_per_step < 1


def test_leak_check_flags_outputs_kept_in_a_list():
    def keep(state, loss, out):
        state["outputs"].append(out)  # 32 x 1 outputs with their graphs

    rep = leak_check(_loop(keep), steps=6, threshold_bytes=64)
    assert rep.leaking


def test_leak_check_sees_a_tensor_made_before_it_that_starts_keeping_graphs(gc_unfrozen):
    """The tensors that existed before the check are frozen out of gc's scans: one of them that
    starts to carry a graph (an accumulator made before the loop) is still seen."""
    total = torch.zeros(())

    def leak(state, loss, out):
        total.add_(loss)  # a tensor made before the check now chains every step's graph

    rep = leak_check(_loop(leak), steps=6)
    assert rep.leaking and rep.graph_growth_per_step >= 1, rep.message


def test_leak_check_leaves_a_callers_gc_freeze_alone(gc_unfrozen):
    import gc

    def leak(state, loss, out):
        state["total_loss"] += loss

    sentinel = [object()]  # tracked by gc: in no generation while frozen (gc.get_objects() lists the generations)
    gc.freeze()
    try:
        rep = leak_check(_loop(leak), steps=4)
        assert gc.get_freeze_count() > 0 and not any(o is sentinel for o in gc.get_objects())  # still frozen
    finally:
        gc.unfreeze()
    assert any(o is sentinel for o in gc.get_objects())
    assert rep.leaking
    assert leak_check(_loop(lambda *a: None), steps=4).leaking is False
    assert gc.get_freeze_count() == 0


def test_leak_check_needs_two_steps():
    with pytest.raises(ValueError):
        leak_check(lambda: None, steps=1)


# -- keyword inputs and a real loss ----------------------------------------------------------------

class MaskedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, input_ids, attention_mask):
        return {"logits": self.fc((self.emb(input_ids) * attention_mask.unsqueeze(-1)).mean(1))}


def test_memory_report_takes_keyword_inputs_and_a_target():
    from torch_tricks.outputs import get_loss

    ids, mask = torch.randint(0, 50, (4, 8)), torch.ones(4, 8, dtype=torch.long)
    named = memory_report(MaskedHead(), {"input_ids": ids, "attention_mask": mask}, optimizer="sgd")
    positional = memory_report(MaskedHead(), (ids, mask), optimizer="sgd")
    assert named.input_bytes == positional.input_bytes == 2 * 4 * 8 * 8
    assert named.activation_bytes == positional.activation_bytes > 0
    with_loss = memory_report(MaskedHead(), {"input_ids": ids, "attention_mask": mask}, optimizer="sgd",
                              loss_fn=get_loss("ce"), target=torch.randint(0, 5, (4,)))
    assert with_loss.param_bytes == named.param_bytes and with_loss.saved_tensors >= named.saved_tensors


def test_a_loss_that_is_not_a_scalar_is_a_user_error():
    from torch_tricks.errors import UserError

    with pytest.raises(UserError, match=r"the loss has shape \(4, 10\), not a scalar"):
        memory_report(mlp(), torch.randn(4, 256), loss_fn=lambda out: out * 2)


def _report(**over):
    from torch_tricks.inspect.memory import MemoryReport

    fields = dict(device="cpu", optimizer="adamw", param_bytes=4096, buffer_bytes=0, grad_bytes=4096,
                  optimizer_state_bytes=8192, activation_bytes=2048, saved_tensors=3, input_bytes=512,
                  step_tensor_peak_bytes=10_000, device_peak_bytes=None, process_peak_bytes=3 << 20,
                  process_peak_method="VmHWM", activation_by_module={"0": 1024, "": 512})
    return MemoryReport(**{**fields, **over})


def test_memory_to_text_is_what_the_cli_prints(capsys, monkeypatch):
    import torch_tricks.inspect.memory as memory
    from torch_tricks.cli import main

    rep = _report()
    monkeypatch.setattr(memory, "memory_report", lambda *a, **k: rep)
    assert main(["memory", "--model", "mlp", "--batch", "2", "--no-advice"]) == 0
    assert capsys.readouterr().out == rep.to_text("mlp", 2) + "\n"
    text = rep.to_text("mlp", 2)
    assert text.startswith("mlp, batch 2, cpu:\n")
    state = next(line for line in text.splitlines() if line.startswith("= model state between steps"))
    assert state.endswith(" 16.0 KiB") and "(VmHWM)" in text
    assert text.endswith("largest saved activations by module:\n  0: 1.0 KiB\n  (model): 512 B")
    cuda = _report(device="cuda:0", device_peak_bytes=1 << 20, process_peak_bytes=None, activation_by_module={})
    assert "max_memory_allocated" in cuda.to_text() and "largest" not in cuda.to_text()
    assert cuda.to_text().startswith("model, cuda:0:\n")


def test_leak_report_to_text_is_the_cli_line(capsys):
    from torch_tricks.cli import main

    rep = leak_check(lambda: None, steps=2, warmup=0)
    assert rep.to_text() == f"leak check: {rep.message}"
    leaking = dataclasses.replace(rep, leaking=True, reasons=["live tensors grow"])
    assert leaking.to_text().startswith("leak check: LEAK: live tensors grow")
    assert main(["memory", "--model", "mlp", "--leak-steps", "2"]) == 0
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1].startswith("leak check: ")
