import itertools

import torch
from torch.utils.data import DataLoader

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

loader_a = DataLoader(domain_a, batch_size=8, num_workers=4)
loader_b = DataLoader(domain_b, batch_size=8, num_workers=4)
for (xa, ya), (xb, yb) in zip(loader_a, itertools.cycle(loader_b)):  # workers set on both
    opt.zero_grad()
    (model(xa).mean() + model(xb).mean()).backward()
    opt.step()

eval_loader = DataLoader(val_set, batch_size=64)
with torch.no_grad():
    for xa, xb in zip(eval_loader, range(10)):  # evaluation: no backward in the loop
        model(xa)
