"""A model passed in from another file: the function shows it is a module (eval(), an annotation)."""
import time

import torch
from torch import nn


def benchmark(model, x, steps=10):
    model.eval()
    x = x.cuda()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            model(x)
    elapsed = time.perf_counter() - start  # expect: TT112
    return elapsed / steps


def latency(net: nn.Module, batch):
    t0 = time.time()
    net(batch)
    return time.time() - t0  # expect: TT112
