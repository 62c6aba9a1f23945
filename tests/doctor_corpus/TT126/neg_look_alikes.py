import torch
import torch.nn as nn
import torch.nn.functional as F

net_g = nn.Linear(8, 4)
net_d = nn.Linear(4, 1)
opt_g = torch.optim.Adam(net_g.parameters())
opt_d = torch.optim.Adam(net_d.parameters())
loader = [torch.randn(8, 4)]
n_critic = 5

for i, real in enumerate(loader):  # a GAN: each network zeroed before its own backward
    net_d.zero_grad()
    err_d = net_d(real).mean() - net_d(net_g(torch.randn(8, 8)).detach()).mean()
    err_d.backward()
    opt_d.step()
    net_g.zero_grad()  # after D's backward, but G's backward follows before G's step
    err_g = -net_d(net_g(torch.randn(8, 8))).mean()
    err_g.backward()
    opt_g.step()

for i, real in enumerate(loader):  # WGAN: G trained every n_critic steps, its backward inside the if
    opt_d.zero_grad()
    (net_d(net_g(torch.randn(8, 8)).detach()).mean() - net_d(real).mean()).backward()
    opt_d.step()
    opt_g.zero_grad()
    if i % n_critic == 0:
        (-net_d(net_g(torch.randn(8, 8))).mean()).backward()
        opt_g.step()

for real in loader:  # zero_grad of the other network between D's backward and D's step
    err_d = net_d(real).mean()
    err_d.backward()
    net_g.zero_grad()
    opt_d.step()


class Trainer:
    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def fit(self, loader):
        for x, y in loader:
            F.mse_loss(self.model(x), y).backward()
            self.optimizer.step()
            self.on_step_end()  # a hook the file does not show (a subclass may zero here)

    def training_step(self, batch, batch_idx):  # Lightning style: the framework steps and zeroes
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        return loss


def skip_or_step(model, loader, skip):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        F.mse_loss(model(x), y).backward()
        if skip:
            opt.zero_grad()
        else:
            opt.step()
            opt.zero_grad()


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = nn.Linear(4, 1)
        self.g = nn.Linear(4, 4)


pair = TwoHeads()
opt_d2 = torch.optim.SGD(pair.d.parameters(), lr=0.1)
opt_g2 = torch.optim.SGD(pair.g.parameters(), lr=0.1)
for i, real in enumerate(loader):  # alternating updates, not accumulation: every step starts from zero
    pair.zero_grad()
    (pair.d(real).mean() + pair.g(real).mean()).backward()
    if i % 2 == 0:
        opt_d2.step()
    else:
        opt_g2.step()
