import torch
import torch.nn as nn
from torch.optim.lr_scheduler import OneCycleLR, ReduceLROnPlateau, StepLR

model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = StepLR(optimizer, step_size=10)
plateau = ReduceLROnPlateau(optimizer)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

for epoch in range(90):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    scheduler.step()  # after the epoch's updates: the 1.1+ order
    plateau.step(0.5)

onecycle = OneCycleLR(optimizer, max_lr=0.1, total_steps=100)
for step, (x, y) in enumerate(loader):
    if step > 0:
        onecycle.step()  # guarded: the author decided when the schedule moves
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


class Stepper:  # a `step` of something that is not a scheduler
    def step(self):
        pass


counter = Stepper()
for x, y in loader:
    counter.step()
    optimizer.step()
