"""Behaviour of torch_tricks.inspect.profile on a tiny training step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torch_tricks.errors import UserError
from torch_tricks.inspect.profile import ProfileReport, profile_step


def deliberately_slow_python():
    total = 0
    for i in range(300_000):
        total += i * i
    return total


def _step_fn(slow: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    calls = []

    def step():
        calls.append(1)
        if slow:
            deliberately_slow_python()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step, calls


@pytest.fixture
def one_thread():
    """Intra-op threads spin-wait; on a busy 2-core box that can make a tiny step take 100 ms
    and push the deliberately slow function down the ranking. One thread keeps ranks stable."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_profile_step_finds_python_and_torch_hot_spots(tmp_path, one_thread):
    step, calls = _step_fn(slow=True)
    trace = tmp_path / "sub" / "trace.json"
    rep = profile_step(step, warmup=1, steps=2, top_k=40, trace_path=trace)
    assert isinstance(rep, ProfileReport)
    assert len(calls) == 1 + 2 + 2  # warm-up, then the steps under each profiler

    # cProfile: ranked by cumulative time, the slow function near the top, called once a step
    assert 0 < len(rep.python) <= 40
    cum = [r.cumtime_ms for r in rep.python]
    assert cum == sorted(cum, reverse=True)
    slow = [r for r in rep.python if "deliberately_slow_python" in r.function]
    assert slow and slow[0].ncalls == 2
    assert rep.python.index(slow[0]) < 5
    assert "deliberately_slow_python" in rep.cprofile_table
    assert not any("disable" in r.function and "Profiler" in r.function for r in rep.python)

    # torch.profiler: linear and conv operators, ranked by self CPU time, in ms
    names = {o.name for o in rep.ops}
    assert names & {"aten::addmm", "aten::mm", "aten::linear"}
    assert any("conv" in n for n in names)
    selfs = [o.self_cpu_ms for o in rep.ops]
    assert selfs == sorted(selfs, reverse=True)
    assert all(o.count >= 1 and o.cpu_total_ms >= 0 for o in rep.ops)
    if not torch.cuda.is_available():
        assert all(o.self_device_ms is None for o in rep.ops)
    assert "aten::" in rep.torch_table

    # Chrome trace written atomically (no temp files left)
    assert rep.trace_path == str(trace)
    assert "traceEvents" in json.loads(trace.read_text())
    assert [p.name for p in trace.parent.iterdir()] == ["trace.json"]

    d = rep.to_dict()
    assert d["steps"] == 2 and isinstance(d["ops"][0], dict) and isinstance(d["python"][0], dict)


def test_profile_step_top_k_and_single_profiler():
    step, calls = _step_fn()
    rep = profile_step(step, warmup=0, steps=1, top_k=3, use_torch_profiler=False)
    assert len(rep.python) == 3 and rep.ops == [] and rep.torch_table is None
    rep = profile_step(step, warmup=0, steps=1, top_k=3, use_cprofile=False, record_shapes=True)
    assert len(rep.ops) == 3 and rep.python == [] and rep.cprofile_table is None
    assert len(calls) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(steps=0),
        dict(warmup=-1),
        dict(top_k=0),
        dict(use_cprofile=False, use_torch_profiler=False),
        dict(use_torch_profiler=False, trace_path="t.json"),
    ],
)
def test_profile_step_rejects_bad_arguments(kwargs):
    with pytest.raises(UserError):
        profile_step(lambda: None, **kwargs)
    with pytest.raises(UserError):
        profile_step("not callable")


def test_profile_of_a_step_on_keyword_inputs_sees_the_model_ops():
    from torch_tricks.inspect.step import Workloads
    from torch_tricks.outputs import get_loss

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.fc = nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask):
            return self.fc(self.emb(input_ids) * attention_mask.unsqueeze(-1))

    ids = torch.randint(0, 20, (2, 5))
    wl = Workloads(Masked(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, loss_fn=get_loss("ce"),
                   target=torch.randint(0, 3, (2, 5)))
    rep = profile_step(wl.step, warmup=0, steps=1, top_k=200, use_cprofile=False)
    names = {o.name for o in rep.ops}
    assert "aten::embedding" in names and "aten::linear" in names


def test_profile_to_text_is_what_the_cli_prints(capsys, monkeypatch, tmp_path):
    import torch_tricks.inspect.profile as profile
    from torch_tricks.cli import main
    from torch_tricks.inspect.profile import OpHotSpot, PythonHotSpot

    rep = ProfileReport(steps=3, warmup=1, python=[PythonHotSpot("x" * 80 + ":1(step)", 3, 1.5, 20.25)],
                        ops=[OpHotSpot("aten::addmm", 6, 4.125, 5.0)])
    monkeypatch.setattr(profile, "profile_step", lambda *a, **k: rep)
    assert main(["profile", "--model", "mlp", "--batch", "2"]) == 0
    assert capsys.readouterr().out == rep.to_text("mlp", 2) + "\n"
    text = rep.to_text("mlp", 2)
    assert text.startswith("mlp, batch 2: hot spots of one training step\n\n"
                           "torch.profiler operators (by self CPU time, 3 steps):")
    assert "\naten::addmm      6     4.12      5.00\n" in text
    assert ("x" * 62 + ":1(step)") in text and "x" * 71 not in text  # the function's last 70 characters
    assert "Chrome trace" not in text

    trace = str(tmp_path / "t.json")
    traced = ProfileReport(steps=3, warmup=1, trace_path=trace)
    monkeypatch.setattr(profile, "profile_step", lambda *a, **k: traced)
    assert main(["profile", "--model", "mlp", "--trace", trace]) == 0
    assert capsys.readouterr().out == traced.to_text("mlp", 8) + "\n"
    assert traced.to_text() == f"model: hot spots of one training step\n\nChrome trace written to {trace}"
