import torch


def relative_distances(img_size):
    ind = (
        torch.arange(img_size, dtype=torch.float32).view(1, -1)
        - torch.arange(img_size, dtype=torch.float32).view(-1, 1)
    )
    indx = ind.repeat(img_size, img_size)
    indy = ind.repeat_interleave(img_size, dim=0).repeat_interleave(img_size, dim=1)
    indd = indx ** 2 + indy ** 2
    return indd ** .5  # a grid of constants: no gradient flows through it


def radius(h, w):
    ys = torch.linspace(-1, 1, h)
    xs = torch.linspace(-1, 1, w)
    return torch.sqrt(ys[:, None] ** 2 + xs[None, :] ** 2)
