import torch
import torch.nn as nn
import torch.nn.functional as F

model = nn.Linear(4, 2)
criterion = nn.CrossEntropyLoss()
recon = nn.MSELoss()
opt = torch.optim.Adam(model.parameters())
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

for x, y in loader:  # both terms summed
    opt.zero_grad()
    loss_cls = criterion(model(x), y)
    loss_rec = recon(model(x), torch.zeros(8, 2))
    (loss_cls + 0.1 * loss_rec).backward()
    opt.step()

for x, y in loader:  # a term only logged: read, so quiet (a monitoring metric)
    opt.zero_grad()
    loss = criterion(model(x), y)
    val = F.mse_loss(model(x), torch.zeros(8, 2))
    loss.backward()
    opt.step()
    print(val.item())

for x, y in loader:  # each loss its own backward
    opt.zero_grad()
    a = criterion(model(x), y)
    a.backward()
    b = F.cross_entropy(model(x), y)
    b.backward()
    opt.step()

last = None
for x, y in loader:  # kept for after the loop
    opt.zero_grad()
    loss = criterion(model(x), y)
    final = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
print(final)

with torch.no_grad():
    for x, y in loader:  # evaluation: no backward in the loop
        unused = criterion(model(x), y)

for x, y in loader:
    opt.zero_grad()
    _ = criterion(model(x), y)  # thrown away on purpose
    criterion(model(x), y).backward()
    opt.step()
