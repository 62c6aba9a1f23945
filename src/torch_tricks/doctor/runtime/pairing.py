"""An activation that does not suit the loss after it (TT207): log_softmax or softmax before
``CrossEntropyLoss``, logits or probabilities into ``NLLLoss``, a sigmoid before
``BCEWithLogitsLoss``, logits into ``BCELoss``. Reading code cannot tell what a tensor holds when it
reaches the loss; a ``TorchFunctionMode`` sees the input of every such loss call, however the loss is
wrapped, and judges it by its values and by the autograd op that made it; the recorded calls name the
module that returned it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.rules.runtime import LOSS_PAIRING
from torch_tricks.doctor.runtime.recorder import _Call, _innermost_last, _Recorder
from torch_tricks.doctor.runtime.util import _display, _finding, _finite


def _pairing_findings(watch: _LossWatch, rec: _Recorder) -> list[Finding]:
    """TT207 for each loss call whose input does not suit the loss, once per loss, kind of input
    and module that made it."""
    findings = []
    seen: set[tuple[str, str, str]] = set()
    for loss_name, x, producer in watch.calls:
        verdict = _pairing_verdict(loss_name, x, producer)
        if verdict is None:
            continue
        kind, severity, advice = verdict
        where = _producer_path(x, rec)
        if (loss_name, kind, where) in seen:
            continue
        seen.add((loss_name, kind, where))
        findings.append(_finding(
            LOSS_PAIRING, where,
            f"{loss_name} gets {kind} from '{where}': {advice}",
            severity=severity, loss=loss_name, input_kind=kind,
        ))
    return findings


class _LossWatch(TorchFunctionMode):
    """Sees the input of every cross-entropy / NLL / BCE call, however the loss is wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.Tensor, str | None]] = []  # loss, input, op that made it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _LOSS_FUNCTIONS.get(func)
        x = _loss_input(args, kwargs) if name is not None else None
        if x is not None:
            d = x.detach()
            self.calls.append((name, d, _producer_op(x)))
            if name == "BCELoss" and _outside_unit(d):
                # BCELoss would raise (a device-side assert on CUDA): stop before it.
                raise _LossAbort(
                    f"BCELoss got values in [{float(d.min()):.3g}, {float(d.max()):.3g}], outside [0, 1]"
                )
        return func(*args, **kwargs)


class _LossAbort(Exception):
    """Raised from inside a loss call whose input would crash it (logits fed to BCELoss)."""


_LOSS_FUNCTIONS = {
    F.cross_entropy: "CrossEntropyLoss",
    F.nll_loss: "NLLLoss",
    F.binary_cross_entropy: "BCELoss",
    F.binary_cross_entropy_with_logits: "BCEWithLogitsLoss",
}


def _loss_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The input (prediction) tensor of a loss function's call."""
    x = args[0] if args else kwargs.get("input")
    return x if isinstance(x, torch.Tensor) else None


def _outside_unit(x: torch.Tensor) -> bool:
    """``x`` is finite, not empty, and has values outside [0, 1] (it cannot be probabilities)."""
    return bool(x.numel()) and _finite(x) and (bool(x.min() < 0) or bool(x.max() > 1))


# -- the verdicts ----------------------------------------------------------------------------

def _pairing_verdict(loss_name: str, x: torch.Tensor, producer: str | None) -> tuple[str, str, str] | None:
    """(what the input is, severity, advice) when it does not suit ``loss_name``; else None.
    ``producer`` is the autograd op that made ``x`` (None when unknown)."""
    if loss_name == "CrossEntropyLoss":
        return _cross_entropy_verdict(x)
    if loss_name == "NLLLoss":
        return _nll_verdict(x, producer)
    if loss_name == "BCEWithLogitsLoss":
        return _bce_with_logits_verdict(x, producer)
    if loss_name == "BCELoss":
        return _bce_verdict(x)
    return None


def _cross_entropy_verdict(x: torch.Tensor) -> tuple[str, str, str] | None:
    """CrossEntropyLoss wants raw logits: log-probabilities are redundant, probabilities squashed."""
    kind = _distribution(x, 1 if x.dim() >= 2 else 0)
    if kind == "log-probabilities":
        return (kind + " (log_softmax output)", "warning",
                "CrossEntropyLoss applies log_softmax itself, so the model's log_softmax is redundant; "
                "return raw logits, or keep log_softmax and use NLLLoss")
    if kind == "probabilities":
        return (kind + " (softmax output)", "error",
                "CrossEntropyLoss applies log_softmax on top, which squashes the loss and its gradients; "
                "return raw logits")
    return None


def _nll_verdict(x: torch.Tensor, producer: str | None) -> tuple[str, str, str] | None:
    """NLLLoss wants log-probabilities: not raw logits, not probabilities."""
    if producer and producer.startswith("LogSoftmax"):
        return None
    kind = _distribution(x, 1 if x.dim() >= 2 else 0)
    if kind == "logits":
        return ("raw logits", "error",
                "NLLLoss expects log-probabilities; add log_softmax, or use CrossEntropyLoss on the logits")
    if kind == "probabilities":
        return ("probabilities (softmax output)", "error",
                "NLLLoss expects log-probabilities; use log_softmax instead of softmax")
    return None


def _bce_with_logits_verdict(x: torch.Tensor, producer: str | None) -> tuple[str, str, str] | None:
    """BCEWithLogitsLoss wants logits: a sigmoid / softmax output (or values all in [0, 1]) is squashed twice."""
    squashed = producer is not None and (producer.startswith(("Sigmoid", "Softmax")))
    if squashed or _all_in_unit(x):
        return ("probabilities" + (f" ({producer.removesuffix('Backward0').lower()} output)" if squashed else ""),
                "error",
                "BCEWithLogitsLoss applies the sigmoid itself, so the output is squashed twice; drop the sigmoid")
    return None


def _all_in_unit(x: torch.Tensor) -> bool:
    """Enough values (32 or more) to judge, all finite and in [0, 1]: they look like probabilities."""
    return x.numel() >= 32 and _finite(x) and bool(x.min() >= 0) and bool(x.max() <= 1)


def _bce_verdict(x: torch.Tensor) -> tuple[str, str, str] | None:
    """BCELoss wants probabilities: values outside [0, 1] are logits."""
    if _outside_unit(x):
        return ("values outside [0, 1] (raw logits)", "error",
                "BCELoss expects probabilities; drop the BCELoss for BCEWithLogitsLoss on the logits "
                "(numerically stable), or apply sigmoid")
    return None


def _distribution(x: torch.Tensor, dim: int) -> str | None:
    """'log-probabilities', 'probabilities' or 'logits' along ``dim``; None if undecidable."""
    if not _judgeable(x, dim):
        return None
    x = x.detach().float()
    tol = 1e-3 if x.dtype in (torch.float32, torch.float64) else 3e-2
    if _log_probabilities(x, dim, tol):
        return "log-probabilities"
    if _probabilities(x, dim, tol):
        return "probabilities"
    return "logits"


def _judgeable(x: torch.Tensor, dim: int) -> bool:
    """A finite floating-point tensor with two or more entries along ``dim``."""
    return x.dim() > 0 and x.shape[dim] >= 2 and x.is_floating_point() and _finite(x)


def _log_probabilities(x: torch.Tensor, dim: int, tol: float) -> bool:
    """No positive value and a logsumexp of 0 along ``dim``, within ``tol``."""
    return float(x.max()) <= tol and bool((torch.logsumexp(x, dim).abs() <= tol).all())


def _probabilities(x: torch.Tensor, dim: int, tol: float) -> bool:
    """Values in [0, 1] that sum to 1 along ``dim``, within ``tol``."""
    return float(x.min()) >= -tol and float(x.max()) <= 1 + tol and bool(((x.sum(dim) - 1).abs() <= tol).all())


# -- what made the input ---------------------------------------------------------------------

_VIEW_OPS = ("View", "UnsafeView", "Reshape", "Squeeze", "Unsqueeze", "Permute", "Transpose", "TBackward",
             "Clone", "Select", "Slice", "Expand", "Alias", "ToCopy", "AsStrided")


def _producer_op(t: torch.Tensor) -> str | None:
    """Name of the autograd node that made ``t``, looking through views and copies."""
    fn = t.grad_fn
    for _ in range(16):
        if fn is None:
            return None
        name = type(fn).__name__
        if not name.startswith(_VIEW_OPS):
            return name
        fn = _first_input_node(fn)
    return None


def _first_input_node(fn: Any) -> Any:
    """The autograd node of the first differentiable input of ``fn``, else None."""
    nxt = [f for f, _ in fn.next_functions if f is not None]
    return nxt[0] if nxt else None


def _producer_path(x: torch.Tensor, rec: _Recorder) -> str:
    """The innermost module whose output ``x`` is (a container returns its last child's
    tensor; an inplace activation returns its producer's, so the later call wins), else
    the loss function, which then made ``x`` itself."""
    try:
        ptr = x.untyped_storage().data_ptr()
    except Exception:
        return "(loss)"
    c = _innermost_last([call for call in rec.calls if _returns_storage(call, ptr)])
    return _display(c.name) if c is not None else "(loss)"


def _returns_storage(call: _Call, ptr: int) -> bool:
    """One of the outputs of ``call`` lives in the storage at ``ptr``."""
    try:
        return any(t.untyped_storage().data_ptr() == ptr for t in call.outputs)
    except Exception:
        return False
