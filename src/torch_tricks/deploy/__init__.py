"""Deploy: fuse, re-parameterize, quantize, prune, distill, export (I1-I7).

Every step takes a model and returns a new one (the input is left unchanged) with a
report of its agreement, size and latency; importing this package registers the steps.
"""

from __future__ import annotations

from torch_tricks.deploy import distill, export, fuse, lowbit, prune, quantize, reparam  # noqa: F401
from torch_tricks.deploy.fuse import fuse as fuse_conv_bn
from torch_tricks.deploy.pipeline import list_steps, load_optimized, optimize
from torch_tricks.deploy.reparam import reparameterize_model
from torch_tricks.deploy.step_report import report

__all__ = ["fuse_conv_bn", "list_steps", "load_optimized", "optimize", "reparameterize_model", "report"]
