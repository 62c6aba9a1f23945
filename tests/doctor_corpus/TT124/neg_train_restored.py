import torch
import torch.nn as nn


def validate(model, loader):
    model.eval()
    with torch.no_grad():
        acc = sum(float((model(x).argmax(1) == y).sum()) for x, y in loader)
    model.train()  # the helper restores it
    return acc


def evaluate(model, loader):
    model.eval()
    with torch.no_grad():
        return sum(float(model(x).sum()) for x, _ in loader)


def train(model, train_loader, val_loader, epochs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        model.train()  # every epoch starts in train mode
        for x, y in train_loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        evaluate(model, val_loader)
        validate(model, val_loader)


@torch.no_grad()
def test_loop(model, loader):  # no training in this loop: eval for good
    model.eval()
    for x, _ in loader:
        model(x)


def train_with_restoring_helper(model, loader, val_loader):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        validate(model, val_loader)
