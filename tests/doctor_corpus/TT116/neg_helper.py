"""Helpers that are right: no_grad inside, a decorated helper, a helper called under no_grad,
a helper that wants gradients, and one that switches back to train() itself."""
import torch


def predict(net, loader):
    with torch.no_grad():
        return [net(x) for x, _ in loader]


@torch.inference_mode()
def predict_fast(net, loader):
    return [net(x) for x, _ in loader]


def raw_predict(net, loader):
    return [net(x) for x, _ in loader]


def saliency(net, x):
    x.requires_grad_(True)
    net(x).sum().backward()
    return x.grad


def finetune_step(net, x, y):
    net.train()
    out = net(x)
    return out


def run(model, val_loader, x, y):
    model.eval()
    predict(model, val_loader)
    predict_fast(model, val_loader)
    with torch.no_grad():
        raw_predict(model, val_loader)
    saliency(model, x)
    finetune_step(model, x, y)
