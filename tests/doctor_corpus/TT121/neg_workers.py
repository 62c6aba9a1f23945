import os

import torch
from torch.utils.data import DataLoader

loader = DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4)
for x, y in loader:
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()

val_loader = DataLoader(val_set, batch_size=128)  # evaluation only: no training loop
with torch.no_grad():
    for x, y in val_loader:
        model(x)

workers = os.cpu_count()
loader2 = DataLoader(dataset, batch_size=32, num_workers=workers)
for x, y in loader2:
    model(x).sum().backward()
