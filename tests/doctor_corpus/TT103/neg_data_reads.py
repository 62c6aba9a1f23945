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
_, predicted = torch.max(outputs.data, 1)  # a read outside forward: nothing changes
loss = criterion(outputs, labels)
print(loss.data)
w = torch.randn(3, requires_grad=True)
snapshot = w.data.clone()
for name, param in net.named_parameters():
    print(name, param.data.norm(), param.grad.data.norm() if param.grad is not None else None)
