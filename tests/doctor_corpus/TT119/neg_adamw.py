import torch

opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0)
opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4, decoupled_weight_decay=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)  # SGD: L2 is weight decay
