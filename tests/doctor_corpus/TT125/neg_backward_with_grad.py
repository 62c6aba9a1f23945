import torch
import torch.nn as nn


def step(model, x, y, opt):
    with torch.no_grad():
        target = y * 2  # only the target is computed without a graph
    loss = nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()


@torch.no_grad()
def attack(model, x, y):
    with torch.enable_grad():  # autograd back on inside: the usual adversarial-example pattern
        x = x.clone().requires_grad_(True)
        nn.functional.cross_entropy(model(x), y).backward()
    return x.grad.sign()
