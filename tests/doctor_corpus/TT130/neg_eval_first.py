import torch
import torch.nn as nn
from torchvision import models

from mylib import prepare


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


x = torch.randn(1, 3, 32, 32)

model = Net()
model.eval()
torch.onnx.export(model, (x,), "net.onnx")

frozen = Net().eval()
torch.jit.trace(frozen, x)

torch.export.export(Net().train(False), (x,))

inline = Net()
torch.jit.trace(inline.eval(), x)

legacy = Net()
torch.onnx.export(legacy, (x,), "legacy.onnx", dynamo=False)  # the TorchScript exporter switches to eval itself

trainable = Net()
torch.onnx.export(trainable, (x,), "train.onnx", training=torch.onnx.TrainingMode.TRAINING)  # on purpose


class Plain(nn.Module):  # nothing that differs between train and eval
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


torch.jit.trace(Plain(), torch.randn(2, 16))


def export(model, path):  # a model passed in: its mode is set by the caller
    torch.onnx.export(model, (torch.randn(1, 3, 32, 32),), path)


def export_prepared(path):
    resnet = models.resnet18()
    prepare(resnet)  # may switch it to eval: code the file does not show
    torch.jit.trace(resnet, x)


def trunk_of_evaluated():
    full = models.resnet18()
    full.eval()  # the children are the same modules: the trunk is in eval too
    trunk = nn.Sequential(*list(full.children())[:-1])
    return torch.jit.trace(trunk, x)


def evaluate(net):
    net.eval()


def export_evaluated():
    resnet = models.resnet50()
    evaluate(resnet)
    torch.jit.trace(resnet, x)


def trace_global():
    return torch.jit.trace(model, x)  # the module-level model is put in eval above


def export_caller_eval(m):
    return torch.jit.trace(m, x)


net = Net()
net.eval()
export_caller_eval(net)


class Exportable(Net):
    def to_torchscript(self, example):
        return torch.jit.trace(self, example)  # a method: its caller decides the mode
