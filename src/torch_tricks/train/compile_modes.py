"""T35: ``torch.compile``'s modes, and where each can run.

``compile = true`` is inductor's default mode. The others trade a longer first call for a faster step, and
not on every model (users report max-autotune slower than eager: pytorch #161764), so each is a setting to
measure, not to assume:

* ``max-autotune-no-cudagraphs``: inductor benchmarks matmul and convolution templates (Triton on CUDA, its
  C++ GEMM templates on a CPU) and keeps the fastest, for a first call several times longer;
* ``reduce-overhead``: CUDA graphs replay the whole step with one launch, the cure for launch-bound small
  models on a GPU (a GPT-2-small step on an H100 idled most of its time); it exists only on CUDA, and on a
  CPU would silently be the default mode, so it is refused there in one line;
* ``max-autotune``: both of the above (on a CPU, the same as ``max-autotune-no-cudagraphs``).

The modes are torch.compile's own; this module only says which one runs where, and hands the mode to
:func:`~torch_tricks.train.speed.compile_model`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick
from torch_tricks.train.config import COMPILE_MODES
from torch_tricks.train.speed import compile_available, compile_model

__all__ = ["COMPILE_MODES", "compile_mode", "compile_kwargs", "compile_mode_support", "check_compile_mode",
           "compile_modes", "compile_with_mode"]

_CUDA_GRAPHS_ONLY = {
    "reduce-overhead": "reduce-overhead is CUDA graphs, which run only on CUDA (on a CPU it would be the default "
                       "mode): use compile = true or max-autotune-no-cudagraphs",
}
_SAME_ON_CPU = {"max-autotune": "max-autotune-no-cudagraphs"}  # CUDA graphs aside, the same mode on a CPU


def compile_mode(value: Any) -> str:
    """The mode a ``compile`` setting means: "" (off) for false, "default" for true, else the mode named."""
    if value is True:
        return "default"
    return value if isinstance(value, str) else ""


def compile_kwargs(value: Any) -> dict[str, Any]:
    """``torch.compile``'s keywords for a ``compile`` setting (none for the default mode)."""
    mode = compile_mode(value)
    return {"mode": mode} if mode and mode != "default" else {}


def compile_mode_support(value: Any, device: torch.device | str) -> tuple[bool, str]:
    """(can this ``compile`` setting run on ``device``, why not): inductor must run there, and CUDA graphs need
    CUDA."""
    mode = compile_mode(value)
    if not mode:
        return True, ""
    if mode not in COMPILE_MODES:
        return False, f"compile mode must be one of {', '.join(COMPILE_MODES)} (or true / false), not {mode!r}"
    dev = torch.device(device)
    ok, why = compile_available(dev)
    if not ok:
        return False, f"torch.compile cannot run here: {why}"
    if dev.type != "cuda" and mode in _CUDA_GRAPHS_ONLY:
        return False, _CUDA_GRAPHS_ONLY[mode]
    return True, ""


def check_compile_mode(value: Any, device: torch.device | str) -> None:
    """A :class:`UserError` in one line where :func:`compile_mode_support` says no."""
    ok, why = compile_mode_support(value, device)
    if not ok:
        raise UserError(f"compile = {compile_mode(value)!r} on {torch.device(device)}: {why}")


def compile_modes(device: torch.device | str) -> tuple[list[str], list[tuple[str, str]]]:
    """(the modes other than the default that run on ``device`` and differ there, [(mode, why not)] for the rest):
    what the tune measures beside compile's default mode."""
    dev = torch.device(device)
    ok: list[str] = []
    refused: list[tuple[str, str]] = []
    for mode in COMPILE_MODES[1:]:
        runs, why = compile_mode_support(mode, dev)
        if runs and dev.type != "cuda" and mode in _SAME_ON_CPU:
            runs, why = False, f"on a {dev.type.upper()} the same as {_SAME_ON_CPU[mode]} (CUDA graphs are CUDA only)"
        (ok.append(mode) if runs else refused.append((mode, why)))
    return ok, refused


@register_trick(
    "compile_mode",
    ids=("T35",),
    kind="train",
    trades="a faster step than compile's default mode (tuned kernels, CUDA graphs) for a longer first call; "
           "slower on some models, so measured",
    needs="torch.compile's inductor; reduce-overhead (CUDA graphs): CUDA",
    config_key="compile",
    available=lambda device: compile_mode_support("max-autotune-no-cudagraphs", device),
    measured_in="benchmarks/train_tricks.py",
)
def compile_with_mode(model: nn.Module, mode: str = "max-autotune-no-cudagraphs") -> nn.Module:
    """``model`` compiled in place in ``mode`` (checked for its device first: one line where it cannot run)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    check_compile_mode(mode, device)
    return compile_model(model, **compile_kwargs(mode))
