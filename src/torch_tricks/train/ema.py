"""Averaged weights: an exponential moving average (EMA) and stochastic weight averaging (SWA) (catalogue T22).

Both keep a second copy of the model whose weights average the trained model's weights
over time; the average usually sits in a flatter region of the loss and evaluates better
than the last iterate. Both are built on ``torch.optim.swa_utils.AveragedModel``
(foreach updates, grouped by device and dtype); this module adds what it lacks:

* :class:`EMA`: decay warm-up, integer buffers copied instead of averaged, unwrapping of
  DDP / DataParallel / ``torch.compile`` wrappers, and a state dict that resumes exactly.
* :class:`SWA`: equal averaging of snapshots plus ``SWALR``, and :func:`update_bn` that
  accepts any batch layout (``(x, y)`` tuples, dicts) through an ``input_fn``.

BatchNorm: an average of weights does not match the running statistics any one model
collected. :class:`EMA` averages the BN buffers too (``use_buffers=True``), which tracks
well because the EMA changes slowly; :class:`SWA` averages distant snapshots, so its BN
statistics must be recomputed from data at the end (:meth:`SWA.update_bn`).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn
from torch.optim.swa_utils import update_bn as _torch_update_bn

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick
from torch_tricks.train.distributed import unwrap_model
from torch_tricks.train.speed import _is_namedtuple

__all__ = ["EMA", "SWA", "update_bn", "first_element"]


@register_trick(
    "ema",
    ids=("T22",),
    kind="train",
    trades="one more copy of the weights and a foreach lerp per update for a smoother, usually better model to evaluate",
    needs="a model whose float parameters and buffers can be copied (under FSDP: copied before sharding, then sharded alike)",
    config_key="ema",
)
class EMA:
    """Exponential moving average of a model's parameters and buffers.

    ``ema = EMA(model, decay=0.999)``; call ``ema.update(model)`` after each
    ``optimizer.step()``; evaluate ``ema.module`` (kept in ``eval()`` mode, gradients off).
    ``device="cpu"`` keeps the average off the accelerator (slower updates, no device
    memory).

    ``warmup=True`` uses the decay ``min(decay, (1 + n) / (10 + n))`` at the n-th update
    (TensorFlow's ``ExponentialMovingAverage(num_updates=n)``): with decay 0.9999 and no
    warm-up the average is still mostly the random initial weights after thousands of
    steps, which makes the EMA useless in short runs and in early evaluations. This form
    was chosen over ``decay * (1 - exp(-n / tau))`` because it needs no extra time
    constant and never exceeds ``decay``. ``warmup=False`` is the plain EMA, exactly
    ``get_ema_multi_avg_fn(decay)``.

    Float parameters and buffers (BN running mean/var) are averaged; integer buffers (BN's
    ``num_batches_tracked``) are copied, since an average of counters, truncated to an
    integer, would stay stuck at its first value. A parameter frozen (``requires_grad=False``)
    since the EMA was made is skipped: its average is its copy, exactly, and averaging it would
    read and write its bytes every update for nothing (a LoRA model's whole base). It is still
    copied, not shared: a shared tensor would let ``ema.module.to(...)``, a load or
    ``merge_and_unload()`` on the average write into the trained model. Once unfrozen, it is
    averaged from then on.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.999,
        *,
        warmup: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UserError(f"EMA needs an nn.Module, got {type(model).__name__}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise UserError(f"EMA decay must be a number in [0, 1] (e.g. 0.999), got {decay!r}")
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.num_updates = 0
        self._current_decay = self.decay
        inner = unwrap_model(model)
        self._model_type = type(inner)
        self.averaged = AveragedModel(inner, device=device, multi_avg_fn=self._multi_avg, use_buffers=True)
        # per parameter (in parameters() order): frozen at every update so far, so its copy is its average
        self._still_frozen = [not p.requires_grad for p in inner.parameters()]
        _freeze(self.averaged.module)
        self.averaged.module.eval()

    @property
    def module(self) -> nn.Module:
        """The averaged model, for evaluation and saving (a plain module, no wrapper)."""
        return self.averaged.module

    def current_decay(self) -> float:
        """The decay the next :meth:`update` will use (after the first, which copies)."""
        return self._decay_at(self.num_updates)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Fold the current weights of ``model`` (wrapped or not) into the average."""
        inner = unwrap_model(model)
        if not isinstance(inner, self._model_type):
            raise UserError(
                f"EMA.update got a {type(inner).__name__} but averages a {self._model_type.__name__}: pass the trained model"
            )
        self._current_decay = self._decay_at(self.num_updates)
        self._still_frozen = [was and not p.requires_grad for was, p in zip(self._still_frozen, inner.parameters())]
        if self.num_updates and any(self._still_frozen):
            self._update_unfrozen(inner)
        else:
            self.averaged.update_parameters(inner)
        self.num_updates += 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the averaged model."""
        return self.averaged.module(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """Weights, update count and settings: :meth:`load_state_dict` resumes exactly."""
        return {
            "averaged": self.averaged.state_dict(),
            "decay": self.decay,
            "warmup": self.warmup,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; settings saved there win over the constructor's."""
        try:
            averaged = state["averaged"]
            self.decay = float(state["decay"])
            self.warmup = bool(state["warmup"])
            self.num_updates = int(state["num_updates"])
        except (KeyError, TypeError):
            raise UserError("not an EMA state dict: pass what EMA.state_dict() returned") from None
        self.averaged.load_state_dict(averaged)

    # -- internals --

    def _decay_at(self, n: int) -> float:
        if self.warmup:
            return min(self.decay, (1.0 + n) / (10.0 + n))
        return self.decay

    def _update_unfrozen(self, inner: nn.Module) -> None:
        """``AveragedModel.update_parameters`` without the parameters frozen all along (see the class doc)."""
        avg = self.averaged
        skip = self._still_frozen + [False] * sum(1 for _ in inner.buffers())
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        pairs = zip(itertools.chain(avg.module.parameters(), avg.module.buffers()),
                    itertools.chain(inner.parameters(), inner.buffers()), skip)
        for e, c, frozen in pairs:
            if not frozen:
                ema, current = groups.setdefault((e.device, e.dtype), ([], []))
                ema.append(e.detach())
                current.append(c.detach().to(e.device))
        for (device, _), (ema, current) in groups.items():
            self._multi_avg(ema, current, avg.n_averaged.to(device))
        avg.n_averaged += 1

    def _multi_avg(self, ema: list[torch.Tensor], current: list[torch.Tensor], n_averaged: Any) -> None:
        # AveragedModel groups tensors by device and dtype, so each call sees one dtype.
        if torch.is_floating_point(ema[0]) or torch.is_complex(ema[0]):
            get_ema_multi_avg_fn(self._current_decay)(ema, current, n_averaged)
        else:
            for e, c in zip(ema, current):
                e.copy_(c)


@register_trick(
    "swa",
    ids=("T22",),
    kind="train",
    trades="one more copy of the weights and one pass over data for BN at the end, for a flatter, better-generalising average",
    needs="a run with a constant or cyclic lr phase at the end (SWALR provides it)",
    config_key="swa",
)
class SWA:
    """Stochastic weight averaging: the equal average of snapshots taken during the last phase of training.

    ``swa = SWA(model, optimizer, swa_lr=0.05)``; from the SWA start on, after each epoch
    (or every k steps) call ``swa.update(model)`` and ``swa.step_lr()`` (``SWALR``
    anneals each group's lr to ``swa_lr`` over ``anneal_epochs`` calls, then holds it);
    at the end ``swa.update_bn(loader)`` (or :meth:`finalize`) recomputes the BatchNorm
    statistics of the average, and ``swa.module`` is the model to evaluate. Without
    ``swa_lr`` no scheduler is made and the lr stays the caller's business.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        swa_lr: float | None = None,
        anneal_epochs: int = 5,
        anneal_strategy: str = "cos",
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise UserError(f"SWA needs an nn.Module, got {type(model).__name__}")
        if swa_lr is not None and optimizer is None:
            raise UserError("SWA: swa_lr needs the optimizer whose lr SWALR anneals: pass optimizer too")
        inner = unwrap_model(model)
        self._model_type = type(inner)
        self.averaged = AveragedModel(inner, device=device)  # equal average; buffers copied
        _freeze(self.averaged.module)
        self.scheduler: SWALR | None = None
        if optimizer is not None and swa_lr is not None:
            self.scheduler = _swa_scheduler(optimizer, swa_lr, anneal_epochs, anneal_strategy)

    @property
    def module(self) -> nn.Module:
        """The averaged model (a plain module, no wrapper)."""
        return self.averaged.module

    @property
    def num_averaged(self) -> int:
        """How many snapshots the average holds."""
        return int(self.averaged.n_averaged)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Add the current weights of ``model`` (wrapped or not) to the average."""
        inner = unwrap_model(model)
        if not isinstance(inner, self._model_type):
            raise UserError(
                f"SWA.update got a {type(inner).__name__} but averages a {self._model_type.__name__}: pass the trained model"
            )
        self.averaged.update_parameters(inner)

    def step_lr(self) -> None:
        """Advance ``SWALR`` (no-op without a scheduler)."""
        if self.scheduler is not None:
            self.scheduler.step()

    def update_bn(
        self,
        loader: Iterable[Any],
        *,
        input_fn: Callable[[Any], Any] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Recompute the average's BatchNorm statistics from one pass over ``loader`` (see :func:`update_bn`)."""
        update_bn(loader, self.averaged.module, input_fn=input_fn, device=device)

    def finalize(
        self,
        loader: Iterable[Any],
        input_fn: Callable[[Any], Any] | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> nn.Module:
        """End of training: :meth:`update_bn`, then the averaged model (put in ``eval()`` mode) to evaluate or save."""
        self.update_bn(loader, input_fn=input_fn, device=device)
        return self.averaged.module.eval()

    def state_dict(self) -> dict[str, Any]:
        return {
            "averaged": self.averaged.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            averaged, sched = state["averaged"], state["scheduler"]
        except (KeyError, TypeError):
            raise UserError("not an SWA state dict: pass what SWA.state_dict() returned") from None
        self.averaged.load_state_dict(averaged)
        if sched is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(sched)


def _freeze(module: nn.Module) -> None:
    """The average is not trained: no gradients for its parameters."""
    for p in module.parameters():
        p.requires_grad_(False)
        p.grad = None


def _swa_scheduler(optimizer: torch.optim.Optimizer, swa_lr: float, anneal_epochs: Any,
                   anneal_strategy: Any) -> SWALR:
    if anneal_strategy not in ("cos", "linear"):
        raise UserError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
    if isinstance(anneal_epochs, bool) or not isinstance(anneal_epochs, int) or anneal_epochs < 0:
        raise UserError(f"anneal_epochs must be an integer >= 0, got {anneal_epochs!r}")
    return SWALR(optimizer, swa_lr=swa_lr, anneal_epochs=anneal_epochs, anneal_strategy=anneal_strategy)


def first_element(batch: Any) -> Any:
    """The default ``input_fn``: ``x`` of an ``(x, y, ...)`` batch, the batch itself otherwise."""
    if isinstance(batch, (list, tuple)):
        return batch[0]
    return batch


def update_bn(
    loader: Iterable[Any],
    model: nn.Module,
    *,
    input_fn: Callable[[Any], Any] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Reset and recompute every BatchNorm's running statistics in ``model`` from one pass over ``loader``.

    Uses ``torch.optim.swa_utils.update_bn`` (cumulative average over batches, original
    momentum and train/eval mode restored). That function calls ``model(batch[0])``;
    here ``input_fn(batch)`` gives the model input instead (default :func:`first_element`):
    a tensor is passed as ``model(x)``, a tuple as ``model(*x)``, a dict as
    ``model(**x)``. Tensors are moved to ``device`` if given. Returns ``model``.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"update_bn needs an nn.Module, got {type(model).__name__}")
    fn = first_element if input_fn is None else input_fn
    if not callable(fn):
        raise UserError(f"input_fn must map a batch to the model input, got {type(fn).__name__}")
    dev = None if device is None else torch.device(device)
    adapter = _CallWithBatch(model, fn, dev)
    adapter.training = model.training  # torch restores this mode on the model when done
    # torch's update_bn unpacks lists/tuples itself; boxing each batch hands it to us whole.
    _torch_update_bn((_Box(b) for b in loader), adapter)
    return model


class _Box:
    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch


class _CallWithBatch(nn.Module):
    """Adapter so torch's ``update_bn`` sees ``model``'s BN layers and we decide how to call it."""

    def __init__(self, model: nn.Module, input_fn: Callable[[Any], Any], device: torch.device | None) -> None:
        super().__init__()
        self.model = model
        self.input_fn = input_fn
        self.device = device

    def forward(self, box: _Box) -> Any:
        x = self.input_fn(box.batch)
        if self.device is not None:
            x = _to(x, self.device)
        if isinstance(x, dict):
            return self.model(**x)
        if isinstance(x, tuple):
            return self.model(*x)
        return self.model(x)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if _is_namedtuple(x):
        return type(x)(*(_to(v, device) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    return x
