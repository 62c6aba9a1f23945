import torch
import torch.nn as nn

device = torch.device("cuda")
model = nn.Linear(4, 2).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

running = 0.0
for x, y in loader:
    x, y = x.to(device), y.to(device)
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    running += loss.item()  # expect: TT131
    print(loss.item())  # the same loop: reported once

history = []
for epoch in range(10):
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        history.append(float(loss))  # expect: TT131


def train(model, loader, optimizer):
    predictions = []
    for x, y in loader:
        out = model(x.cuda())
        loss = nn.functional.cross_entropy(out, y.cuda())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        predictions.extend(out.argmax(1).cpu().tolist())  # expect: TT131
    return predictions
