import torch.nn as nn
import torch.nn.functional as F


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.dropout(x, 0.5)  # expect: TT102
        x = F.dropout(x, p=0.2, inplace=False)  # expect: TT102
        return self.fc2(x)
