import torch
import torch.nn as nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.scale.data.fill_(0.5)  # init: no graph yet (quiet)

    def forward(self, x):
        return x * self.scale.data  # expect: TT103


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        g = torch.sigmoid(self.gate.data)  # expect: TT103
        return x * g


def train_step(model, opt, x, y):
    loss = (model(x) - y).pow(2).mean()
    for p in model.parameters():
        p.data.clamp_(-1, 1)  # expect: TT103
    loss.backward()
    opt.step()


def train(model, loader, opt, mask):
    for x, y in loader:
        out = model(x)
        model.weight.data *= mask  # expect: TT103
        model.bias.data = model.bias.data.clamp(0, 1)  # expect: TT103
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
