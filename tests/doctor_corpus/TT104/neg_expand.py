import torch


def mask_channels(mask_miss, heatmaps):
    mask = mask_miss.expand_as(heatmaps).clone()
    mask[:, :, -2, :, :] = 1
    return mask


def scaled(bias, n):
    b = bias.expand(n, -1)
    out = b * 2
    b = b.contiguous()  # a copy: from here on b owns its memory
    b.add_(1)
    return out + b


def tiled(x, n):
    y = x.repeat(n, 1)
    y[0] = 0
    return y


def attention_bias(bias, q):
    return q + bias.expand_as(q)
