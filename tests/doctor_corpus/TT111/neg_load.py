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

with torch.serialization.safe_globals([np.dtype]):  # serves weights_only=True, the default since torch 2.6
    arrays = torch.load("arrays.pt", map_location="cpu")


def load_compat(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except TypeError:  # torch < 1.13 has no weights_only: the shim for it
        return torch.load(path, map_location="cpu")


def load_versioned(path):
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (1, 13):
        return torch.load(path, map_location="cpu", weights_only=True)
    else:
        return torch.load(path, map_location="cpu")
