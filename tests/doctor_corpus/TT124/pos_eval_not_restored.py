import torch
import torch.nn as nn


def validate(model, loader):
    model.eval()
    with torch.no_grad():
        return sum(float((model(x).argmax(1) == y).sum()) for x, y in loader)


def train(model, train_loader, val_loader, epochs):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(epochs):
        for x, y in train_loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        acc = validate(model, val_loader)  # expect: TT124


def train_inline(model, loader, epochs):
    opt = torch.optim.AdamW(model.parameters())
    for epoch in range(epochs):
        for x, y in loader:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        model.eval()  # expect: TT124
        with torch.no_grad():
            print(model(x).mean())
