import torch


def pairwise_distance(a, b):
    return torch.sqrt(((a - b) ** 2).sum(dim=-1))  # expect: TT105


def l2(x):
    return (x ** 2).sum().sqrt()  # expect: TT105


def rms(x):
    return torch.sqrt(torch.mean(x * x))  # expect: TT105


def point_loss(x1, x2, t1, t2):
    norm = torch.sqrt((x1 - t1) ** 2 + (x2 - t2) ** 2)  # expect: TT105
    return norm.mean()


def via_names(feat):
    sq = feat.pow(2).sum(1)
    return sq.sqrt()  # expect: TT105


def pow_half(v):
    return torch.pow(torch.sum(torch.square(v), dim=1), 0.5)  # expect: TT105


x = torch.randn(5, requires_grad=True)
n = (x ** 2).sum() ** 0.5  # expect: TT105


def learned_radius(offset):  # a grid shifted by a learned offset: the gradient flows, NaN at zero
    grid = torch.arange(8, dtype=torch.float32)
    shifted = grid - offset
    return torch.sqrt(shifted ** 2 + shifted ** 2)  # expect: TT105


grid_param = torch.zeros(4, requires_grad=True)  # a constructor asked for a gradient: not a constant
r = torch.sqrt(grid_param ** 2 + grid_param ** 2)  # expect: TT105
