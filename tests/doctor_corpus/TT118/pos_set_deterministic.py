import torch
from torch import set_deterministic  # expect: TT118

torch.set_deterministic(True)  # expect: TT118
if torch.is_deterministic():  # expect: TT118
    print("deterministic")
