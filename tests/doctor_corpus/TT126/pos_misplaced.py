import torch
import torch.nn as nn
import torch.nn.functional as F

model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

for x, y in loader:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.zero_grad()  # expect: TT126
    optimizer.step()

for x, y in loader:
    F.cross_entropy(model(x), y).backward()
    model.zero_grad()  # expect: TT126
    optimizer.step()

accum = 4
for i, (x, y) in enumerate(loader):
    optimizer.zero_grad()  # expect: TT126
    loss = F.cross_entropy(model(x), y) / accum
    loss.backward()
    if (i + 1) % accum == 0:
        optimizer.step()


class Trainer:
    def __init__(self, model, accumulate):
        self.model = model
        self.accumulate = accumulate
        self.optimizer = torch.optim.Adam(model.parameters())

    def fit(self, loader):
        for i, (x, y) in enumerate(loader):
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            if i % self.accumulate == 0:
                self.optimizer.step()
            self.optimizer.zero_grad()  # expect: TT126
