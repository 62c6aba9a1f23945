import torch
import torch.nn as nn
from torch.optim.lr_scheduler import CosineAnnealingLR, StepLR

model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = StepLR(optimizer, step_size=10)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

for epoch in range(90):
    scheduler.step()  # expect: TT122
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def train(model, loader, epochs):
    opt = torch.optim.AdamW(model.parameters())
    sched = CosineAnnealingLR(opt, T_max=epochs)
    scaler = torch.amp.GradScaler()
    for x, y in loader:
        sched.step()  # expect: TT122
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
