import time

import torch
import torch.nn as nn

model = nn.Linear(1024, 1024).cuda()
x = torch.randn(64, 1024, device="cuda")

torch.cuda.synchronize()
start = time.time()
y = model(x)
torch.cuda.synchronize()
end = time.time()

start = time.perf_counter()
y = model(x)
value = y.sum().item()  # .item() waits for the result
end = time.perf_counter()

starter, ender = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
starter.record()
y = model(x)
ender.record()
torch.cuda.synchronize()
ms = starter.elapsed_time(ender)


def step():
    out = model(x)
    torch.cuda.synchronize()
    return out


t0 = time.time()
step()
t1 = time.time()

t0 = time.time()
data = open("data.bin", "rb").read()  # no device work timed
t1 = time.time()

t0 = time.time()
train_one_epoch(model)  # code this file does not show: it may synchronise
t1 = time.time()
