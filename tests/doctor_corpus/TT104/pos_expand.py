import torch


def mask_channels(mask_miss, heatmaps):
    mask = mask_miss.expand_as(heatmaps)
    mask[:, :, -2, :, :] = 1  # expect: TT104
    return mask


def scaled_bias(bias, n):
    b = bias.expand(n, -1)
    b.mul_(2.0)  # expect: TT104
    b += 1  # expect: TT104
    return b


row = torch.zeros(1, 4)
grid = torch.broadcast_to(row, (3, 4))
grid[0, 0] = 5  # expect: TT104
torch.ones(1, 3).expand(4, 3).fill_(0)  # expect: TT104
