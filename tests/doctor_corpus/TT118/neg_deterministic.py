import torch

torch.use_deterministic_algorithms(True)
torch.backends.cudnn.deterministic = True
assert torch.are_deterministic_algorithms_enabled()


def set_deterministic(flag):
    """A helper of our own that happens to carry the old name."""
    torch.use_deterministic_algorithms(flag)


set_deterministic(True)
