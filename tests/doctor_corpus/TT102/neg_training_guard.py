import torch.nn as nn
import torch.nn.functional as F


class GuardedDropout(nn.Module):
    """F.dropout without training= is fine where only training mode can reach it."""

    def __init__(self, p=0.1):
        super().__init__()
        self.p = p
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x = self.fc(x)
        if self.training:
            x = F.dropout(x, self.p)
        if self.training and self.p > 0:
            x = F.dropout2d(x, self.p)
        return F.dropout(x, self.p) if self.training else x


class EarlyExit(nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        return F.dropout(x, self.p)
