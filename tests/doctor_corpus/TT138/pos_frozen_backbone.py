import torch
import torch.nn as nn
import torchvision

backbone = torchvision.models.resnet50(weights=None)
for p in backbone.parameters():  # expect: TT138
    p.requires_grad = False
backbone.fc = nn.Identity()
head = nn.Linear(2048, 10)
model = nn.Sequential(backbone, head)
opt = torch.optim.SGD(head.parameters(), lr=0.1)
for x, y in loader:
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.encoder.requires_grad_(False)  # expect: TT138
        self.head = nn.Linear(8, 2)
