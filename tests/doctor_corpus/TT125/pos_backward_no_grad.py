import torch
import torch.nn as nn


def step(model, x, y, opt):
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # expect: TT125
    opt.step()


@torch.no_grad()
def train_epoch(model, loader, opt):
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()  # expect: TT125
        opt.step()


def finetune(model, x):
    with torch.inference_mode():
        model(x).sum().backward()  # expect: TT125
