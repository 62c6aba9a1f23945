import torch
import torch.nn as nn


def validate(model, loader, criterion):
    model.eval()
    total = 0.0
    for x, y in loader:
        out = model(x)  # expect: TT116
        total += criterion(out, y).item()
    return total


class Trainer:
    def __init__(self, model, val_loader):
        self.model = model
        self.val_loader = val_loader

    def evaluate(self):
        self.model.eval()
        return [self.model(x).argmax(1) for x, _ in self.val_loader]  # expect: TT116


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


net = Net()
net.load_state_dict(torch.load("net.pt", map_location="cpu", weights_only=True))
net.eval()
prediction = net(torch.randn(1, 3, 32, 32))  # expect: TT116
