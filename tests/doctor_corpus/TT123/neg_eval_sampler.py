import torch
from torch.utils.data import DataLoader, DistributedSampler


def val_loader(dataset):  # evaluation: no shuffling, so the epoch does not matter
    return DataLoader(dataset, batch_size=64, sampler=DistributedSampler(dataset, shuffle=False))


def build_loader(dataset):  # a loader factory with no training loop in the file: its caller sets the epoch
    return DataLoader(dataset, batch_size=64, sampler=DistributedSampler(dataset))


@torch.no_grad()
def evaluate(model, loader):
    total = 0.0
    for x, y in loader:
        total += float((model(x).argmax(1) == y).sum())
    return total
