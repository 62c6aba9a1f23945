"""What a training batch is, decided once for ``fit``, ``TrainStep``, ``Tricks`` and the tuner.

A batch is one of

* ``(inputs, target)``: ``inputs`` a tensor (one positional argument), a tuple/list
  (positional arguments) or a dict (keyword arguments);
* ``{"input": inputs, "target": target}`` (the same pair by name);
* a transformers-style dict of keyword arguments, ``labels`` inside if there is a target:
  ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``.

``labels`` go into the forward when the forward takes a ``labels`` argument *and* the loss
is the model's own (``--loss auto`` / ``none``): the model computes its loss as
transformers intends (shifted for causal LMs, ``-100`` ignored) and ``outputs.get_loss``
uses ``.loss``. With any other loss the labels are only the target, so the forward does
no loss work that is thrown away.

Written by hand because ``torch.utils.data`` leaves the batch's meaning to the loop: this
module is that one meaning, so the step a tune measures is the step a user's loop runs.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from torch_tricks._inputs import split_inputs, token_input_as_keyword
from torch_tricks.errors import UserError
from torch_tricks.outputs import get_loss, primary_output

__all__ = ["Batch", "unpack", "forward", "call", "count", "batch_size", "split", "to_device", "to_channels_last",
           "takes_labels", "labels_go_in", "example_batch"]


@dataclass
class Batch:
    """A batch taken apart: positional and keyword inputs, and the target (None if there is none)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: Any

    @property
    def inputs(self) -> tuple[Any, ...]:
        """Every input, positional then keyword, ``labels`` left out (they are the target)."""
        return (*self.args, *(v for k, v in self.kwargs.items() if k != "labels"))


def unpack(batch: Any) -> Batch:
    """Take ``batch`` apart (see the module doc); a UserError for anything else."""
    if isinstance(batch, Mapping):
        if set(batch) == {"input", "target"}:
            return _pair(batch["input"], batch["target"])
        kwargs = dict(batch)
        return Batch((), kwargs, kwargs.get("labels"))
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return _pair(batch[0], batch[1])
    raise UserError("each batch must be (inputs, target), a dict of keyword inputs (transformers style, "
                    f"'labels' inside for a target) or a dict with 'input' and 'target'; got {_describe(batch)}")


def forward(model: nn.Module, batch: Any, loss_fn: Callable[..., torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """``(output, loss)`` of ``model`` on ``batch``: the forward every loop of torch-tricks runs."""
    return (out := call(model, batch, loss_fn)), loss_fn(out, unpack(batch).target)


def call(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None = None) -> Any:
    """``model``'s output on ``batch``'s inputs; ``labels`` passed in only for the model's own loss (module doc)."""
    b = unpack(batch)
    kwargs = b.kwargs
    if "labels" in kwargs and not _labels_go_in(model, loss_fn):
        kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
    return model(*b.args, **kwargs)


IGNORE_INDEX = -100  # a target the losses skip (torch's and transformers' ignore_index)


def count(batch: Any) -> int:
    """Samples (class targets) or tokens (sequence targets): the target's element count less the ignored ones
    (-100: padding, a packed sequence's first token); the batch size without one. Micro-batches are weighted
    by it, so a padded token batch split under accumulation keeps its per-token mean."""
    y = unpack(batch).target
    if isinstance(y, torch.Tensor):
        if not y.dtype.is_floating_point and y.dim() >= 2:
            return int((y != IGNORE_INDEX).sum())
        return int(y.numel())
    return len(y) if y is not None else batch_size(batch)


def batch_size(batch: Any) -> int:
    """The size of dim 0: the target's, else the first input tensor's."""
    b = unpack(batch)
    for t in (b.target, *b.inputs):
        if _is_batched(t):
            return int(t.shape[0])
    if b.target is not None and not isinstance(b.target, torch.Tensor):
        return len(b.target)
    raise UserError("the batch has no tensor with a batch dimension")


def split(batch: Any, parts: int) -> list[Any]:
    """``batch`` as ``parts`` micro-batches along dim 0 (fewer if it is smaller), each of ``batch``'s own form."""
    if parts == 1:
        return [batch]
    n = batch_size(batch)
    size = math.ceil(n / parts)
    return [map_tensors(batch, lambda t, i=i: t[i: i + size] if t.dim() > 0 else t) for i in range(0, n, size)]


def to_device(batch: Any, device: torch.device, *, channels_last: bool = False) -> Any:
    """``batch`` (of any form above) on ``device``; 4-d floating inputs in channels_last if asked (T4)."""
    nb = device.type == "cuda"
    moved = map_tensors(batch, lambda t: t.to(device, non_blocking=nb))
    if channels_last:
        moved = to_channels_last(moved)
    return moved


def to_channels_last(batch: Any) -> Any:
    """``batch`` with every 4-D floating-point tensor in channels_last (nested tuples,
    lists and dicts are walked); other tensors and values are returned as they are.
    Here, not in :mod:`torch_tricks.train.speed` (which re-exports it): moving a batch needs it."""
    return map_tensors(batch, _tensor_channels_last)


def labels_go_in(model: nn.Module, batch: Any, loss_fn: Callable[..., Any] | None) -> bool:
    """Whether :func:`call` passes ``batch``'s ``labels`` into ``model``'s forward (for its own loss)."""
    return "labels" in unpack(batch).kwargs and _labels_go_in(model, loss_fn)


def takes_labels(model: nn.Module) -> bool:
    """Whether ``model``'s forward (under any compile / DDP wrapper) has a ``labels`` argument."""
    m = getattr(model, "_orig_mod", model)
    m = getattr(m, "module", m) if type(m).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel") else m
    try:
        return "labels" in inspect.signature(m.forward).parameters
    except (TypeError, ValueError):
        return False


def example_batch(model: nn.Module, inputs: Any, *, seed: int = 0, loss: str | None = "auto"
                  ) -> tuple[Any, Callable[..., torch.Tensor]]:
    """``(batch, loss_fn)`` for a model given only its inputs (what the CLI has).

    ``inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs, batch
    first. One forward on the first sample (eval mode, no grad, on a copy) shows the
    output, of any structure (its prediction is :func:`torch_tricks.outputs.primary_output`).
    Targets: token logits ``(B, T, V)`` for integer ids ``(B, T)`` get next-token targets
    (for keyword inputs to a forward that takes ``labels``, the ids themselves as
    ``labels``: transformers shifts them; a causal LM's one positional token input is
    taken as ``input_ids`` for it); ``(B, C)`` random class labels; otherwise a
    random target of the output's shape (0/1 for bce-with-logits). Keyword inputs give a
    dict batch with ``labels``; positional ones ``(inputs, target)``. A forward that
    raises is a UserError naming the module and the shapes it got.
    """
    loss_fn = get_loss(loss)
    kind = (loss or "auto").lower().replace("_", "-")
    if kind == "auto":  # the model's own loss: a causal LM's positional ids are its input_ids
        inputs = token_input_as_keyword(model, inputs)
    named = isinstance(inputs, Mapping)
    xs = _input_tensors(inputs)
    out = _probe_forward(model, inputs, named, xs)
    if kind == "none":
        return (_as_given(inputs, named), None), loss_fn
    pred = _prediction(out)
    ids = xs[0]
    labels_in_forward = named and kind == "auto" and takes_labels(model)
    if _is_token_logits(pred, ids) and kind in ("auto", "ce", "nll"):
        if labels_in_forward:
            return {**inputs, "labels": ids.clone()}, loss_fn  # the model shifts them itself
        target = _next_token_targets(ids)
    else:
        target = _random_target(kind, pred, int(ids.shape[0]), seed)
    if labels_in_forward:
        return {**inputs, "labels": target}, loss_fn
    return (_as_given(inputs, named), target), loss_fn


# -- helpers ---------------------------------------------------------------------------------------

def _pair(x: Any, y: Any) -> Batch:
    args, kwargs = split_inputs(x)  # the inputs convention: a dict is keyword arguments
    return Batch(args, kwargs, y)


def _model_loss(loss_fn: Callable[..., Any]) -> bool:
    return loss_fn is get_loss("auto") or loss_fn is get_loss("none")


def _labels_go_in(model: nn.Module, loss_fn: Callable[..., Any] | None) -> bool:
    """The forward gets ``labels``: the loss is the model's own and the forward takes them (module doc)."""
    return loss_fn is not None and _model_loss(loss_fn) and takes_labels(model)


def _tensor_channels_last(t: torch.Tensor) -> torch.Tensor:
    """A 4-D floating-point tensor in channels_last; any other tensor as it is."""
    if t.dim() == 4 and t.is_floating_point():
        return t.contiguous(memory_format=torch.channels_last)
    return t


def _is_batched(x: Any) -> bool:
    """A tensor with a batch dimension."""
    return isinstance(x, torch.Tensor) and x.dim() > 0


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (tuples, lists and dicts keep their form)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return _map_mapping(value, fn)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def _as_given(inputs: Any, named: bool) -> Any:
    """The inputs for a batch: keyword inputs as a plain dict, positional ones as they are."""
    return dict(inputs) if named else inputs


def _prediction(out: Any) -> torch.Tensor:
    pred = primary_output(out)
    if pred.dim() < 1:
        raise UserError("the forward's output is a scalar: a training step needs one prediction per sample, "
                        "or pass your own loss_fn from Python")
    return pred


def _is_token_logits(pred: torch.Tensor, ids: Any) -> bool:
    """``pred`` is ``(B, T, V)`` logits over the integer ids ``(B, T)``."""
    return pred.dim() == 3 and not ids.is_floating_point() and ids.dim() == 2 and ids.shape[1] == pred.shape[1]


def _next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """Each position's target is the next id; the last position's is ignored (-100)."""
    target = torch.full_like(ids, -100)
    target[:, :-1] = ids[:, 1:]
    return target


def _map_mapping(value: Mapping[Any, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A dict stays a dict; another mapping type is rebuilt from its (key, value) pairs."""
    if type(value) is dict:
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return type(value)((k, map_tensors(v, fn)) for k, v in value.items())


def _input_tensors(inputs: Any) -> tuple[Any, ...]:
    """The inputs as a tuple (a dict's values in order); refused unless the first is a batched tensor."""
    named = isinstance(inputs, Mapping)
    xs = tuple(inputs.values()) if named else tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not xs or not _is_batched(xs[0]):
        raise UserError("a training batch needs batched tensor inputs (batch dimension first)")
    return xs


def _probe_forward(model: nn.Module, inputs: Any, named: bool, xs: tuple[Any, ...]) -> Any:
    """The output of one forward on the first sample, on an eval copy without grad; a failing forward
    is rerun under ``summary`` so that the error names the module and the shapes it got."""
    one = map_tensors(dict(inputs) if named else xs, lambda t: t[:1] if t.dim() > 0 else t)
    probe = _probe_copy(model)
    try:
        with torch.no_grad():
            return probe(**one) if named else probe(*one)
    except Exception:
        # here, not at the top: the error path alone needs the summary, and it imports the FLOP counter
        from torch_tricks.inspect.summarize import summary

        summary(probe, one if not named else (), kwargs=one if named else None, depth=0)  # names the module
        raise  # pragma: no cover  (summary ran it without error: re-raise the original)


def _random_target(kind: str, pred: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """A seeded random target for ``n`` samples that loss ``kind`` accepts against ``pred`` (not token logits)."""
    gen = torch.Generator().manual_seed(seed)
    dev = pred.device
    if kind in ("auto", "ce", "nll") and pred.dim() == 2:
        return torch.randint(0, int(pred.shape[1]), (n,), generator=gen).to(dev)
    if kind == "bce-with-logits":
        return torch.randint(0, 2, (n, *pred.shape[1:]), generator=gen).float().to(dev)
    if kind in ("ce", "nll"):
        raise UserError(f"--loss {kind} needs class logits (batch, classes) or token logits (batch, T, vocab); "
                        f"the output is {tuple(pred.shape)}: choose --loss mse or auto")
    return torch.randn((n, *pred.shape[1:]), generator=gen).to(dev)


def _probe_copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).eval()


def _describe(batch: Any) -> str:
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return type(batch).__name__
