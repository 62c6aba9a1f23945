import torch
import torch.nn.functional as F

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.AdamW(model.parameters())
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
accum_steps = 4

for i, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x), y) / accum_steps
    loss.backward()
    if i % accum_steps == 0:  # expect: TT134
        optimizer.step()
        optimizer.zero_grad()


def train(net, opt, data, grad_accum):
    for step, batch in enumerate(data, start=0):
        net(batch).mean().backward()
        if not step % grad_accum:  # expect: TT134
            opt.step()
            opt.zero_grad()
