"""torch.load of an in-memory buffer written by torch.save in the same job (an object broadcast, bytes
from a worker): no file moves between machines, and the devices are kept on purpose."""
import io
import torch


def broadcast(obj, device):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.tensor(bytearray(buffer.getbuffer()), device=device)
    # ... collective broadcast of `data` ...
    buffer = io.BytesIO(data.cpu().byte().numpy())
    return torch.load(buffer, weights_only=False)  # keeps each tensor's device, on purpose


def from_worker(metrics_bytes):
    return torch.load(io.BytesIO(metrics_bytes), weights_only=True)  # saved after .cpu() by the worker
