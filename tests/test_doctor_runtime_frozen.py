"""Issue 37, the runtime doctor: parameters given to the optimizer twice (each step updates them twice), and a
frozen part left in train mode (its BatchNorm statistics drift); look-alikes stay quiet."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from torch_tricks.doctor.runtime import check_model
from torch_tricks.doctor.runtime.frozen import frozen_in_train, params_twice


def _shared() -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    enc = nn.Linear(4, 4)
    gen, rec = nn.Sequential(enc, nn.Linear(4, 2)), nn.Sequential(enc, nn.Linear(4, 2))
    return enc, gen, rec


def test_a_shared_module_passed_twice_is_found_and_is_updated_twice():
    enc, gen, rec = _shared()
    both = nn.ModuleDict({"gen": gen, "rec": rec})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own duplicate-parameters warning
        opt = torch.optim.SGD(list(gen.parameters()) + list(rec.parameters()), lr=1.0)
    (f,) = params_twice(both, opt)
    assert f.rule == "TT215" and "2 parameter tensor(s)" in f.message and "gen.0.weight" in f.message
    # what it means: one step moves the shared weight by twice lr * grad
    before = enc.weight.detach().clone()
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.allclose(before - enc.weight.detach(), torch.full_like(before, 2.0))
    # deduplicated: quiet
    assert params_twice(both, torch.optim.SGD(list({id(p): p for p in both.parameters()}.values()), lr=1.0)) == []


class Perceptual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Conv2d(8, 3, 1)
        for p in self.features.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(self.features(x))


def test_a_frozen_part_in_train_mode_is_found_and_quiet_once_in_eval():
    model = Perceptual().train()
    (f,) = frozen_in_train(model)
    assert f.rule == "TT216" and f.path == "features" and "features.1" in f.message and "features.eval()" in f.message
    model.features.eval()
    assert frozen_in_train(model) == []
    frozen_whole = Perceptual().train().requires_grad_(False)  # nothing trains: not a fine-tune
    assert frozen_in_train(frozen_whole) == []
    lora_like = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), nn.Linear(4, 2)).train()
    lora_like[0][0].requires_grad_(False)  # frozen with Dropout only: a choice, quiet
    assert frozen_in_train(lora_like) == []


def test_both_come_out_of_check_model():
    model = Perceptual().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = torch.optim.SGD([*model.head.parameters(), *model.head.parameters()], lr=0.1)
        rep = check_model(model, torch.randn(2, 3, 8, 8), loss_fn=lambda out: out.mean(), optimizer=opt, steps=1)
    rules = {f.rule for f in rep.findings}
    assert {"TT215", "TT216"} <= rules
