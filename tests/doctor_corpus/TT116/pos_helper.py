"""eval() in the loop, the forward in a helper of the same file that has no no_grad."""
import torch


def predict(net, loader):
    outputs = []
    for x, _ in loader:
        outputs.append(net(x))  # expect: TT116
    return outputs


def train(model, loader, val_loader, optimizer):
    for epoch in range(10):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        predict(model, val_loader)
