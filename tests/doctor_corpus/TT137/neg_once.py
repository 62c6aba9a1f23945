import itertools

import torch
import torch.nn as nn


class Generator(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(8, 3)


gen = Generator(nn.Linear(3, 8))
disc = nn.Linear(3, 1)
both = torch.optim.Adam(list(gen.parameters()) + list(disc.parameters()))  # two separate models
chained = torch.optim.Adam(itertools.chain(gen.encoder.parameters(), gen.head.parameters()))  # siblings, not nested
groups = torch.optim.SGD([{"params": gen.head.parameters(), "lr": 0.1}, {"params": disc.parameters()}], lr=0.01)
size = 8
a, b = Generator(nn.Linear(3, size)), Generator(nn.Linear(3, size))  # a shared number, not a shared module
pair = torch.optim.Adam(list(a.parameters()) + list(b.parameters()))
