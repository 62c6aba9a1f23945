import torch


def evaluate(model, x):
    for p in model.backbone.parameters():  # the head still requires grad
        p.requires_grad = False
    model.eval()
    return model(x)  # expect: TT116


def score(model, other, x):
    other.requires_grad_(False)  # a different model
    model.eval()
    return model(x)  # expect: TT116
