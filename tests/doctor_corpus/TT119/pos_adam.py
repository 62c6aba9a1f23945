import torch
from torch.optim import Adam

opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)  # expect: TT119
opt = Adam(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 5e-4)  # expect: TT119
opt = torch.optim.Adam([{"params": model.backbone.parameters(), "weight_decay": 1e-5},  # expect: TT119
                        {"params": model.head.parameters()}], lr=1e-4)
wd = 0.01
opt = torch.optim.Adam(model.parameters(), weight_decay=wd)  # expect: TT119
