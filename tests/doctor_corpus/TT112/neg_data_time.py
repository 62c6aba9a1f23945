"""A data-time interval: the only device work between the reads is copying the batch (a blocking copy)."""
import time
import torch

device = torch.device("cuda")


def train_one_epoch(model, loader, optimizer):
    data_start = time.time()
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)          # blocking host->device copy
        data_time = time.time() - data_start       # time spent waiting for the batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(loss.item(), data_time)
        data_start = time.time()
