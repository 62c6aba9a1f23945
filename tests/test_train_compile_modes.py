"""T35, compile modes (issue 36): the key takes true or a mode, each mode runs where it can and is refused in one
line where it cannot (reduce-overhead is CUDA graphs), and reaches Tricks, the tune's candidates and the three
trainer integrations in its mode."""

from __future__ import annotations

import tomllib
import warnings

import pytest
import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.train import TrainConfig, Tricks
from torch_tricks.train.compile_modes import compile_kwargs, compile_mode_support, compile_modes
from torch_tricks.train.speed import compile_available

_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("value, means", [
    (True, True), ("default", True), ("true", True), ("on", True), (False, False), ("", False), ("off", False),
    ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs"), ("reduce-overhead", "reduce-overhead"),
])
def test_compile_is_true_false_or_a_mode(value, means):
    cfg = TrainConfig.from_dict({"compile": value}).validate()
    assert cfg.compile is means if isinstance(means, bool) else cfg.compile == means
    assert compile_kwargs(cfg.compile) == ({"mode": means} if isinstance(means, str) else {})


def test_an_unknown_mode_is_one_line_in_python_and_exit_2_on_the_command_line(capsys, tmp_path):
    from torch_tricks.cli import main

    with pytest.raises(UserError, match="compile must be true, false or a mode .*max-autotune-no-cudagraphs.*'fast'"):
        TrainConfig(compile="fast").validate()
    for argv, match in ((["--compile", "fast"], "compile must be true, false or a mode"),
                        (["--compile", "reduce-overhead", "--device", "cpu"],
                         "compile = 'reduce-overhead' on cpu: reduce-overhead is CUDA graphs, which run only on CUDA")):
        assert main(["train", "--model", "mlp", "--max-steps", "1", "--no-progress", "--checkpoint-dir",
                     str(tmp_path / "ck"), *argv]) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, err
        assert not (tmp_path / "ck").exists()  # nothing written


def test_which_modes_run_on_a_cpu_and_why_the_others_do_not():
    ok, refused = compile_modes("cpu")
    if not compile_available("cpu")[0]:
        assert not ok
        return
    assert ok == ["max-autotune-no-cudagraphs"]
    why = dict(refused)
    assert set(why) == {"reduce-overhead", "max-autotune"}
    assert "CUDA graphs, which run only on CUDA" in why["reduce-overhead"]
    assert "the same as max-autotune-no-cudagraphs" in why["max-autotune"]
    assert compile_mode_support(True, "cpu") == (True, "")


def test_reduce_overhead_on_a_cpu_is_refused_before_the_model_changes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match="reduce-overhead is CUDA graphs"):
        Tricks({"compile": "reduce-overhead", "device": "cpu", "channels_last": True}).prepare(model)
    assert not hasattr(model, "_compiled_call_impl") or model._compiled_call_impl is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def _steps(config: dict, device: str = "cpu") -> tuple[list[float], list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device)
    tricks = Tricks({**config, "device": device, "fused_optimizer": False, "progress": False})
    model, opt = tricks.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), y)
            tricks.backward(loss)
            tricks.step()
            losses.append(loss.item())
    torch._dynamo.reset()
    return losses, tricks.applied


@pytest.mark.skipif(not compile_available("cpu")[0], reason="torch.compile cannot run here (no C++ compiler)")
def test_max_autotune_without_cuda_graphs_trains_to_the_eager_losses_on_a_cpu():
    eager, _ = _steps({})
    tuned, applied = _steps({"compile": "max-autotune-no-cudagraphs"})
    assert "compile=max-autotune-no-cudagraphs" in applied
    assert tuned == pytest.approx(eager, rel=1e-4, abs=1e-5)


@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device; none here")
def test_reduce_overhead_trains_to_the_eager_losses_on_cuda():
    eager, _ = _steps({}, "cuda")
    graphed, applied = _steps({"compile": "reduce-overhead"}, "cuda")
    assert "compile=reduce-overhead" in applied
    assert graphed == pytest.approx(eager, rel=1e-3, abs=1e-4)


def test_the_tune_measures_the_modes_that_run_here_and_says_why_not_the_others():
    from torch_tricks.tuning.candidates import training_candidates

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    cands, skipped = training_candidates(model, (torch.randn(2, 4),), torch.device("cpu"), batch=2)
    names = {c.name: c for c in cands}
    why = {s.name: s.reason for s in skipped}
    if compile_available("cpu")[0]:
        assert names["compile:max-autotune-no-cudagraphs"].changes == {"compile": "max-autotune-no-cudagraphs"}
        assert names["compile:max-autotune-no-cudagraphs"].ids == ("T35",)
        assert "CUDA graphs" in why["compile:reduce-overhead"]
    _, skipped = training_candidates(model, (torch.randn(2, 4),), torch.device("cpu"), batch=2, skip=["compile"])
    assert {s.name: s.reason for s in skipped}["compile_mode"] == "left out with compile by the caller (skip)"


def test_the_mode_reaches_the_trainers_arguments_and_emit(tmp_path, capsys):
    pytest.importorskip("transformers")
    from torch_tricks.cli import main
    from torch_tricks.integrations.hf import training_args_from

    mode = "max-autotune-no-cudagraphs"
    kw = training_args_from({"compile": mode})
    assert kw["torch_compile"] is True and kw["torch_compile_mode"] == mode
    assert "torch_compile_mode" not in training_args_from({"compile": True})
    toml = tmp_path / "tricks.toml"
    toml.write_text(f'[train]\ncompile = "{mode}"\nattention = "sdpa"\nfp32_matmul = "ieee"\n')
    assert tomllib.loads(toml.read_text())["train"]["compile"] == mode
    assert main(["emit", "--config", str(toml), "--for", "hf"]) == 0
    out = capsys.readouterr().out
    assert "TricksCallback" in out and "tricks.toml" in out
    pytest.importorskip("accelerate")
    from torch_tricks.integrations.accelerate import accelerator_kwargs_from

    plugin = accelerator_kwargs_from({"compile": mode})["dynamo_plugin"]
    assert plugin.backend.value.lower() == "inductor" and plugin.mode == mode
