"""T34 for models that call PyTorch's SDPA themselves: which of its kernels runs their attention.

``F.scaled_dot_product_attention`` (what ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``, nanoGPT-style
blocks and transformers' ``sdpa`` implementation call) picks a kernel per call: flash, memory-efficient, cuDNN or
the math one. Its choice is not always the fastest for a given shape and device, so ``attention = "sdpa-math" |
"sdpa-flash" | "sdpa-efficient" | "sdpa-cudnn"`` holds it to one, measured like any trick.

PyTorch's ``torch.nn.attention.sdpa_kernel`` is the switch; it is a context, so it is entered around the model's
forward by hooks on every module (a block recomputed by activation checkpointing, in backward, runs inside it too)
and left even when a forward raises. What this module adds: whether the kernel runs on the device (a tiny forward
and backward under it, once per device), whether the model calls SDPA at all (its modules' forward code, or an
``nn.MultiheadAttention``; otherwise the setting would change nothing, and is refused), and the hooks.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch
import torch.nn as nn

from torch_tricks.errors import one_line

__all__ = ["SDPA_BACKENDS", "sdpa_backend_support", "attention_dropout", "calls_sdpa", "hold_sdpa_backend"]

SDPA_BACKENDS = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                 "sdpa-cudnn": "CUDNN_ATTENTION"}


def sdpa_backend_support(mode: str, device: torch.device | str, dropout: float = 0.0) -> tuple[bool, str]:
    """(does SDPA's ``mode`` kernel run a forward and backward on ``device`` with attention ``dropout``, why not):
    on a CPU the flash kernel has no dropout, so a model's own attention dropout decides too."""
    if mode not in SDPA_BACKENDS:
        return False, f"unknown SDPA kernel {mode!r}: choose one of {', '.join(SDPA_BACKENDS)}"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA device here"
    return _runs(mode, str(dev), float(dropout))


def attention_dropout(model: nn.Module) -> float:
    """The largest dropout of ``model``'s ``nn.MultiheadAttention`` layers (0 where it has none)."""
    return max((float(m.dropout) for m in model.modules() if isinstance(m, nn.MultiheadAttention)), default=0.0)


def calls_sdpa(model: nn.Module) -> bool:
    """Whether ``model`` holds an ``nn.MultiheadAttention`` or a module whose forward code calls
    ``scaled_dot_product_attention`` (transformers' sdpa implementation is checked by the caller)."""
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention) or _forward_calls_sdpa(type(m)):
            return True
    return False


def hold_sdpa_backend(model: nn.Module, mode: str) -> nn.Module:
    """Run every SDPA call of ``model``'s forward with the ``mode`` kernel only (hooks on each module; applied
    again, the earlier hooks are replaced)."""
    from torch.nn.attention import SDPBackend

    for handle in getattr(model, "_tt_sdpa_hooks", ()):
        handle.remove()
    state = _Held(getattr(SDPBackend, SDPA_BACKENDS[mode]))
    hooks = []
    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(state.enter))
        hooks.append(m.register_forward_hook(state.leave, always_call=True))
    model._tt_sdpa_hooks = hooks
    return model


class _Held:
    """The ``sdpa_kernel`` context entered by the outermost module's forward and left when it returns."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.depth, self.ctx = backend, 0, None

    def enter(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0:
            from torch.nn.attention import sdpa_kernel

            self.ctx = sdpa_kernel([self.backend])
            self.ctx.__enter__()
        self.depth += 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and self.ctx is not None:
            ctx, self.ctx = self.ctx, None
            ctx.__exit__(None, None, None)


@functools.lru_cache(maxsize=None)
def _runs(mode: str, device: str, dropout: float) -> tuple[bool, str]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device(device)
    # the check draws random numbers (its inputs, its dropout): the caller's random stream is left as it was
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        return _try_kernel(mode, dev, dropout, SDPBackend, sdpa_kernel)


def _try_kernel(mode: str, device: torch.device, dropout: float, SDPBackend: Any, sdpa_kernel: Any) -> tuple[bool, str]:
    q, k, v = (torch.randn(1, 2, 16, 16, device=device, requires_grad=True) for _ in range(3))
    try:
        with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[mode])]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # why a kernel was not used: the error says it in one line
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
            y.sum().backward()
    except RuntimeError as exc:
        first = one_line(exc, 200).split(". ")[0].rstrip(".")
        with_dropout = f" with attention dropout {dropout:g}" if dropout else ""
        return False, (f"SDPA's {SDPA_BACKENDS[mode].lower()} kernel does not run on {device}{with_dropout} here "
                       f"({first})")
    return True, ""


@functools.lru_cache(maxsize=None)
def _forward_calls_sdpa(cls: type) -> bool:
    try:
        return "scaled_dot_product_attention" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
