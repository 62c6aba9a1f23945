import torch.nn as nn
import torch.nn.functional as F
from torch.nn import MSELoss

reduce_false = MSELoss(size_average=True, reduce=False)  # expect: TT109
summed = nn.MSELoss(size_average=False)  # expect: TT109
ce = nn.CrossEntropyLoss(reduce=True)  # expect: TT109
bce = nn.modules.loss.BCELoss(reduce=False)  # expect: TT109


def loss_fn(out, y):
    return F.nll_loss(out, y, size_average=False)  # expect: TT109
