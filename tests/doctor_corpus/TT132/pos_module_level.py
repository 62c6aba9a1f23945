import torch

torch.manual_seed(0)
torch.use_deterministic_algorithms(mode=True)
torch.backends.cudnn.benchmark = True  # expect: TT132
