"""T34 for models that call SDPA themselves (issue 36): the kernel held to one around the whole forward (and a
checkpointed block's recomputation), the losses of the package's own transformer equal to SDPA's own choice,
refused in one line where the kernel does not run or the model calls no SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.train import TrainConfig, Tricks
from torch_tricks.train.sdpa_backend import calls_sdpa, hold_sdpa_backend, sdpa_backend_support


class Block(nn.Module):
    """A nanoGPT-style attention that calls SDPA itself."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(torch.backends.cuda.flash_sdp_enabled())  # the flags sdpa_kernel sets
        q, k, v = (t.view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(x.shape))


def test_which_kernels_run_on_a_cpu_and_the_check_leaves_the_random_stream_alone():
    torch.manual_seed(3)
    assert sdpa_backend_support("sdpa-math", "cpu", dropout=0.25) == (True, "")
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))
    ok, why = sdpa_backend_support("sdpa-efficient", "cpu")
    assert not ok and why.startswith("SDPA's efficient_attention kernel does not run on cpu here")


def test_the_kernel_is_held_in_every_forward_and_let_go_after_it_even_when_it_raises():
    model = nn.Sequential(Block(), Block())
    assert calls_sdpa(model) and not calls_sdpa(nn.Sequential(nn.Linear(2, 2)))
    hold_sdpa_backend(model, "sdpa-math")
    before = torch.backends.cuda.flash_sdp_enabled()
    model(torch.randn(2, 8, 32)).sum().backward()
    assert model[0].seen == model[1].seen == [False]  # flash off inside: math only
    assert torch.backends.cuda.flash_sdp_enabled() == before  # and back after
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 8, 31))  # a wrong width raises inside the forward
    assert torch.backends.cuda.flash_sdp_enabled() == before
    hold_sdpa_backend(model, "sdpa-flash")  # again: the earlier hooks replaced, not stacked
    assert len(model._tt_sdpa_hooks) == 2 * len(list(model.modules()))


def _losses(cfg: dict) -> list[float]:
    torch.manual_seed(0)
    model = get_model("transformer")
    tricks = Tricks({**cfg, "device": "cpu", "progress": False})
    model, opt = tricks.prepare(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 1000, (4, 32), generator=g), torch.randint(0, 2, (4,), generator=g)
    out = []
    for _ in range(3):
        loss = F.cross_entropy(model(x), y)
        tricks.backward(loss)
        tricks.step()
        out.append(loss.item())
    return out


def test_the_package_transformer_trains_to_the_same_losses_with_the_math_kernel_and_checkpointed_blocks():
    base = _losses({})
    assert _losses({"attention": "sdpa-math"}) == pytest.approx(base, rel=1e-5)
    assert _losses({"attention": "sdpa-math", "checkpointing": "blocks"}) == pytest.approx(base, rel=1e-5)


def test_refused_in_one_line():
    with pytest.raises(UserError, match="has no nn.MultiheadAttention and no forward that calls "
                                        "scaled_dot_product_attention"):
        Tricks({"attention": "sdpa-math", "device": "cpu"}).prepare(get_model("mlp"))
    with pytest.raises(UserError, match="efficient_attention kernel does not run on cpu"):
        Tricks({"attention": "sdpa-efficient", "device": "cpu"}).prepare(get_model("transformer"))
    # the encoder's attention dropout (0.1): the CPU's flash kernel has none, so it cannot run this model
    with pytest.raises(UserError, match="flash_attention kernel does not run on cpu with attention dropout 0.1"):
        Tricks({"attention": "sdpa-flash", "device": "cpu"}).prepare(get_model("transformer"))
    Tricks({"attention": "sdpa-flash", "device": "cpu"}).prepare(get_model("transformer", dropout=0.0))
    with pytest.raises(UserError, match="under compile inductor lowers attention itself"):
        TrainConfig(attention="sdpa-math", compile=True).validate()
    with pytest.raises(UserError, match="attention must be eager, sdpa, flex, flash2 or one SDPA kernel"):
        TrainConfig(attention="sdpa-fast").validate()
