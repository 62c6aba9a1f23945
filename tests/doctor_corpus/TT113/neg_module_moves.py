import torch
import torch.nn as nn
import torchvision

device = torch.device("cuda")
model = nn.Linear(4, 2)
model.cuda()  # a Module moves in place
model.to(device)
net = torchvision.models.resnet18()
net.half()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)

    def forward(self, x):
        return self.encoder(x)

    def move(self, dev):
        self.to(dev)
        self.encoder.cuda()


m = Net()
m.to(device)

x = torch.randn(3, 4)
x = x.cuda()
y = x.to("cuda", non_blocking=True)


def setup(model, dev):
    model.to(dev)  # by convention a model: nothing says it is a tensor
    model.float()


for images, labels in loader:
    images, labels = images.to(device), labels.to(device)
