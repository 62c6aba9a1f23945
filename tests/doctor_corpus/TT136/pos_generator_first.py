import torch
import torch.nn as nn

generator = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
discriminator = nn.Linear(16, 1)
adversarial_loss = nn.BCEWithLogitsLoss()
optimizer_G = torch.optim.Adam(generator.parameters(), lr=2e-4)
optimizer_D = torch.optim.Adam(discriminator.parameters(), lr=2e-4)
dataloader = [torch.randn(4, 16)]

for epoch in range(10):
    for i, imgs in enumerate(dataloader):
        valid, fake = torch.ones(4, 1), torch.zeros(4, 1)
        optimizer_G.zero_grad()
        gen_imgs = generator(torch.randn(4, 8))
        g_loss = adversarial_loss(discriminator(gen_imgs), valid)
        g_loss.backward()
        optimizer_G.step()

        optimizer_D.zero_grad()
        real_loss = adversarial_loss(discriminator(imgs), valid)
        fake_loss = adversarial_loss(discriminator(gen_imgs), fake)  # expect: TT136
        d_loss = (real_loss + fake_loss) / 2
        d_loss.backward()
        optimizer_D.step()
