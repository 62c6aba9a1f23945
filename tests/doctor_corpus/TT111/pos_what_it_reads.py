"""TT111 says what the file shows the load reads: a whole pickled module (which weights_only=True, the
default since torch 2.6, refuses), state_dicts (weights_only=True is the fix), or something it does not show."""
import os

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

torch.save(model, "model.pt")  # expect: TT128
restored = torch.load("model.pt", map_location="cpu")  # expect: TT111

with open("full.pt", "wb") as fh:
    torch.save(model, fh)  # expect: TT128
with open("full.pt", "rb") as fh:
    again = torch.load(fh, map_location="cpu")  # expect: TT111

out = os.path.join("runs", "ckpt.pt")
for epoch in range(3):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, out)
ckpt = torch.load(out, map_location="cpu")  # expect: TT111


def restore(net, path):
    net.load_state_dict(torch.load(path, map_location="cpu"))  # expect: TT111
    return torch.load(path + ".extra", map_location="cpu")  # expect: TT111
