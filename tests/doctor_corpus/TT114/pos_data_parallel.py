import torch
import torch.nn as nn
from torch.nn.parallel import DataParallel as DP

net = nn.Linear(8, 8)
x = torch.randn(4, 8)
model = nn.DataParallel(net)  # expect: TT114
model = torch.nn.DataParallel(net.cuda(), device_ids=[0, 1], output_device=0)  # expect: TT114
wrapped = DP(net)  # expect: TT114
out = torch.nn.parallel.data_parallel(net, x, device_ids=[0, 1])  # expect: TT114


class Trainer:  # a training script's own class: the choice of DataParallel is made here
    def setup(self, net):
        self.model = nn.DataParallel(net)  # expect: TT114
