import math

import torch
import torch.nn as nn


def init_weights(m):
    if isinstance(m, nn.Conv2d):
        m.weight.data.normal_(0, 0.02)  # weight initialisation: no graph exists yet
        m.bias.data.zero_()


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self):
        bound = 1 / math.sqrt(self.fc.weight.size(1))
        self.fc.weight.data.uniform_(-bound, bound)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)

    def forward(self, x):
        return self.fc(x) + 0 * self.fc.weight.data.shape[0]  # .shape only: no value of it is computed with


def apply_init(model):
    def custom(m):
        if hasattr(m, "weight"):
            m.weight.data.fill_(0.01)

    model.apply(custom)


def sgd_step(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(p.grad.data, alpha=-lr)


class EMA:
    @torch.no_grad()
    def update(self, model, shadow, decay):
        for s, p in zip(shadow.parameters(), model.parameters()):
            s.data.mul_(decay).add_(p.data, alpha=1 - decay)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    @torch.no_grad()
    def forward(self, x):
        return x * self.scale.data  # forward under no_grad: no gradient was meant


def manual_sgd(model, lr):  # after backward, before the next forward: no graph holds the old values
    for p in model.parameters():
        p.data -= lr * p.grad.data


def prune_after_step(model, opt, loss, mask):
    loss.backward()
    opt.step()
    model.weight.data.mul_(mask)  # after the backward: the next forward builds a new graph


def fuse(conv, bn):  # a conversion swaps a parameter's tensor: no training in it
    w, b = conv.weight, bn.bias
    conv.weight.data = w * 2
    conv.bias.data = b.clone()


w = torch.randn(3, requires_grad=True)
w.data.clamp_(min=0)


model = Block(8)  # a script: the embedding is filled before any forward, the loop's backward comes later
model.fc.weight.data.copy_(torch.randn(8, 8))
criterion = nn.MSELoss()
for x in torch.randn(3, 2, 8):
    loss = criterion(model(x), x)
    loss.backward()
