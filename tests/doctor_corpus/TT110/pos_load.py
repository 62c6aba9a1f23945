import torch

state = torch.load("ckpt.pt")  # expect: TT110, TT111


def restore(model, path):
    model.load_state_dict(torch.load(path, weights_only=True))  # expect: TT110


weights = torch.load("w.pt", map_location="cpu")  # expect: TT111
