import numpy as np
import torch

data = torch.load("traindata.pt", weights_only=False)  # a NumPy array saved with torch.save: no device in it
inputs = torch.from_numpy(data[3:, :-1])
targets = torch.from_numpy(data[3:, 1:])


def load_stats(path):
    stats = torch.load(path, weights_only=False)
    return np.asarray(stats).mean()
