"""T28: the LM head's loss, chunk by chunk, so the logits (batch x sequence x vocabulary) never exist whole.

In a causal LM's training step the logits are the largest tensor: 4 x 512 tokens onto GPT-2's
50,257 words are 412 MB in fp32, and cross-entropy adds its own copies (the float upcast,
the log-softmax, their gradients). :func:`chunked_lm_loss` computes the same loss from the
hidden states a few hundred tokens at a time, and each chunk's gradients with it while its
logits are at hand (as Liger Kernel's fused linear cross-entropy does), so at most one
chunk's logits live at once and backward recomputes nothing.

:func:`chunk_lm_loss` switches it on for a transformers causal LM (``Tricks`` and ``fit`` do,
under ``chunked_lm_loss = true``): the user's unchanged ``model(input_ids=..., labels=...).loss``
is computed this way in training mode, and the output's ``logits`` is then ``None`` (as
Liger Kernel does); without labels, or in eval mode, the model returns its full logits as
before. It works through two forward hooks on the model (picklable, copied with it): while
a forward with labels runs, the vocabulary head passes the hidden states through and the
model's ``loss_function`` (transformers' own hook for its loss) is this one, with the head's
weight and bias. Switching it on checks, on a few random tokens, that the model's loss and
every gradient come out the same both ways (a model that changes its logits between head
and loss, e.g. soft-capping, is refused).

Written here rather than taken from a library: Liger Kernel's fused kernel is Triton
(CUDA) and patches each model family's forward; torchtune's chunked loss serves its own
models. This is plain torch, on every device, for any model that computes its loss through
transformers' ``loss_function``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import register_trick

__all__ = ["chunked_lm_loss", "chunk_lm_loss", "lm_head_of", "why_not_chunkable", "is_chunked", "CHUNK_BYTES"]

CHUNK_BYTES = 32 * 2**20  # fp32 logits of one chunk: 167 tokens of GPT-2's vocabulary
IGNORE_INDEX = -100
_CHECK_TOLERANCE = 1e-4  # the switch-on check: relative difference of the loss and of every gradient


def chunked_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    shift: bool = True,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``F.linear(hidden, weight, bias)`` against ``labels``, without the whole logits.

    The same loss as transformers' ``ForCausalLMLoss``: labels shifted left by one (``shift``;
    or ``shift_labels`` given already shifted), ``ignore_index`` (-100) ignored, the logits
    upcast to fp32 (under autocast the matmul runs in its precision, as the head's would),
    the mean over the tokens not ignored, or the sum over ``num_items_in_batch``.
    ``hidden`` is ``(..., H)``, ``weight`` ``(V, H)``. ``chunk_tokens`` (default: as many
    as fit :data:`CHUNK_BYTES` of fp32 logits) tokens per chunk.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = _targets(labels, shift, shift_labels, ignore_index).reshape(-1).to(h.device)
    if y.numel() != h.shape[0]:
        raise UserError(f"chunked_lm_loss: {h.shape[0]} hidden states but {y.numel()} labels: give labels of the "
                        "hidden states' batch and sequence shape")
    n = int(chunk_tokens or max(1, CHUNK_BYTES // (4 * weight.shape[0])))
    if num_items_in_batch is None:
        denom = (y != ignore_index).sum().float()  # 0 with no label left: NaN, as cross_entropy's mean
    else:
        denom = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=h.device)
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
    return _LinearCrossEntropy.apply(h, weight, bias, y, denom, ignore_index, n, dtype)


def lm_head_of(model: nn.Module) -> nn.Linear | None:
    """The model's vocabulary head: transformers' ``get_output_embeddings()``, else a Linear named ``lm_head``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Linear):
        return head
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) else None


@register_trick(
    "chunked_lm_loss",
    ids=("T28",),
    kind="train",
    trades="a causal LM's loss and the head's gradients computed chunk by chunk from the hidden states: the "
           "logits never exist whole, for a gradient of the head's size held from forward to backward",
    needs="a transformers causal LM (a Linear head onto the vocabulary, its loss through loss_function) trained "
          "with labels",
    config_key="chunked_lm_loss",
    measured_in="benchmarks/memory.py",
)
def chunk_lm_loss(model: nn.Module, *, chunk_tokens: int | None = None, check: bool = True) -> nn.Module:
    """Compute ``model``'s loss with :func:`chunked_lm_loss` whenever it trains with labels (in place; returns it).

    ``check``: first make sure, on a few random tokens in eval mode, that the loss and every
    gradient agree with the model's own (within 1e-4 relative); a :class:`UserError` otherwise,
    as for a model without a vocabulary head or whose loss does not go through transformers'
    ``loss_function``. Calling it again on the same model changes nothing. A peft model (LoRA) is
    served through the transformers model it wraps, whose forward computes the loss.
    """
    if is_chunked(model):
        return model
    why = why_not_chunkable(model)
    if why:
        raise UserError(f"chunked_lm_loss: {why}; switch chunked_lm_loss off")
    lm = _loss_model(model)
    if check:
        _check_agreement(lm, chunk_tokens)
    lm._tt_chunk_tokens = chunk_tokens  # read by the hooks: a copy of the model carries it
    lm.register_forward_pre_hook(_enter, with_kwargs=True)
    lm.register_forward_hook(_leave, with_kwargs=True, always_call=True)
    return model


def why_not_chunkable(model: nn.Module) -> str:
    """Why :func:`chunk_lm_loss` cannot serve ``model`` ('' if it can, as far as its code shows)."""
    model = _loss_model(model)
    name = type(model).__name__
    if lm_head_of(model) is None:
        return (f"{name} has no vocabulary head (no get_output_embeddings() Linear, no Linear named lm_head): it is "
                "for causal language models")
    if not _loss_through_loss_function(model):
        return (f"{name}.forward does not compute its loss through transformers' loss_function, so it cannot be "
                "given the chunked one")
    return ""


def is_chunked(model: nn.Module) -> bool:
    """Whether :func:`chunk_lm_loss` is switched on for ``model``."""
    return hasattr(_loss_model(model), "_tt_chunk_tokens")


def _loss_model(model: nn.Module) -> nn.Module:
    """The module whose forward computes the loss: ``model``, or the transformers model a peft ``PeftModel`` wraps
    (its forward hands ``labels`` on to that one, which applies its ``loss_function``)."""
    if callable(getattr(type(model), "get_base_model", None)):
        base = model.get_base_model()
        if isinstance(base, nn.Module):
            return base
    return model


# -- the hooks ------------------------------------------------------------------------------------

_NO_LOSS_FUNCTION = object()  # the model had no loss_function of its own set before the forward


def _enter(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Before a forward: with labels in training mode, the head passes the hidden states through and the
    model's loss_function is the chunked one (undone by :func:`_leave`)."""
    if not (model.training and kwargs.get("labels") is not None):
        return
    _swap_in(model, model._tt_chunk_tokens)


def _leave(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """After a forward (an exception too): the head and loss_function back; the output without its logits
    (they were the hidden states)."""
    if not _swap_out(model):
        return None
    if dataclasses.is_dataclass(output) and getattr(output, "logits", None) is not None:
        return dataclasses.replace(output, logits=None)
    return None


def _swap_in(model: nn.Module, chunk_tokens: int | None) -> None:
    head = lm_head_of(model)
    model._tt_swapped = (head, model.__dict__.get("_loss_function", _NO_LOSS_FUNCTION))
    head.forward = _pass_through
    model._loss_function = functools.partial(_hf_loss, head=head, chunk_tokens=chunk_tokens)


def _swap_out(model: nn.Module) -> bool:
    """Undo :func:`_swap_in`; False if nothing was swapped."""
    swapped = model.__dict__.pop("_tt_swapped", None)
    if swapped is None:
        return False
    head, previous = swapped
    head.__dict__.pop("forward", None)
    if previous is _NO_LOSS_FUNCTION:
        model.__dict__.pop("_loss_function", None)
    else:
        model._loss_function = previous
    return True


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _hf_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
             num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
             shift_labels: torch.Tensor | None = None, *, head: nn.Linear, chunk_tokens: int | None,
             **kwargs: Any) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` signature; ``logits`` are the hidden states the head passed through."""
    return chunked_lm_loss(logits, head.weight, labels, bias=head.bias, shift_labels=shift_labels,
                           ignore_index=ignore_index, num_items_in_batch=num_items_in_batch,
                           chunk_tokens=chunk_tokens)


# -- internals ------------------------------------------------------------------------------------

def _targets(labels: torch.Tensor | None, shift: bool, shift_labels: torch.Tensor | None,
             ignore_index: int) -> torch.Tensor:
    """The label of each hidden state: ``shift_labels`` as given, else ``labels`` shifted left by one
    (the last position ignored), else ``labels`` as they are."""
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise UserError("chunked_lm_loss needs labels (or shift_labels)")
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift else labels


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``linear(h, weight, bias)`` over ``denom``, one chunk of ``n`` rows at a time.

    Each chunk's gradients (softmax minus one-hot, through the matmuls) are computed in the
    forward, while its logits are at hand, so backward has nothing to recompute: it scales
    the saved gradients of ``h`` (the size of ``h``), ``weight`` and ``bias`` (the size of
    the head). The matmuls run in ``dtype`` (autocast's, as the head's would) and the
    softmax in fp32, as transformers upcasts the logits.
    """

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                denom: torch.Tensor, ignore_index: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(h.device.type, enabled=False):
            hd, w = h.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            gh = torch.empty_like(hd) if need_h else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
            for i in range(0, hd.shape[0], n):
                grad = _chunk(hd[i:i + n], w, b, y[i:i + n], denom, ignore_index, total, need_h or need_w or need_b)
                if grad is None:
                    continue
                if gh is not None:
                    gh[i:i + n] = grad.to(dtype) @ w
                if gw is not None:
                    gw += (grad.to(dtype).t() @ hd[i:i + n]).float()
                if gb is not None:
                    gb += grad.sum(0)
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (h.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total / denom

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        gh, gw, gb = ctx.saved_tensors
        dh, dw, db = ctx.dtypes
        scale = g.float()
        return (None if gh is None else (gh.float() * scale).to(dh),
                None if gw is None else (gw * scale).to(dw),
                None if gb is None else (gb * scale).to(db),
                None, None, None, None, None)


def _chunk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, denom: torch.Tensor,
           ignore_index: int, total: torch.Tensor, grad: bool) -> torch.Tensor | None:
    """Add one chunk's summed cross-entropy to ``total`` (in place); the gradient of ``total / denom`` with
    respect to the chunk's logits (fp32) when ``grad``."""
    logits = F.linear(h, w, b).float()
    valid = y != ignore_index
    target = y.masked_fill(~valid, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    total += ((lse - picked) * valid).sum()
    if not grad:
        return None
    probs = logits.sub_(lse[:, None]).exp_()  # the softmax, in the logits' memory
    probs[torch.arange(len(target), device=probs.device), target] -= 1.0
    return probs.mul_((valid.float() / denom)[:, None])


def _loss_through_loss_function(model: nn.Module) -> bool:
    """Whether the model's forward computes its loss through ``self.loss_function`` (transformers >= 4.46)."""
    try:
        src = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in src and hasattr(type(model), "loss_function")


def _check_agreement(model: nn.Module, chunk_tokens: int | None) -> None:
    """The loss and every gradient, on 2 x 8 random tokens in eval mode, with and without the chunked loss."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or lm_head_of(model).out_features
    device = next(model.parameters()).device
    ids = torch.randint(0, int(vocab), (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX
    was_training = model.training
    model.eval()
    try:
        plain = _loss_and_grads(model, ids, labels, chunk_tokens, chunked=False)
        chunked = _loss_and_grads(model, ids, labels, chunk_tokens, chunked=True)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"chunked_lm_loss: could not check {type(model).__name__} on random tokens "
                        f"(model(input_ids=..., labels=...) raised {one_line(exc, with_type=True)}); switch "
                        "chunked_lm_loss off") from None
    finally:
        model.train(was_training)
    worst = max(_rel(a, b) for a, b in zip(chunked, plain))
    if not worst <= _CHECK_TOLERANCE:
        raise UserError(f"chunked_lm_loss: {type(model).__name__}'s loss or gradients differ by {worst:.1e} relative "
                        "with the chunked loss (it changes its logits between head and loss, e.g. soft-capping): "
                        "switch chunked_lm_loss off")


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None,
                    *, chunked: bool) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    if chunked:
        _swap_in(model, chunk_tokens)
    try:
        loss = model(input_ids=ids, labels=labels).loss
    finally:
        if chunked:
            _swap_out(model)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [loss.detach()] + [g.detach() if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    num = float((a.double() - b.double()).norm())
    return num / den if den > 0 else num
