import torch
import torch.nn as nn
import torch.nn.functional as F

criterion = nn.CrossEntropyLoss()

total_loss, running = 0.0, 0.0
history = []
for x, y in loader:
    loss = criterion(model(x), y)
    loss.backward()
    total_loss += loss.item()
    history.append(loss.detach())
    running += float(loss)

# gradient accumulation: the sum is what gets backpropagated
for x, y in loader:
    loss = 0
    for chunk_x, chunk_y in zip(x.chunk(4), y.chunk(4)):
        part = criterion(model(chunk_x), chunk_y)
        loss += part / 4
    loss.backward()

# several heads: the losses are gathered, then summed for one backward
task_losses = []
for head, target in zip(heads, targets):
    l_task = F.mse_loss(head(h), target)
    task_losses.append(l_task)
torch.stack(task_losses).sum().backward()

# evaluation: no graph is recorded
with torch.no_grad():
    val = 0
    for x, y in val_loader:
        batch_loss = criterion(model(x), y)
        val += batch_loss
