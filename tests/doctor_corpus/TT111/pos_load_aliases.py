import io

import torch.serialization
from torch import load as torch_load

buf = open("opt.pt", "rb")
ckpt = torch_load("ckpt.pt", map_location=lambda storage, loc: storage)  # expect: TT111
opt_state = torch.serialization.load(buf)  # expect: TT110, TT111
