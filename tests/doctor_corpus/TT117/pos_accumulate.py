import torch.nn as nn

total_loss = 0
for i in range(10000):
    optimizer.zero_grad()
    output = model(input)
    loss = criterion(output)
    loss.backward()
    optimizer.step()
    total_loss += loss  # expect: TT117


def train(model, loader, optimizer):
    criterion = nn.CrossEntropyLoss()
    losses = []
    running = 0.0
    for x, y in loader:
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss)  # expect: TT117
        running = running + loss * x.size(0)  # expect: TT117
    return running, losses
