import torch
from torch.cuda import empty_cache

for images, labels in train_loader:
    out = model(images.cuda())
    loss = criterion(out, labels.cuda())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    torch.cuda.empty_cache()  # expect: TT115

step = 0
while step < 1000:
    loss = model(x).sum()
    loss.backward()
    torch.cuda.empty_cache()  # expect: TT115
    step += 1

for i, batch in enumerate(loader):
    model(batch)
    empty_cache()  # expect: TT115
