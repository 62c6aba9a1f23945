import torch
import torch.nn as nn
from sklearn.preprocessing import StandardScaler

model = nn.Linear(4, 2).cuda()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
scaler = torch.cuda.amp.GradScaler()

for x, y in loader:  # the documented order
    optimizer.zero_grad()
    with torch.autocast("cuda"):
        loss = criterion(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()

off = torch.amp.GradScaler("cuda", enabled=False)  # provably disabled: scale() returns the loss as is
for x, y in loader:
    optimizer.zero_grad()
    off.scale(criterion(model(x), y)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    off.step(optimizer)
    off.update()


def step(loss, use_amp, clip):
    if use_amp:
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # the fp32 branch: nothing is scaled
        optimizer.step()
    optimizer.zero_grad()


def without_scaler(loss):
    features = StandardScaler()  # another kind of scaler
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return features


def clip_then_scale(loss):  # clipping before this step's backward (last step's unscaled gradients)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
