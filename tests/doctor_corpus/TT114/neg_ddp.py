import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap(net, local_rank):
    return DDP(net, device_ids=[local_rank])


def unwrap(m):
    return m.module if isinstance(m, (nn.DataParallel, DDP)) else m  # recognising it is fine
