import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import datasets


class Wrapped(Dataset):
    def __init__(self, data):
        self.data = data  # an attribute that happens to be called data

    def __getitem__(self, i):
        return self.data[i]

    def __len__(self):
        return len(self.data)


mnist = datasets.MNIST("root", download=False)
images = mnist.data.float() / 255  # torchvision's dataset field, not Tensor.data
arr = np.zeros(3)
view = memoryview(arr.data)  # numpy's buffer
config = {"data": "path/to/data"}
root = config["data"]


def sgd_step(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


w = torch.randn(3, requires_grad=True)
snapshot = w.detach().clone()
