import torch

loader = torch.utils.data.DataLoader(dataset, 64, True, None, None, 0)  # expect: TT121
for x, y in loader:
    opt.zero_grad()
    criterion(model(x), y).backward()
    opt.step()
