"""T31 activation offload: refused on a CPU in one line (exit 2 on the CLI) and skipped there by the tune
with its reason; on CUDA the device's step peak drops and the parameters are the plain step's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.cli import main
from torch_tricks.errors import UserError
from torch_tricks.train import Tricks
from torch_tricks.tuning.candidates import training_candidates

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


def test_on_a_cpu_it_is_one_line(capsys):
    with pytest.raises(UserError, match="offload_activations moves saved activations from GPU memory.*switch it off"):
        Tricks(device="cpu", offload_activations=True)
    code = main(["train", "--model", "mlp", "--max-steps", "1", "--offload-activations", "--device", "cpu",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "offload_activations" in err, err


def test_the_tune_skips_it_on_a_cpu_with_the_reason():
    model = nn.Sequential(nn.Linear(8, 8))
    _, skipped = training_candidates(model, (torch.randn(2, 8),), torch.device("cpu"), batch=2)
    row = next(s for s in skipped if s.name == "offload_activations")
    assert "on a CPU they are in host memory already" in row.reason and row.ids == ("T31",)


@requires_cuda
def test_on_cuda_the_step_peak_drops_and_the_step_is_the_same():
    """The peak of forward + backward, where the saved activations live: the optimizer step's temporaries
    are the same either way (in one GPU run of the whole suite, the whole step's peaks were equal to the byte)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)], nn.Linear(1024, 10))
    x, y = torch.randn(1024, 1024, device="cuda"), torch.randint(0, 10, (1024,), device="cuda")  # 4 MiB each saved

    def step(offload: bool) -> tuple[int, nn.Module]:
        tricks = Tricks(device="cuda", progress=False, optimizer="sgd", lr=0.1, offload_activations=offload,
                        fused_optimizer=False)
        model, _ = tricks.prepare(copy.deepcopy(net))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with tricks.autocast():
            loss = F.cross_entropy(model(x), y)
        tricks.backward(loss)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        tricks.step()
        return peak, model

    plain_peak, plain = step(False)
    off_peak, off = step(True)
    assert off_peak < 0.8 * plain_peak, (off_peak, plain_peak)
    for a, b in zip(plain.parameters(), off.parameters()):
        torch.testing.assert_close(b, a)
