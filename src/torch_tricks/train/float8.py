"""T37: float8 training of the Linear layers (torchao's ``convert_to_float8_training``).

Each converted Linear casts its input, weight and output gradient to float8 with a per-tensor scale and runs its
three matmuls on float8 tensor cores; weights, optimizer state and everything else stay as they were. The gain is
the tensor cores' (1.25-1.5x reported for large models on H100-class GPUs), so it is for CUDA capability 8.9+
(H100, L4, RTX 40xx). Small layers lose more to the casts than they gain (torchao #572: "what is the smallest
model this helps" has no answer but a measurement), and without ``torch.compile`` the casts are not fused.

On a CPU torch runs the float8 matmuls without float8 units: measured on a 2-core Xeon (two 1024 x 1024 Linears,
batch 256, forward and backward), 5.5x slower than fp32; so a CPU is refused in one line rather than measured.

torchao does the conversion; this module says where it runs and which layers it takes: float8 matmuls need both
dimensions of a Linear divisible by 16, so the others stay as they are, and the count is reported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_tricks._optional import available, install_hint
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["FLOAT8_CAPABILITY", "float8_available", "float8_linears", "float8_training"]

FLOAT8_CAPABILITY = (8, 9)  # the first CUDA capability with float8 tensor cores (Ada, Hopper)


def float8_available(device: torch.device | str) -> tuple[bool, str]:
    """(can float8 training run on ``device``, why not): CUDA capability 8.9+, and torchao."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False, ("float8 training needs float8 tensor cores (a CUDA GPU of capability 8.9+: H100, L4, RTX 40xx); "
                       f"on {dev.type} its matmuls run without them (measured on a CPU: 5.5x slower than fp32)")
    cap = torch.cuda.get_device_capability(dev)
    if cap < FLOAT8_CAPABILITY:
        return False, (f"float8 training needs CUDA capability 8.9+ (H100, L4, RTX 40xx); "
                       f"{torch.cuda.get_device_name(dev)} is {cap[0]}.{cap[1]}")
    if not available("torchao.float8"):
        return False, f"float8 training needs torchao: {install_hint('float8')}"
    return True, ""


def float8_linears(model: nn.Module) -> tuple[list[str], int]:
    """(the names of the Linear layers float8 can take: both dimensions divisible by 16, the number of Linears)."""
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    return [name for name, m in linears if _takes(m)], len(linears)


@register_trick(
    "float8",
    ids=("T37",),
    kind="train",
    trades="faster large matmuls on float8 tensor cores for the precision of per-tensor-scaled float8 products "
           "(and casts that cost more than they gain on small layers)",
    needs="a CUDA GPU of capability 8.9+ and torchao; Linear layers whose dimensions are multiples of 16",
    config_key="float8",
    available=float8_available,
    measured_in="benchmarks/train_tricks.py",
)
def float8_training(model: nn.Module, device: torch.device | str | None = None) -> tuple[nn.Module, int, int]:
    """``model`` with its float8-able Linear layers converted in place (their parameters are kept, so an
    optimizer built before still holds them); returns (model, layers converted, Linear layers). One line where the
    device cannot run it or no layer qualifies."""
    dev = torch.device(device) if device is not None else next(model.parameters(), torch.empty(0)).device
    ok, why = float8_available(dev)
    if not ok:
        raise UserError(why)
    names, total = float8_linears(model)
    if not names:
        raise UserError(f"float8 training: none of the model's {total} Linear layers has both dimensions divisible "
                        "by 16 (what float8 matmuls need): switch float8 off")
    from torchao.float8 import convert_to_float8_training

    take = set(names)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in take and _takes(m))
    return model, len(names), total


def _takes(m: Any) -> bool:
    return isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0
