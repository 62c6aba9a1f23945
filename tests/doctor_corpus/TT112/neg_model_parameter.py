"""Timing a model passed in, done right, or timing something that is not shown to be a model."""
import time

import torch
from torch import nn


def benchmark(model, x, steps=10):
    model.eval()
    x = x.cuda()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            model(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def call_time(fn, batch):
    t0 = time.time()
    fn(batch)  # any callable: maybe it synchronises, maybe it is not CUDA work
    return time.time() - t0


def latency(net: nn.Module, batch):
    t0 = time.time()
    out = net(batch)
    value = out.sum().item()  # .item() waits for the device
    return time.time() - t0, value
