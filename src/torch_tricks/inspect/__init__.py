"""What a model costs: summary, FLOPs, memory, timing, profile, graph, design advice.

Everything here returns data; the CLI (``torch-tricks summary|memory|time|profile|graph``)
prints it. Submodules are imported on first use so ``import torch_tricks.inspect`` stays
cheap and optional dependencies (onnx, tensorboard) are only needed by what uses them.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "summary": "summarize", "Summary": "summarize", "Row": "summarize", "ForwardError": "summarize",
    "OpCounter": "flops", "rnn_macs": "flops",
    "memory_report": "memory", "MemoryReport": "memory", "leak_check": "memory", "LeakReport": "memory",
    "saved_activation_bytes": "memory", "LiveTensors": "memory",
    "benchmark": "timing", "compare": "timing", "Timing": "timing", "synchronize": "timing",
    "timings_table": "timing",
    "profile_step": "profile", "ProfileReport": "profile",
    "autograd_dot": "graph", "model_graph": "graph", "export_onnx": "graph", "save_graph": "graph",
    "tensorboard_graph": "graph", "render_dot": "graph",
    "advise": "advisor", "Advice": "advisor", "advice_text": "advisor",
    "make_inputs": "inputs", "parse_input_specs": "inputs", "call_model": "inputs", "check_input_names": "inputs",
    "Workloads": "step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'torch_tricks.inspect' has no attribute {name!r}") from None
    return getattr(importlib.import_module(f"torch_tricks.inspect.{module}"), name)
