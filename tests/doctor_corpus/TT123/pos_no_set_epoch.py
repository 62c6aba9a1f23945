import torch
import torch.nn as nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def train(model, dataset, epochs):
    sampler = DistributedSampler(dataset)  # expect: TT123
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


def make_loader(dataset):
    return DataLoader(dataset, batch_size=8, num_workers=4,
                      sampler=torch.utils.data.DistributedSampler(dataset, shuffle=True))  # expect: TT123


def fit(model, dataset):
    opt = torch.optim.AdamW(model.parameters())
    for epoch in range(3):
        for x, y in make_loader(dataset):
            model(x).sum().backward()
            opt.step()  # expect: TT126
