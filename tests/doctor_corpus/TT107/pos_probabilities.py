import torch
from torch import nn
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 10), nn.Softmax(dim=1))

    def forward(self, x):
        return self.net(x)


model = Classifier()
criterion = CrossEntropyLoss()
probs = model(torch.randn(4, 32))
loss = criterion(probs, torch.tensor([0, 1, 2, 3]))  # expect: TT107


class Trainer:
    def __init__(self):
        self.loss_fn = BCEWithLogitsLoss()

    def step(self, logits, y):
        return self.loss_fn(torch.sigmoid(logits), y)  # expect: TT107


def multi(logits, y):
    p = torch.softmax(logits, dim=-1)
    return torch.nn.functional.cross_entropy(p, y)  # expect: TT107


class SoftmaxNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=1)


def nll_on_probabilities(x, y):
    out = SoftmaxNet()(x)
    return torch.nn.functional.nll_loss(out, y)  # expect: TT107


nll = nn.NLLLoss()
loss = nll(torch.softmax(torch.randn(4, 10), 1), torch.tensor([0, 1, 2, 3]))  # expect: TT107
