"""T29: the optimizer's state in 8 or 4 bits (torchao), a quarter or an eighth of AdamW's 8 bytes a parameter.

AdamW keeps two fp32 moments per parameter: for a model of N parameters, 8N bytes that live
through the whole run, as much as the weights and gradients together. torchao's
``AdamW8bit`` / ``AdamW4bit`` (and ``Adam8bit`` / ``Adam4bit``) keep them block-quantized
(blocks of 256 / 128 values, each with its own scale; tensors under 4,096 values stay fp32,
as in bitsandbytes) and compute each update in fp32. :func:`low_precision_state` rebuilds an
Adam or AdamW with the same parameter groups and hyper-parameters on that state;
``Tricks`` does it under ``optimizer_state = "8bit" | "4bit"``. :func:`state_bytes` measures
what the state really holds (a quantized state's codes and scales).

torchao compiles its per-parameter step (``torch.compile``, once per parameter shape): on a
CPU the first step costs seconds to tens of seconds of compilation with a cold inductor
cache, then each step is about as fast as the loop's. Under
``torch.compiler.set_stance("force_eager")`` it runs uncompiled.

Written here rather than used directly: the optimizers are torchao's; this module only
carries an optimizer's groups and settings over, and counts the quantized state's bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tricks._optional import available as module_available
from torch_tricks._optional import install_hint, require
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["STATES", "low_precision_state", "state_bytes", "available"]

STATES = ("8bit", "4bit")
_CLASSES = {("adamw", "8bit"): "AdamW8bit", ("adamw", "4bit"): "AdamW4bit", ("adam", "8bit"): "Adam8bit",
            ("adam", "4bit"): "Adam4bit"}


def available(device: torch.device) -> tuple[bool, str]:
    """torchao is installed (its optimizers run on CPU and CUDA)."""
    if not module_available("torchao.optim"):
        return False, f"needs torchao: {install_hint('deploy')}"
    return True, ""


@register_trick(
    "low_precision_optimizer_state",
    ids=("T29",),
    kind="train",
    trades="Adam/AdamW moments kept block-quantized in 8 or 4 bits (2 or 1 bytes a parameter instead of 8), the "
           "update still in fp32; torchao compiles its step (seconds on first use)",
    needs="torchao; Adam or AdamW",
    config_key="optimizer_state",
    measured_in="benchmarks/memory.py",
    available=available,
)
def low_precision_state(optimizer: torch.optim.Optimizer, bits: str = "8bit") -> torch.optim.Optimizer:
    """torchao's Adam/AdamW on ``bits`` state over ``optimizer``'s parameter groups and settings (a new one).

    ``optimizer`` must be a ``torch.optim.Adam`` or ``AdamW`` that has not stepped yet (its
    state would be lost); its groups keep their lr, betas, eps, weight decay and amsgrad.
    """
    if bits not in STATES:
        raise UserError(f"optimizer_state must be {' or '.join(STATES)} (or empty for the optimizer's own), "
                        f"not {bits!r}")
    kind = _adam_kind(optimizer)
    if any(optimizer.state.values()):
        raise UserError("low_precision_state: the optimizer has stepped already; convert it before the first step")
    ao = require("torchao.optim", "deploy", f"optimizer_state = {bits}")
    cls = getattr(ao, _CLASSES[(kind, bits)])
    groups = [_group(g) for g in optimizer.param_groups]
    return cls(groups, lr=groups[0]["lr"], betas=groups[0]["betas"], eps=groups[0]["eps"],
               weight_decay=groups[0]["weight_decay"], amsgrad=groups[0].get("amsgrad", False))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes the optimizer's state holds: every tensor, a quantized one by its parts (codes, scales, map)."""
    seen: set[int] = set()
    return sum(_tensor_bytes(v, seen) for s in optimizer.state.values() for v in s.values())


# -- internals ------------------------------------------------------------------------------------

def _adam_kind(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    raise UserError(f"optimizer_state needs Adam or AdamW (torchao quantizes their moments), not "
                    f"{type(optimizer).__name__}: set optimizer = adamw, or leave optimizer_state empty")


def _group(g: dict[str, Any]) -> dict[str, Any]:
    """One group for torchao: its parameters and settings, lr as a tensor (torchao's step requires it; an lr
    scheduler fills it in place)."""
    keep = ("lr", "betas", "eps", "weight_decay", "amsgrad")
    out = {"params": list(g["params"]), **{k: g[k] for k in keep if k in g}}
    out["lr"] = torch.tensor(float(g["lr"]))
    return out


def _tensor_bytes(t: Any, seen: set[int]) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), seen) for n in names)
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen:  # a shared part (the quantization map) counted once
        return 0
    seen.add(ptr)
    return t.untyped_storage().nbytes()
