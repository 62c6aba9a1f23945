import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

X = torch.randn(100, 8).cuda()
Y = torch.randn(100, 1).cuda()
gpu_ds = TensorDataset(X, Y)
gpu_loader = DataLoader(gpu_ds, batch_size=10)  # already on the GPU: pinning would fail
for xb, yb in gpu_loader:
    xb = xb.to("cuda")
    loss = F.mse_loss(model(xb), yb)
    loss.backward()
