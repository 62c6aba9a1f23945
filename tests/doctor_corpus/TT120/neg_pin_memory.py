import torch
from torch.utils.data import DataLoader

device = torch.device("cuda")
train_loader = DataLoader(train_set, batch_size=64, shuffle=True, num_workers=4, pin_memory=True)
for images, labels in train_loader:
    images = images.to(device, non_blocking=True)
    model(images)

cpu_loader = DataLoader(test_set, batch_size=64, num_workers=2)  # batches stay on the CPU
for x, y in cpu_loader:
    x = x.to(torch.float64)
    stats.update(x)

cpu = "cpu"
local_loader = DataLoader(test_set, batch_size=64, num_workers=2)
for x, y in local_loader:
    x = x.to(cpu)
    stats.update(x)

explicit_off = DataLoader(big_set, batch_size=64, num_workers=4, pin_memory=False)  # chosen: host short of RAM
for x, y in explicit_off:
    x = x.cuda()
    model(x)
