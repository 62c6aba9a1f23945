"""Rules about arguments given in the wrong place: BatchNorm's second positional argument is ``eps``, which scripts
copy as if it were the momentum (``nn.BatchNorm2d(C, 0.8)``: 22 scripts of one GAN collection carry it).
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import FileAnalysis, number
from torch_tricks.doctor.registry import StaticRule, static_rule

_BATCHNORMS = frozenset(f"torch.nn.{n}" for n in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                                                  "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"))
_EPS_AT_MOST = 0.01  # an eps this large is no longer a guard against dividing by zero: it is a misplaced value


@static_rule
class BatchNormPositionalEps(StaticRule):
    id = "TT133"
    name = "batchnorm-positional-eps"
    severity = "error"
    source = "X (layer arguments); T10"
    message = ("BatchNorm's second positional argument is eps, not momentum: nn.BatchNorm2d(C, 0.8) divides by "
               "sqrt(var + 0.8)")
    explanation = ("nn.BatchNorm1d/2d/3d(num_features, eps=1e-5, momentum=0.1, ...): a second positional value is "
                   "eps, the small number added to the variance before the square root. A momentum-like 0.8 there "
                   "flattens every normalisation (a channel whose variance is 0.01 is divided by 0.9 instead of "
                   "0.1) and leaves momentum at its default. Fix: name it, nn.BatchNorm2d(C, momentum=0.8) (and "
                   "note that PyTorch's momentum is 1 - Keras's: Keras 0.8 is PyTorch 0.2), or drop it. Quiet for an "
                   "eps of 0.01 or less, or one passed by name.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            if f.qualname(call.func) in _BATCHNORMS and len(call.args) >= 2:
                eps = number(call.args[1])
                if eps is not None and eps > _EPS_AT_MOST:
                    yield call, (f"{ast.unparse(call.func)}(..., {ast.unparse(call.args[1])}): the second positional "
                                 f"argument is eps, not momentum, so the variance gets {eps:g} added before the "
                                 f"square root: pass momentum= by name (PyTorch's momentum is 1 - Keras's)")
