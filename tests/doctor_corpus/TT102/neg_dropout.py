import torch.nn as nn
import torch.nn.functional as F


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        x = F.dropout(x, p=0.5, training=self.training)
        x = F.dropout(x, 0.5, self.training)
        x = self.drop(x)
        return self.fc(x)


class MCDropout(nn.Module):
    """Monte-Carlo dropout: on at test time on purpose, and it says so."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return F.dropout(self.fc(x), p=0.1, training=True)


def augment(x):
    """A data augmentation, not a module's forward: there is no eval mode to ignore."""
    return F.dropout(x, 0.1)
