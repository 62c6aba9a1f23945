import torch
import torch.nn as nn
import torchvision


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)

    def save(self, path):
        torch.save(self, path)  # expect: TT128


model = Net()
torch.save(model, "model.pt")  # expect: TT128

backbone = torchvision.models.resnet18()
torch.save(obj=backbone, f="backbone.pth")  # expect: TT128

parallel = nn.DataParallel(model)  # expect: TT114
torch.save(parallel, "parallel.pt")  # expect: TT128


def build_and_save(path):
    from mynets import ResNetLike  # a model class of another file, used as a module below

    net = ResNetLike()
    optimizer = torch.optim.Adam(net.parameters())
    torch.save(net, path)  # expect: TT128
    return optimizer
