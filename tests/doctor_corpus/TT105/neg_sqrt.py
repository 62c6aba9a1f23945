import numpy as np
import torch


def pairwise_distance(a, b, eps=1e-8):
    return torch.sqrt(((a - b) ** 2).sum(dim=-1) + eps)


def l2(x):
    return torch.linalg.vector_norm(x, dim=-1)


def norm_clamped(x):
    return torch.sqrt(torch.clamp((x ** 2).sum(), min=1e-12))


@torch.no_grad()
def rmse(pred, target):
    return torch.sqrt(((pred - target) ** 2).mean())


def rmse_value(pred, target):
    return torch.sqrt(((pred - target) ** 2).mean()).item()


def hypot(dx, dy):
    return (dx ** 2 + dy ** 2) ** 0.5  # Python numbers


def np_norm(a):
    return np.sqrt(np.sum(a ** 2))


def std(x):
    return torch.sqrt(x.var() + 1e-5)


def evaluate(a, b):
    with torch.no_grad():
        return torch.sqrt(((a - b) ** 2).sum(-1)).mean()
