import torch


def prune_scores(conv):
    """Channel importance for pruning: computed on detached weights, no gradient flows."""
    w = conv.weight.detach().flatten(1)
    return w.pow(2).sum(1).sqrt()


def grad_penalty(critic, real):
    real.requires_grad_(True)
    out = critic(real)
    grads = torch.autograd.grad(out.sum(), real, create_graph=True)[0]
    return ((grads.norm(2, dim=1) - 1) ** 2).mean()
