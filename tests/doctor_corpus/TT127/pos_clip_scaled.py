import torch
import torch.nn as nn
from torch.nn.utils import clip_grad_value_

model = nn.Linear(4, 2).cuda()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
scaler = torch.cuda.amp.GradScaler()

for x, y in loader:
    optimizer.zero_grad()
    with torch.autocast("cuda"):
        loss = criterion(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: TT127
    scaler.step(optimizer)
    scaler.update()


class Trainer:
    def __init__(self, model, use_amp):
        self.model = model
        self.use_amp = use_amp
        self.optimizer = torch.optim.AdamW(model.parameters())
        self.scaler = torch.amp.GradScaler("cuda", enabled=use_amp)  # enabled when use_amp: not provably off

    def step(self, loss):
        self.optimizer.zero_grad(set_to_none=True)
        if self.use_amp:
            self.scaler.scale(loss).backward()
            clip_grad_value_(self.model.parameters(), 0.5)  # expect: TT127
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            clip_grad_value_(self.model.parameters(), 0.5)
            self.optimizer.step()


def train_step(model, batch, optimizer, scaler, use_amp):
    x, y = batch
    with torch.autocast("cuda", enabled=use_amp):
        loss = criterion(model(x), y)
    if use_amp:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: TT127
    scaler.unscale_(optimizer)  # too late: after the clipping
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
