import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

cpu_ds = TensorDataset(torch.randn(100, 8), torch.randn(100, 1))
mem_loader = DataLoader(cpu_ds, batch_size=10, shuffle=True, pin_memory=True)  # tensors in RAM: workers only add overhead
for xb, yb in mem_loader:
    loss = F.mse_loss(model(xb.cuda()), yb.cuda())
    loss.backward()
