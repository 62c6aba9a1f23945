from torch.utils.data import DataLoader

loader = DataLoader(dataset, batch_size=32, shuffle=True)  # expect: TT121
for x, y in loader:
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()

loader0 = DataLoader(dataset, batch_size=32, num_workers=0, pin_memory=True)  # expect: TT121


def train(net, dl, opt):
    for i, (x, y) in enumerate(dl):
        loss = net(x).mean()
        loss.backward()
        opt.step()


train(model, loader0, optimizer)
