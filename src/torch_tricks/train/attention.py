"""The attention implementation of a transformers model (T34): eager, SDPA, FlexAttention or FlashAttention-2.

transformers runs one model's attention through any of them (``attn_implementation``); which is fastest
depends on the model, the sequence length, the device and the batch, so the tune measures them. What this
module adds to ``PreTrainedModel.set_attn_implementation`` is the short names of a ``[train]`` key, and when
each one cannot train here, said in one line before anything is built: the model's class does not support it
(its ``_supports_*`` flags), FlexAttention has no backward on a CPU (torch 2.13: "does not support backward on
CPU"), FlashAttention-2 needs CUDA and the ``flash_attn`` package. A model that is not a transformers model has
no implementation to switch, but where it calls SDPA (``nn.MultiheadAttention``, its own blocks) the SDPA kernel
can be held to one (``sdpa-math``, ``sdpa-flash`` ...: :mod:`~torch_tricks.train.sdpa_backend`); otherwise it is
refused, rather than the key being ignored.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import register_trick
from torch_tricks.train.sdpa_backend import (SDPA_BACKENDS, attention_dropout, calls_sdpa, hold_sdpa_backend,
                                             sdpa_backend_support)

__all__ = ["ATTENTION_MODES", "attention_support", "set_attention", "current_attention", "attention_modes"]

# the [train] key's values -> transformers' attn_implementation
ATTENTION_MODES = {"eager": "eager", "sdpa": "sdpa", "flex": "flex_attention", "flash2": "flash_attention_2"}
_FLAGS = {"sdpa": "_supports_sdpa", "flex": "_supports_flex_attn", "flash2": "_supports_flash_attn"}


def attention_support(model: nn.Module, mode: str, device: torch.device | str) -> tuple[bool, str]:
    """(can ``model`` train with ``mode`` on ``device``, the reason in one line where it cannot)."""
    if mode in SDPA_BACKENDS:
        return _sdpa_kernel_support(model, mode, device)
    if mode not in ATTENTION_MODES:
        return False, f"unknown attention {mode!r}: choose one of {', '.join([*ATTENTION_MODES, *SDPA_BACKENDS])}"
    hf = _hf_model(model)
    if hf is None:
        return False, (f"{type(model).__name__} is not a transformers model: its attention has no implementation "
                       "to switch (attn_implementation); where it calls SDPA, hold its kernel (sdpa-math, sdpa-flash "
                       "...), else remove it")
    if mode != "eager" and not getattr(type(hf), _FLAGS[mode], False):
        return False, f"{type(hf).__name__} does not support attn_implementation={ATTENTION_MODES[mode]!r} here"
    dev = torch.device(device)
    if mode == "flex" and dev.type == "cpu":
        return False, f"FlexAttention has no backward on a CPU in torch {torch.__version__}: train with sdpa or eager"
    if mode == "flash2" and (dev.type != "cuda" or importlib.util.find_spec("flash_attn") is None):
        return False, "FlashAttention-2 needs a CUDA GPU and the flash_attn package (pip install flash-attn)"
    return True, ""


def set_attention(model: nn.Module, mode: str, device: torch.device | str) -> nn.Module:
    """Switch ``model``'s attention to ``mode`` (checked first; a :class:`UserError` in one line otherwise)."""
    ok, why = attention_support(model, mode, device)
    if not ok:
        raise UserError(f"attention = {mode}: {why}")
    hf = _hf_model(model)
    if mode in SDPA_BACKENDS:  # transformers' sdpa implementation (where it is one), held to the one kernel
        if hf is not None and current_attention(model) != "sdpa":
            hf.set_attn_implementation("sdpa")
        return hold_sdpa_backend(model, mode)
    try:
        hf.set_attn_implementation(ATTENTION_MODES[mode])
    except (ValueError, ImportError) as exc:  # transformers' own refusal, in one line
        raise UserError(f"attention = {mode}: {one_line(exc)}") from None
    return model


def current_attention(model: nn.Module) -> str | None:
    """The short name of ``model``'s attention implementation now (None: not a transformers model)."""
    hf = _hf_model(model)
    if hf is None:
        return None
    impl = getattr(hf.config, "_attn_implementation", None) or "eager"
    return next((k for k, v in ATTENTION_MODES.items() if v == impl), impl)


def attention_modes(model: nn.Module, device: torch.device | str) -> tuple[list[str], list[tuple[str, str]]]:
    """(the implementations ``model`` can train with here besides its own, [(mode, why not)] for the others): a
    transformers model's implementations; for a model that calls SDPA itself, SDPA's kernels."""
    own = current_attention(model)
    ok, refused = [], []
    for mode in ATTENTION_MODES if own is not None else SDPA_BACKENDS:
        if mode == own:
            continue
        can, why = attention_support(model, mode, device)
        (ok.append(mode) if can else refused.append((mode, why)))
    return ok, refused


@register_trick(
    "attention",
    ids=("T34",),
    kind="train",
    trades="a faster attention kernel (SDPA's fused kernels, FlexAttention, FlashAttention-2) for small "
           "numerical differences; which is fastest depends on the model, the sequence and the device",
    needs="a transformers model whose class supports the implementation; flex: CUDA for training; flash2: CUDA "
          "and flash_attn; sdpa-*: a model whose attention is SDPA's, and the kernel on the device",
    config_key="attention",
    measured_in="benchmarks/train_tricks.py",
)
def attention(model: nn.Module, mode: str = "sdpa", device: torch.device | str = "cpu") -> nn.Module:
    """``model`` with its attention implementation switched to ``mode``."""
    return set_attention(model, mode, device)


def _sdpa_kernel_support(model: nn.Module, mode: str, device: torch.device | str) -> tuple[bool, str]:
    """One SDPA kernel: it runs on the device, and the model's attention is SDPA's (transformers' sdpa
    implementation, an nn.MultiheadAttention, or a forward that calls it)."""
    ok, why = sdpa_backend_support(mode, device, attention_dropout(model))
    if not ok:
        return ok, why
    hf = _hf_model(model)
    if hf is not None:
        if not getattr(type(hf), _FLAGS["sdpa"], False):
            return False, f"{type(hf).__name__} does not support attn_implementation='sdpa' here"
        return True, ""
    if not calls_sdpa(model):
        return False, (f"{type(model).__name__} has no nn.MultiheadAttention and no forward that calls "
                       "scaled_dot_product_attention: an SDPA kernel would change nothing; remove it")
    return True, ""


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The transformers model ``model`` is, or holds (a wrapper's first PreTrainedModel), or None. The method is
    looked up on the class: a peft ``PeftModel`` forwards unknown attributes to the model it wraps, but its class
    has no ``_supports_*`` flags to read."""
    for m in model.modules():
        if hasattr(type(m), "set_attn_implementation") and hasattr(m, "config"):
            return m
    return None
