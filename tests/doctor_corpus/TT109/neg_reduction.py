import functools
import operator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

per_sample = nn.MSELoss(reduction="none")
summed = nn.MSELoss(reduction="sum")


def nll(logp, y):
    return F.nll_loss(logp, y, reduction="mean")


def misc(tensor, src, index, a):
    dist.reduce(tensor, dst=0)
    product = functools.reduce(operator.mul, [1, 2, 3])
    total = np.add.reduce(a)
    out = torch.scatter_reduce(src, 0, index, src, reduce="sum")
    return product, total, out
