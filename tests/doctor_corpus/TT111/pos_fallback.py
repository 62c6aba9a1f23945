import torch


def load(path):
    try:
        return torch.load(path, map_location="cpu")  # expect: TT111
    except RuntimeError:  # the try did not choose weights_only either: no shim, the same unsafe load twice
        return torch.load(path, map_location="cpu")  # expect: TT111


def load_if(path, cpu):
    if cpu:
        return torch.load(path, map_location="cpu")  # expect: TT111
    return torch.load(path, map_location="cuda:0")  # expect: TT111


with open("ckpt.pt", "rb") as f:  # a plain with: nothing chosen
    state = torch.load(f, map_location="cpu")  # expect: TT111
