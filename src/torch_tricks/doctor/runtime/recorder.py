"""The instrumented forward of the first step: pre/post hooks on every module record each call (its
input shapes, the calls that made its inputs, whether its inputs, outputs and output gradients are
finite) and the batch each BatchNorm in training normalises over. The findings of the forward and
the backward (:mod:`.nonfinite`, :mod:`.pairing`, :mod:`.layers`) are read from these calls."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from torch_tricks.doctor.runtime.util import _finite, _tensors


class _Recorder:
    """Forward pre/post hooks on every module of the working copy, for the first step."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...]) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.inputs = _tensors(inputs)
        self.calls: list[_Call] = []
        self.stack: list[_Call] = []  # modules running now, innermost last
        self.produced: dict[int, int] = {}  # id(tensor) -> index of the call that returned it
        self.bn_batch: dict[str, int] = {}
        self.first_nonfinite: _Call | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "_Recorder":
        for m in self.model.modules():  # with kwargs: keyword inputs (attention masks ...) count too
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tensors = _tensors((args, kwargs))
        call = self._new_call(module, tensors)
        n = _batchnorm_batch(module, tensors)
        if n is not None:
            self.bn_batch[call.name] = min(self.bn_batch.get(call.name, n), n)
        self.stack.append(call)

    def _new_call(self, module: nn.Module, tensors: list[torch.Tensor]) -> _Call:
        return _Call(
            name=self.names.get(id(module), "?"),
            module=module,
            in_shapes=[tuple(t.shape) for t in tensors],
            producers=[self.produced[id(t)] for t in tensors if id(t) in self.produced],
            in_finite=all(_finite(t) for t in tensors),
            takes_model_input=self._any_model_input(tensors),
        )

    def _any_model_input(self, tensors: list[torch.Tensor]) -> bool:
        """One of ``tensors`` is one of the model's input tensors itself."""
        return any(t is x for t in tensors for x in self.inputs)

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        call = self._finish(module)
        if call is None:
            return
        call.outputs = _tensors(output)
        call.out_finite = all(_finite(t) for t in call.outputs)
        if not call.out_finite and call.in_finite and self.first_nonfinite is None:
            self.first_nonfinite = call
        self._track_outputs(call)

    def _track_outputs(self, call: _Call) -> None:
        """Remember which call made each output, and watch the gradients that reach them."""
        for t in call.outputs:
            self.produced[id(t)] = call.index
            if t.requires_grad and t.grad_fn is not None and t.is_floating_point():
                t.register_hook(functools.partial(_note_grad, call))

    def _finish(self, module: nn.Module) -> _Call | None:
        """The running call of ``module``, taken off the stack and numbered in completion order."""
        while self.stack and self.stack[-1].module is not module:
            self.stack.pop()  # a call that raised and was caught inside forward
        if not self.stack:
            return None
        call = self.stack.pop()
        call.index = len(self.calls)
        self.calls.append(call)
        return call


@dataclass(eq=False)
class _Call:
    """One module call in the instrumented forward."""

    name: str
    module: nn.Module
    in_shapes: list[tuple[int, ...]]
    producers: list[int]  # indices of the calls that returned this call's tensor inputs
    in_finite: bool
    takes_model_input: bool
    index: int = -1  # completion order
    outputs: list[torch.Tensor] = field(default_factory=list)
    out_finite: bool = True
    out_grad_finite: bool | None = None  # None: no gradient reached the outputs


def _batchnorm_batch(module: nn.Module, tensors: list[torch.Tensor]) -> int | None:
    """The per-device batch a BatchNorm in training normalises over (not a SyncBatchNorm's)."""
    if (isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm)
            and module.training and tensors and tensors[0].dim() >= 2):
        return int(tensors[0].shape[0])
    return None


def _note_grad(call: _Call, grad: torch.Tensor) -> None:
    ok = _finite(grad)
    call.out_grad_finite = ok if call.out_grad_finite is None else (call.out_grad_finite and ok)


# -- reading the calls -----------------------------------------------------------------------

def _innermost_last(calls: list[_Call]) -> _Call | None:
    """The last to complete of the ``calls`` of modules that contain none of the others' modules."""
    names = {c.name for c in calls}
    inner = [c for c in calls if not any(_is_ancestor(c.name, o) for o in names)]
    return max(inner, key=lambda c: c.index) if inner else None


def _is_ancestor(name: str, other: str) -> bool:
    """``name`` is a strict ancestor of ``other`` in the module tree ("" is the root)."""
    return name != other and (name == "" or other.startswith(name + "."))
