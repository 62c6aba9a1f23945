import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(x)


net = Net()
criterion = nn.CrossEntropyLoss()
images, labels = torch.randn(4, 32), torch.tensor([1, 2, 3, 4])
outputs = net(images)
_, predicted = torch.max(outputs.data, 1)  # expect: TT103
loss = criterion(outputs, labels)
print(loss.data)  # expect: TT103
