import time
from timeit import default_timer as timer

import torch
import torch.nn as nn

model = nn.Linear(1024, 1024).cuda()
x = torch.randn(64, 1024, device="cuda")

start = time.time()
y = model(x)
end = time.time()  # expect: TT112
print(f"forward took {end - start:.4f}s")


def bench(n=10):
    t0 = time.perf_counter()
    for _ in range(n):
        torch.matmul(x, x)
    elapsed = time.perf_counter() - t0  # expect: TT112
    return elapsed / n


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1024, 10)

    def forward(self, inp):
        return self.fc(inp)


net = Net().to("cuda")
tic = timer()
out = net(x).sum()
out.backward()
toc = timer()  # expect: TT112
