import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """The seed's network: forward returns log-probabilities."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.fc = nn.Linear(1440, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = self.fc(x.flatten(1))
        return F.log_softmax(x, dim=1)


def train(model, loader, optimizer):
    criterion = nn.CrossEntropyLoss()
    for data, target in loader:
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)  # expect: TT106
        loss.backward()
        optimizer.step()


def token_loss(head, features, target):
    logits = head(features)
    log_probs = logits.log_softmax(-1)
    loss = F.cross_entropy(log_probs.view(-1, 10), target.view(-1))  # expect: TT106
    loss2 = nn.CrossEntropyLoss()(F.log_softmax(logits, 1), target)  # expect: TT106
    return loss + loss2


model = Net()
train(model, train_loader, opt)
