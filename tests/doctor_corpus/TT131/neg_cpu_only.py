import torch
import torch.nn as nn

model = nn.Linear(4, 2)  # nothing here runs on CUDA: .item() costs no device sync
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]

running = 0.0
for x, y in loader:
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    running += loss.item()
