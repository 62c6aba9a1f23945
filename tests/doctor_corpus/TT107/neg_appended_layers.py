import torch
import torch.nn as nn


class Classifier(nn.Module):
    def __init__(self, dropout=True):
        super().__init__()
        layers = [nn.Linear(32, 64), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(0.1))
        layers.append(nn.Linear(64, 10))  # logits last
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Probabilities(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Linear(32, 10)]
        self.logits = nn.Sequential(*layers)
        layers.append(nn.Softmax(dim=1))  # after the Sequential was built: not in it

    def forward(self, x):
        return self.logits(x)


criterion = nn.CrossEntropyLoss()
loss = criterion(Classifier()(torch.randn(4, 32)), torch.tensor([0, 1, 2, 3]))
loss2 = criterion(Probabilities()(torch.randn(4, 32)), torch.tensor([0, 1, 2, 3]))
