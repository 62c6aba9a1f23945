import torch
import torch.nn as nn

netG = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
netD = nn.Linear(16, 1)
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4)
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4)
loader = [torch.randn(4, 16)]

for real in loader:  # the DCGAN example: detached for D, as is for G
    netD.zero_grad()
    fake = netG(torch.randn(4, 8))
    err_d = criterion(netD(real), torch.ones(4, 1)) + criterion(netD(fake.detach()), torch.zeros(4, 1))
    err_d.backward()
    optimizerD.step()
    netG.zero_grad()
    err_g = criterion(netD(fake), torch.ones(4, 1))
    err_g.backward()
    optimizerG.step()

for real in loader:  # the generator first: D(fake) feeds G's step
    optimizerG.zero_grad()
    fake = netG(torch.randn(4, 8))
    criterion(netD(fake), torch.ones(4, 1)).backward()
    optimizerG.step()
    optimizerD.zero_grad()
    criterion(netD(fake.detach()), torch.zeros(4, 1)).backward()
    optimizerD.step()

for real in loader:  # fake made under no_grad: it has no graph to run into
    with torch.no_grad():
        fake = netG(torch.randn(4, 8))
    optimizerD.zero_grad()
    criterion(netD(fake), torch.zeros(4, 1)).backward()
    optimizerD.step()
