import torch.nn as nn


class MLP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.sizes = list(sizes)
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])])
        self.heads = nn.ModuleDict({"cls": nn.Linear(16, 10)})
        self.acts = [nn.ReLU(), nn.Tanh()]  # no parameters, no train/eval behaviour: nothing lost
        self.names = ["a", "b"]

    def forward(self, x):
        for layer, act in zip(self.layers, self.acts):
            x = act(layer(x))
        return self.heads["cls"](x)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Linear(4, 4) for _ in range(3)]
        self.net = nn.Sequential(*layers)
        self.blocks = []
        for _ in range(2):
            self.blocks.append(nn.Linear(4, 4))
        self.blocks = nn.ModuleList(self.blocks)

    def forward(self, x):
        return self.net(x)


class Registered(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 4) for _ in range(3)]
        for i, layer in enumerate(self.layers):
            self.add_module(f"layer{i}", layer)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Builder:
    """Not a Module: a plain object holding layers registers nothing and loses nothing."""

    def __init__(self):
        self.parts = [nn.Linear(4, 4), nn.Linear(4, 4)]

    def build(self):
        return nn.Sequential(*self.parts)


class Nested(nn.Module):
    def __init__(self, nstack=2):
        super().__init__()
        self.outs = nn.ModuleList(
            [nn.ModuleList([nn.Linear(2, 2) for j in range(4)]) for i in range(nstack)])

    def forward(self, x):
        return [[head(x) for head in row] for row in self.outs]
