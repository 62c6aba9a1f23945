import torch


def make_deterministic():
    """Compatibility code: the old name only where the new one does not exist."""
    if hasattr(torch, "use_deterministic_algorithms"):
        torch.use_deterministic_algorithms(True)
    else:
        torch.set_deterministic(True)


def is_deterministic():
    try:
        return torch.are_deterministic_algorithms_enabled()
    except AttributeError:
        return torch.is_deterministic()


if hasattr(torch, "set_deterministic"):
    torch.set_deterministic(True)

try:
    from torch import set_deterministic
except ImportError:
    set_deterministic = torch.use_deterministic_algorithms
