import torch
import torch.nn as nn

netG = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
netD = nn.Linear(16, 1)
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4)
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4)
loader = [torch.randn(4, 16)]

for real in loader:
    netD.zero_grad()
    err_real = criterion(netD(real), torch.ones(4, 1))
    noise = torch.randn(4, 8)
    fake = netG(noise)
    output = netD(fake)  # expect: TT136
    err_fake = criterion(output, torch.zeros(4, 1))
    (err_real + err_fake).backward()
    optimizerD.step()

    netG.zero_grad()
    err_g = criterion(netD(fake), torch.ones(4, 1))  # the generator's step: D(fake) is right here
    err_g.backward()
    optimizerG.step()
