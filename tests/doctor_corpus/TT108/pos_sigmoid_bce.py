import torch
import torch.nn as nn
import torch.nn.functional as F


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 1)
        self.out = nn.Sigmoid()

    def forward(self, x):
        return self.out(self.fc(x))


D = Discriminator()
bce = nn.BCELoss()
real = torch.randn(8, 64)
pred = D(real)
loss_real = bce(pred, torch.ones(8, 1))  # expect: TT108
loss_fake = F.binary_cross_entropy(torch.sigmoid(D.fc(real)), torch.zeros(8, 1))  # expect: TT108
loss_alt = F.binary_cross_entropy(D.fc(real).sigmoid(), torch.zeros(8, 1))  # expect: TT108
