import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mylib import after_step, build_optimizer

model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

for x, y in loader:  # the usual order
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()

for x, y in loader:  # zeroed right after the step
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

for x, y in loader:  # by hand
    for p in model.parameters():
        p.grad = None
    F.cross_entropy(model(x), y).backward()
    optimizer.step()

params = list(model.parameters())
for x, y in loader:
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    for p in params:
        if p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()


def clear(opt):
    opt.zero_grad()


for x, y in loader:  # in a helper of this file
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    clear(optimizer)

for x, y in loader:  # maybe in a helper of another file, which is handed the optimizer
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    after_step(optimizer)

accum = 4
for i, (x, y) in enumerate(loader):  # gradient accumulation done right
    loss = F.cross_entropy(model(x), y) / accum
    loss.backward()
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()

for x, y in loader:  # a NaN guard drops the step's gradients and skips the step
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if not math.isfinite(loss.item()):
        optimizer.zero_grad()
        continue
    optimizer.step()
    optimizer.zero_grad()

for step in range(100):  # micro-batches: zero once per update, step after the last one
    optimizer.zero_grad()
    for micro in range(accum):
        x, y = loader[0]
        (F.cross_entropy(model(x), y) / accum).backward()
    optimizer.step()

other = build_optimizer(model)  # an optimizer the file does not build: not judged
for x, y in loader:
    F.cross_entropy(model(x), y).backward()
    other.step()

for x, y in loader:  # gradients from autograd.grad, assigned by hand
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    loss.backward()
    optimizer.step()

lbfgs = torch.optim.LBFGS(model.parameters())
for x, y in loader:
    def closure():
        lbfgs.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    lbfgs.step(closure)
