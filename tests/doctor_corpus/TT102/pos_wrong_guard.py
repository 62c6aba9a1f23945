import torch.nn as nn
import torch.nn.functional as F


class WrongBranch(nn.Module):
    """Guards that do not keep dropout out of eval mode."""

    def __init__(self, p=0.1):
        super().__init__()
        self.p = p
        self.use_dropout = True

    def forward(self, x):
        if self.use_dropout:
            x = F.dropout(x, self.p)  # expect: TT102
        if not self.training:
            x = F.dropout(x, self.p)  # expect: TT102
        return x if self.training else F.dropout(x, self.p)  # expect: TT102


class ReturnsInTraining(nn.Module):
    def forward(self, x):
        if self.training:
            return x
        return F.alpha_dropout(x, 0.2)  # expect: TT102
