import numpy as np
import torch

state = torch.load("ckpt.pt", weights_only=True)  # expect: TT110
model_weights = state["model"]
other = np.zeros(3)
converted = torch.from_numpy(other)  # another array: the checkpoint's tensors keep their saved device
