"""T38: Liger's fused kernels for a transformers language model (fused linear cross-entropy, RMSNorm, RoPE,
SwiGLU ...), on CUDA.

Liger's kernels are Triton's, so they run on CUDA only; it patches the model types it knows (Llama, Mistral,
Mixtral, Gemma, Qwen2, Phi3 ...), by model type. Its fused linear cross-entropy never builds the whole logits
tensor, which is where most of the memory it saves comes from (-60% reported on Llama-3-8B, +20% throughput); at
a small batch it can be slower (Liger #323), so it is measured, not assumed.

Liger does the patching (``_apply_liger_kernel_to_instance``, its own instance API); this module says where it
can run and refuses in one line where it cannot. Note that Liger also patches the model type's transformers
module for the whole process (functions such as ``apply_rotary_pos_emb``), not only the instance.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn as nn

from torch_tricks._optional import available, install_hint, require
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["liger_available", "liger_support", "apply_liger"]


def liger_available(device: torch.device | str) -> tuple[bool, str]:
    """(can Liger's kernels run on ``device``, why not): CUDA and liger-kernel installed."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False, f"Liger's kernels are Triton kernels for CUDA GPUs; this is {dev.type}"
    if not available("liger_kernel.transformers"):
        return False, f"Liger's kernels need liger-kernel: {install_hint('liger')}"
    return True, ""


def liger_support(model: nn.Module, device: torch.device | str) -> tuple[bool, str]:
    """(can Liger patch ``model`` on ``device``, why not): the device, then a transformers model of a type Liger
    patches."""
    ok, why = liger_available(device)
    if not ok:
        return ok, why
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type or not type(model).__module__.startswith("transformers."):
        return False, "Liger patches transformers language models by their model type; this is not one"
    known = _patched_types()
    if model_type not in known:
        return False, f"Liger has no kernels for model type {model_type!r} (it patches {', '.join(sorted(known))})"
    return True, ""


@register_trick(
    "liger",
    ids=("T38",),
    kind="train",
    trades="fused LM kernels (linear cross-entropy without the whole logits, RMSNorm, RoPE, SwiGLU): less memory "
           "and often faster at large batch, sometimes slower at a small one",
    needs="a CUDA GPU, liger-kernel, and a transformers LM of a type Liger patches (Llama, Mistral, Qwen2 ...)",
    config_key="liger",
    available=liger_available,
    measured_in="benchmarks/train_tricks.py",
)
def apply_liger(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """``model`` patched in place with Liger's kernels for its model type; one line where it cannot be."""
    dev = torch.device(device) if device is not None else next(model.parameters(), torch.empty(0)).device
    ok, why = liger_support(model, dev)
    if not ok:
        raise UserError(f"liger: {why}")
    lt = require("liger_kernel.transformers", "liger", "Liger's kernels")
    lt._apply_liger_kernel_to_instance(model=model)
    return model


def _patched_types() -> frozenset[str]:
    """The model types liger-kernel patches, from its own table."""
    patch: Any = importlib.import_module("liger_kernel.transformers.monkey_patch")
    return frozenset(getattr(patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {}))
