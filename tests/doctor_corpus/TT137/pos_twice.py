import itertools

import torch
import torch.nn as nn


class Generator(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(8, 3)


class Reconstructor(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(8, 3)


encoder = nn.Linear(3, 8)
gen = Generator(encoder)
rec = Reconstructor(encoder)
opt = torch.optim.Adam(list(gen.parameters()) + list(rec.parameters()), lr=1e-3)  # expect: TT137
opt2 = torch.optim.Adam(itertools.chain(gen.parameters(), rec.parameters()))  # expect: TT137

model = Generator(nn.Linear(3, 8))
finetune = torch.optim.SGD([*model.parameters(), *model.head.parameters()], lr=0.1)  # expect: TT137
