import torch

for epoch in range(10):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    torch.cuda.empty_cache()  # once per epoch, between phases

for i, (x, y) in enumerate(loader):
    loss = criterion(model(x), y)
    loss.backward()
    if i % 500 == 0:
        torch.cuda.empty_cache()

for x, y in loader:
    try:
        loss = criterion(model(x), y)
        loss.backward()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()  # recover from an out-of-memory batch and skip it
        continue

for name in ["resnet18", "resnet50"]:
    benchmark(name)
    torch.cuda.empty_cache()  # between benchmarks of different models, not training steps
