import torch
import torch.nn as nn


def init_weights(m):
    if isinstance(m, nn.Conv2d):
        m.weight.data.normal_(0, 0.02)  # expect: TT103
        m.bias.data.zero_()  # expect: TT103


def sgd_step(model, lr):
    for p in model.parameters():
        p.data -= lr * p.grad.data  # expect: TT103


w = torch.randn(3, requires_grad=True)
w.data.clamp_(min=0)  # expect: TT103
snapshot = w.data.clone()  # expect: TT103


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.scale.data  # expect: TT103


for name, param in Scaled().named_parameters():
    print(name, param.data.norm())  # expect: TT103
