import torch
import torch.nn as nn


class Classifier(nn.Module):
    def __init__(self, probabilities=True):
        super().__init__()
        layers = [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)]
        if probabilities:
            layers.append(nn.Softmax(dim=1))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


model = Classifier()
criterion = nn.CrossEntropyLoss()
loss = criterion(model(torch.randn(4, 32)), torch.tensor([0, 1, 2, 3]))  # expect: TT107
