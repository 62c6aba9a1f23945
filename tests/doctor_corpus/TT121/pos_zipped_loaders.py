import itertools

import torch
from torch.utils.data import DataLoader

model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

# two domains read in step (CycleGAN-style): each loader is iterated, each loads in the training process
loader_a = DataLoader(domain_a, batch_size=8, shuffle=True)  # expect: TT121
loader_b = DataLoader(domain_b, batch_size=8, shuffle=True)  # expect: TT121
for (xa, ya), (xb, yb) in zip(loader_a, itertools.cycle(loader_b)):
    opt.zero_grad()
    (model(xa).mean() + model(xb).mean()).backward()
    opt.step()

source = DataLoader(images, batch_size=16)  # expect: TT121
for step, batch in enumerate(itertools.islice(source, 100)):
    opt.zero_grad()
    model(batch).mean().backward()
    opt.step()
