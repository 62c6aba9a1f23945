import json
import pickle

import numpy as np
import torch
import yaml

state = torch.load("ckpt.pt", map_location="cpu", weights_only=True)
trusted = torch.load("mine.pt", "cpu", weights_only=False)  # our own file, positional map_location
scripted = torch.jit.load("model.pt")  # TorchScript archive: another loader
with open("cfg.yaml") as f:
    cfg = yaml.safe_load(f)
with open("meta.json") as f:
    meta = json.load(f)
with open("cache.pkl", "rb") as f:
    cache = pickle.load(f)
arr = np.load("a.npy")
