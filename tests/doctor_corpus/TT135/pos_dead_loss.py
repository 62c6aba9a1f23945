import torch
import torch.nn as nn
import torch.nn.functional as F

model = nn.Linear(4, 2)
aux_head = nn.Linear(4, 4)
criterion = nn.CrossEntropyLoss()
recon = nn.MSELoss()
opt = torch.optim.Adam(model.parameters())
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

for x, y in loader:
    opt.zero_grad()
    loss_cls = criterion(model(x), y)
    loss_rec = recon(aux_head(x), x)  # expect: TT135
    loss_cls.backward()
    opt.step()

for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        kl = F.kl_div(F.log_softmax(model(x), -1), F.softmax(model(x), -1), reduction="batchmean")  # expect: TT135
        ce = F.cross_entropy(model(x), y)
        ce.backward()
        opt.step()
