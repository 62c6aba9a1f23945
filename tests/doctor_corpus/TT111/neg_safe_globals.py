import torch

from mypkg.config import TrainState

torch.serialization.add_safe_globals([TrainState])  # the file loads with weights_only=True, allowing these
state = torch.load("state.pt", map_location="cpu")
