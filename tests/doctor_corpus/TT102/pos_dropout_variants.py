import torch
from torch import nn
from torch.nn.functional import dropout2d


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        x = dropout2d(self.conv(x), p=0.1)  # expect: TT102

        def head(h):
            return self.fc(torch.nn.functional.dropout(h))  # expect: TT102

        return head(x.mean((2, 3)))
