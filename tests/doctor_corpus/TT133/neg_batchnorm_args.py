import torch.nn as nn

bn_default = nn.BatchNorm2d(64)
bn_eps = nn.BatchNorm2d(64, 1e-3)  # a real eps, positionally
bn_eps_edge = nn.BatchNorm1d(64, 0.01)
bn_named = nn.BatchNorm2d(64, momentum=0.8)  # what was meant, by name
bn_both = nn.BatchNorm2d(64, eps=1e-5, momentum=0.2)
group = nn.GroupNorm(8, 64, 0.8)  # GroupNorm(num_groups, num_channels, eps): not a BatchNorm
dropout = nn.Dropout(0.8)
