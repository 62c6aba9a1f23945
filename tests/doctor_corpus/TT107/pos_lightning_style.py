import torch.nn.functional as F
from torch import nn, optim


class LitClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(128, 10)
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x):
        return F.softmax(self.backbone(x), dim=-1)

    def training_step(self, batch):
        x, y = batch
        probs = self(x)
        return self.criterion(probs, y)  # expect: TT107

    def configure_optimizers(self):
        return optim.SGD(self.parameters(), lr=0.1)
