import math
import sys

import torch
import torch.nn as nn

device = torch.device("cuda")
model = nn.Linear(4, 2).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
log_interval = 10

for step, (x, y) in enumerate(loader):
    optimizer.zero_grad()
    loss = criterion(model(x.to(device)), y.to(device))
    loss.backward()
    optimizer.step()
    if step % log_interval == 0:  # read every N steps
        print(step, loss.item())

for epoch in range(10):
    total = torch.zeros((), device=device)
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        total += loss.detach()  # accumulated on the device
    print(epoch, total.item())  # once per epoch, outside the step loop

for x, y in loader:
    optimizer.zero_grad()
    loss = criterion(model(x.to(device)), y.to(device))
    loss_value = loss.item()
    if not math.isfinite(loss_value):  # the value decides the step: a NaN guard
        sys.exit(1)
    loss.backward()
    optimizer.step()

for x, y in loader:
    optimizer.zero_grad()
    loss = criterion(model(x.to(device)), y.to(device))
    loss.backward()
    optimizer.step()
    if args.verbose:
        print(loss.item())  # a debugging switch
    sizes = x.numpy().shape  # the batch as the loader gave it, on the host

print(loss.item())  # after the loop

for x, y in loader:  # a NaN guard: the test syncs once, its body runs only when training stops
    loss = criterion(model(x.to(device)), y.to(device))
    if not math.isfinite(loss.item()):
        print("Loss is {}, stopping training".format(loss.item()))
        sys.exit(1)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

for x, y in loader:  # an explicit synchronize for the logger's step time: the read after it waits for nothing
    loss = criterion(model(x.to(device)), y.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    # log
    torch.cuda.synchronize()
    print(loss.item())
