import torch


@torch.no_grad()
def validate(model, loader):
    model.eval()
    return [model(x) for x, _ in loader]


def validate_inference_mode(model, loader):
    model.eval()
    with torch.inference_mode():
        for x, _ in loader:
            model(x)


def saliency(model, x):
    model.eval()
    x.requires_grad_(True)
    score = model(x).max()
    score.backward()  # gradients are the point
    return x.grad


def evaluate(model, loader):
    model.eval()
    return [model(x) for x, _ in loader]


def main(net, val_loader):
    with torch.no_grad():
        return evaluate(net, val_loader)


def predict(model, x):
    model.eval()
    torch.set_grad_enabled(False)
    return model(x)


def export(model, example):
    model.eval()
    return torch.jit.trace(model, example)
