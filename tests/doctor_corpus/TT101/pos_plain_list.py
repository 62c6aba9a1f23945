import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]  # expect: TT101
        self.act = nn.ReLU()

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return x


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.heads = {"cls": nn.Linear(16, 10), "box": nn.Linear(16, 4)}  # expect: TT101

    def forward(self, x):
        h = self.trunk(x)
        return {name: head(h) for name, head in self.heads.items()}
