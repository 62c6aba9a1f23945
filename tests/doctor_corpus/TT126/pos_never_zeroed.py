import torch
import torch.nn as nn
import torch.nn.functional as F

model = nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]


def log_step(step, value):
    print(step, value)


for step, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()  # expect: TT126
    log_step(step, float(loss))  # a helper of this file: it does not zero anything

optimizer.zero_grad()  # once, before the loop: gradients still pile up step after step
for epoch in range(10):
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()  # expect: TT126


def train(net, loader, epochs):
    opt = torch.optim.AdamW(net.parameters())
    scaler = torch.amp.GradScaler()
    for epoch in range(epochs):
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(x).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)  # expect: TT126
            scaler.update()
