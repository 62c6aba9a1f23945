import torch
import torch.nn as nn
import torchvision
from torchvision import models


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


model = Net()
x = torch.randn(1, 3, 32, 32)
torch.onnx.export(model, (x,), "net.onnx")  # expect: TT130

backbone = models.resnet18(weights=None)
trunk = torch.nn.Sequential(*list(backbone.children())[:-1])
traced = torch.jit.trace(trunk, x)  # expect: TT130


def export_after_training(loader):
    net = torchvision.models.mobilenet_v3_small()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.eval()
    for xb, yb in loader:
        net.train()  # back to train mode for the epoch, never switched back
        opt.zero_grad()
        nn.functional.cross_entropy(net(xb), yb).backward()
        opt.step()
    return torch.export.export(net, (xb,))  # expect: TT130


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return nn.functional.dropout(self.fc(x), 0.5, training=self.training)


def to_torchscript(m, example):
    return torch.jit.trace(m, example)  # expect: TT130


scripted = to_torchscript(Dropper(), torch.randn(2, 16))


class Exportable(Net):
    def to_torchscript(self, example):
        self.train()
        return torch.jit.trace(self, example)  # expect: TT130
