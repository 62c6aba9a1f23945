import torch
import torch.nn as nn


class ParallelStrategy:
    pass


class DataParallelStrategy(ParallelStrategy):
    """A framework's option: its user picks it (or DDP) in a config; this code only implements it."""

    def __init__(self, device_ids):
        self.device_ids = device_ids

    def setup(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model, device_ids=self.device_ids)


def wrap_data_parallel(model, devices):  # a helper that exists to offer it
    return torch.nn.DataParallel(model, device_ids=devices)
