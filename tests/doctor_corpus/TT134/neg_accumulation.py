import torch
import torch.nn.functional as F

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters())
opt_d = torch.optim.AdamW(model.parameters())
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
accum_steps, log_every, n_critic = 4, 10, 5

for i, (x, y) in enumerate(loader):  # the right gate
    loss = F.cross_entropy(model(x), y) / accum_steps
    loss.backward()
    if (i + 1) % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()

for i, (x, y) in enumerate(loader, 1):  # counting from 1
    F.cross_entropy(model(x), y).backward()
    if i % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()

for i, (x, y) in enumerate(loader):  # logging every N steps, stepping every step
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if i % log_every == 0:
        print(i, loss.item())

for i, (x, y) in enumerate(loader):  # a GAN: the generator's backward and step every n_critic steps
    opt_d.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt_d.step()
    if i % n_critic == 0:
        optimizer.zero_grad()
        model(x).mean().backward()
        optimizer.step()

for i, (x, y) in enumerate(loader):  # N = 1: every step
    F.cross_entropy(model(x), y).backward()
    if i % 1 == 0:
        optimizer.step()
        optimizer.zero_grad()
