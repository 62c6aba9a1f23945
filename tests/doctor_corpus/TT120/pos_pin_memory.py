import torch
from torch.utils.data import DataLoader

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
train_loader = DataLoader(train_set, batch_size=64, shuffle=True, num_workers=4)  # expect: TT120

for epoch in range(10):
    for images, labels in train_loader:
        images, labels = images.to(device), labels.to(device)
        model(images)


class Runner:
    def __init__(self, ds):
        self.loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=8, persistent_workers=True)  # expect: TT120

    def run(self, model):
        for batch in self.loader:
            x = batch["x"].cuda(non_blocking=True)
            model(x)
