"""Tensors unpacked from a batch handed in by the caller: their kind shows only in how they are used."""
import torch


def train_step(model, batch, device):
    images, labels = batch
    images.cuda()  # expect: TT113
    labels.to(device)  # expect: TT113
    out = model(images.view(images.size(0), -1))
    return torch.nn.functional.cross_entropy(out, labels)


def evaluate_step(model, x, y):
    x.cuda()  # expect: TT113
    return model(x.unsqueeze(0)), torch.cat([y, y])
