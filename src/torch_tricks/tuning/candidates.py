"""Which registered tricks the tuner tries on a model, as changes to :class:`TrainConfig`.

Every training trick that ``fit`` can switch on (its ``config_key``) becomes one
candidate: the config change that turns it on, what it is for (``speed`` or
``memory``; ``cost`` for tricks taken for other reasons whose price is still worth
knowing), and whether it applies to *this* model and device, with the reason when it
does not. Tricks that are not a switch of the training step (a data or deploy trick,
distributed-only switches, schedule and checkpoint-file switches) are listed as
skipped with why, so the report accounts for every registered trick.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from torch_tricks._optional import available as module_available
from torch_tricks._optional import install_hint
from torch_tricks.errors import one_line
from torch_tricks.registry import Trick, list_tricks, trick_name
from torch_tricks.seed import CUBLAS_DETERMINISTIC_CONFIGS
from torch_tricks.train.lm_loss import why_not_chunkable
from torch_tricks.train.memory import default_blocks, inplace_activations, memory_efficient_bn_act
from torch_tricks.train.attention import attention_modes, current_attention
from torch_tricks.train.sdpa_backend import calls_sdpa
from torch_tricks.train.compile_modes import compile_modes
from torch_tricks.train.float8 import float8_linears
from torch_tricks.train.liger import liger_support
from torch_tricks.train.matmul_mode import fast_fp32_matmul_mode
from torch_tricks.train.precision import DTYPES, precision_support

__all__ = ["Candidate", "Skipped", "training_candidates"]

# On a CPU, autocast can only win through its matmuls and convolutions (the other operators run as they did, on
# the low-precision outputs): where a probe layer under autocast is this much slower than in fp32, the precision is
# emulated and the step cannot be faster. Measured on a 2-core Xeon without AVX512-BF16: the probe 2.2-2.9x (AVX2
# kernels: 7-15x), and the whole step 0.45x (a 4-layer GPT-2) and ~0.5x (ResNet-18), after a build of 14 s that
# a 120 s tune could not spare; a CPU with native bf16 (AMX, AVX512-BF16) runs the probe faster than fp32.
AUTOCAST_SLOW = 1.5


@dataclass
class Candidate:
    """One configuration to measure: ``changes`` to the plain fp32 config."""

    name: str  # the trick name, or "a+b" for a combination
    changes: dict[str, Any]
    goal: str  # "speed" | "memory" | "cost"
    ids: tuple[str, ...] = ()
    note: str = ""  # a caveat worth printing (emulated bf16 ...)
    tricks: tuple[str, ...] = field(default=())  # the registered tricks it switches on
    probe_ratio: float | None = None  # measured while choosing: a probe op's time / the same in fp32
    probe_what: str = ""
    probe_limit: float | None = None  # from this probe ratio on, not measured further (None: the tune's default)

    def __post_init__(self) -> None:
        if not self.tricks:
            self.tricks = (self.name,)


@dataclass
class Skipped:
    """A registered trick the tuner did not measure, and why."""

    name: str
    ids: tuple[str, ...]
    kind: str
    reason: str
    status: str = "skipped"  # skipped | failed


_NOT_A_STEP_SWITCH = {
    "lr_warmup": "changes the learning-rate schedule, not the step's speed or memory",
    "no_decay_groups": "changes what is learned (no decay on bias/norm), not speed or memory; fit does it by default",
    "safe_checkpoint": "writes checkpoint files; it does not change the step",
    "swa": "averages weights late in training; its per-step cost is that of ema (measured)",
    "ddp": "needs several processes: run the training under torchrun",
    "sync_batchnorm": "needs several processes: run the training under torchrun",
    "zero1": "needs several processes: run the training under torchrun (distributed = zero1)",
    "fsdp": "needs several processes: run the training under torchrun (distributed = fsdp)",
    "keep_heap": "a process-wide allocator setting, on (the default) in this tune's process as in every Tricks or fit "
                 "run, so that a step is timed here as your script will run it; once set it cannot be undone to time "
                 "its absence (benchmarks/tricks_in_your_loop.py --no-keep-heap measures that in a fresh process)",
}


def training_candidates(
    model: nn.Module,
    inputs: tuple[Any, ...],
    device: torch.device,
    *,
    batch: int,
    own_optimizer: bool = False,
    skip: Sequence[str] = (),
    labels_in_forward: bool = True,
    optimizer: str = "adamw",
) -> tuple[list[Candidate], list[Skipped]]:
    """The candidates for ``model`` on ``device``, and every other registered trick as skipped (or failed).

    ``skip``: trick names the caller leaves out (reported as skipped, with that reason).
    ``labels_in_forward``: the batch's labels go into the model's forward for its own loss (what
    ``chunked_lm_loss`` serves; a loss computed outside the model is left as it is).
    ``optimizer``: the optimizer's name (low-precision state is Adam's and AdamW's).
    A trick whose applicability check itself raises is reported with status ``failed``.
    """
    cands: list[Candidate] = []
    skipped: list[Skipped] = []
    skip = set(skip) | {trick_name(n) for n in skip}  # an earlier name (int8_static) skips the trick (int8)
    for trick in list_tricks():
        made, why = _make(trick, skip, model, inputs, device, batch, own_optimizer)
        if isinstance(made, Candidate) and made.changes.get("chunked_lm_loss") and not labels_in_forward:
            made = Skipped(trick.name, trick.ids, trick.kind, _LOSS_OUTSIDE)
        if trick.config_key == "optimizer_state" and not own_optimizer and optimizer.lower() not in ("adam", "adamw"):
            made = Skipped(trick.name, trick.ids, trick.kind, f"stores Adam's or AdamW's moments; the optimizer is "
                                                              f"{optimizer}")
        _file_made(made, trick, why, skip, cands, skipped)
    return cands, skipped


def _make(trick: Trick, skip: set[str], model: nn.Module, inputs: tuple[Any, ...], device: torch.device,
          batch: int, own_optimizer: bool) -> tuple[Any, str]:
    """(what the trick's maker returns, the caveat it is available with); a trick that is left out, not
    available, without a maker, or whose check raises gives a :class:`Skipped` saying so (and no caveat)."""
    reason = _left_out(trick, skip)
    if reason:
        return Skipped(trick.name, trick.ids, trick.kind, reason), ""
    try:
        ok, why = trick.check(device)
    except Exception as exc:
        return _raised(trick, "its availability check raised ", exc), ""
    if not ok:
        return Skipped(trick.name, trick.ids, trick.kind, why), ""
    make = _MAKERS.get(trick.name)
    if make is None:
        return Skipped(trick.name, trick.ids, trick.kind, "the tuner has no measurement for it yet"), ""
    try:
        return make(trick, model, inputs, device, batch, own_optimizer), why
    except Exception as exc:
        return _raised(trick, "checking whether it applies raised ", exc), ""


def _raised(trick: Trick, what: str, exc: Exception) -> Skipped:
    return Skipped(trick.name, trick.ids, trick.kind, what + one_line(exc, 10_000, with_type=True), status="failed")


def _left_out(trick: Trick, skip: set[str]) -> str:
    """Why ``trick`` is not measured as a switch of the training step, before anything is checked ('' if
    it may be): the caller left it out, a data or deploy trick, a change to the model itself, or no switch."""
    if trick.name in skip:
        return "left out by the caller (skip)"
    if trick.name == "compile_mode" and "compile" in skip:
        return "left out with compile by the caller (skip)"
    if trick.kind != "train":
        if trick.name in TOKEN_TRICKS:
            return "a data trick: measured with --data TOKENS (a token set), in real tokens a second"
        where = "--data" if trick.kind == "data" else "--deploy"
        return (f"a {trick.kind} trick: measured with {where}" if trick.name in _MEASURED_ELSEWHERE
                else f"a {trick.kind} trick, not a switch of the training step")
    if trick.config_key is None:
        return "changes the model itself (not a switch of fit); apply it by hand"
    return _NOT_A_STEP_SWITCH.get(trick.name, "")


def _file_made(made: Any, trick: Trick, why: str, skip: set[str], cands: list[Candidate],
               skipped: list[Skipped]) -> None:
    """What a maker returned (a Candidate, a Skipped, a reason, or a list of them) into ``cands`` or
    ``skipped``; a candidate available with a caveat (``why``) carries it as its note."""
    for item in made if isinstance(made, list) else [made]:
        if isinstance(item, (Candidate, Skipped)) and item.name in skip:
            skipped.append(Skipped(item.name, trick.ids, trick.kind, "left out by the caller (skip)"))
            continue
        if isinstance(item, Skipped):
            item.ids, item.kind = trick.ids, trick.kind
            skipped.append(item)
        elif isinstance(item, str):
            skipped.append(Skipped(trick.name, trick.ids, trick.kind, item))
        else:
            cands.append(_with_caveat(item, trick.ids, why))


def _with_caveat(cand: Candidate, ids: tuple[str, ...], why: str) -> Candidate:
    """``cand`` with the trick's ids, and the caveat it is available with (``why``) as its note if it has none."""
    cand.ids = ids
    if why and not cand.note:
        cand.note = why
    return cand


# What ``tune(data=...)`` (the loader-tune: workers, pinning, a pack's batched reads, the
# decoder's rate) and ``tune(deploy=True)`` (the deploy chains) measure.
# T39-T41: measured by the token phase (tuning.token_phase) on the rows given, not as a switch of the step
TOKEN_TRICKS = frozenset({"dynamic_padding", "length_grouped", "packing"})
_MEASURED_ELSEWHERE = {"packed_dataset", "loader_defaults", "fast_decode",
                       "fuse", "reparam", "int8", "int8-dynamic", "bf16", "fp16", "onnx", "onnx-int8"}


# -- one maker per trick: a Candidate, or the reason it does not apply --------------------------

def _precision(trick: Trick, model, inputs, device, batch, own_opt) -> list[Candidate | Skipped]:
    """bf16 and fp16 autocast, each measured where it runs, else skipped with the reason."""
    out: list[Candidate | Skipped] = []
    for p in ("bf16", "fp16"):
        ok, why = precision_support(p, device)
        name = f"{trick.name}:{p}"
        if ok:
            note = "fp16 with a grad scaler" if p == "fp16" else ""
            c = Candidate(name, {"precision": p}, "speed", note=note, tricks=(trick.name,))
            if device.type == "cpu":  # a CPU without native fp16/bf16 emulates it, often ~100x slower
                c.probe_ratio, c.probe_what = _autocast_slowdown(p, model)
                c.probe_limit = AUTOCAST_SLOW
            out.append(c)
        else:
            out.append(Skipped(name, trick.ids, trick.kind, why))
    return out


def _autocast_slowdown(p: str, model: nn.Module) -> tuple[float, str]:
    """Time of one small layer (forward + backward) under ``p`` autocast on the CPU / in fp32.

    A conv if the model has one, else a linear layer. Cheap (milliseconds), and it spares
    building and probing the whole model in an emulated precision, which can take
    minutes on a large input.
    """
    gen = torch.Generator().manual_seed(0)
    if any(isinstance(m, nn.Conv2d) for m in model.modules()):
        layer, x, what = nn.Conv2d(32, 32, 3, padding=1), torch.randn(4, 32, 32, 32, generator=gen), "3x3 convolution"
    else:
        layer, x, what = nn.Linear(512, 512), torch.randn(256, 512, generator=gen), "linear layer"

    def run(enabled: bool) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=DTYPES[p], enabled=enabled):
                y = layer(x)
            y.float().sum().backward()
            best = min(best, time.perf_counter() - t0)
        return best

    run(False), run(True)  # warm-up
    ratio = run(True) / max(run(False), 1e-9)
    return ratio, f"a probe {what} (forward and backward) under {p} autocast"


def _fp32_matmul(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    """The fast fp32 matmul mode this device runs natively (tf32 on CUDA 8.0+, bf16 on a bf16 CPU)."""
    mode, why = fast_fp32_matmul_mode(device)
    return Candidate(f"{trick.name}:{mode}", {"fp32_matmul": mode}, "speed", tricks=(trick.name,)) if mode else why


def _attention(trick: Trick, model, inputs, device, batch, own_opt) -> list[Candidate | Skipped] | str:
    """Each attention implementation a transformers model can train with here besides its own (T34); the
    others skipped with the reason (flex on a CPU has no backward, flash2 needs CUDA and flash_attn ...)."""
    own = current_attention(model)
    if own is None and not calls_sdpa(model):
        return ("not a transformers model, and none of its modules calls SDPA (nn.MultiheadAttention, "
                "scaled_dot_product_attention): its attention has no implementation or kernel to switch")
    ok, refused = attention_modes(model, device)
    instead = f"instead of the model's own {own}" if own else "SDPA held to this kernel, instead of its own choice"
    out: list[Candidate | Skipped] = [Candidate(f"{trick.name}:{m}", {"attention": m}, "speed", tricks=(trick.name,),
                                                note=instead) for m in ok]
    return out + [Skipped(f"{trick.name}:{m}", trick.ids, trick.kind, why) for m, why in refused]


def _channels_last(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return "the model has no 2-d convolution"
    if not (inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].dim() == 4):
        return "the input is not a 4-d image batch"
    return Candidate(trick.name, {"channels_last": True}, "speed")


def _checkpointing(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    if isinstance(model, nn.Sequential) and not default_blocks(model):
        return Candidate(trick.name, {"checkpointing": "sqrt"}, "memory")
    if not default_blocks(model):
        return "no repeated blocks found to checkpoint (name them: --checkpointing 'layer*.*')"
    return Candidate(trick.name, {"checkpointing": "blocks"}, "memory")


def _compile(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    return Candidate(trick.name, {"compile": True}, "speed")


def _compile_mode(trick: Trick, model, inputs, device, batch, own_opt) -> list[Candidate | Skipped] | str:
    """compile's other modes that run here (T35), measured in compile's phase beside its default mode; the
    others skipped with the reason (reduce-overhead is CUDA graphs: CUDA only)."""
    ok, refused = compile_modes(device)
    out: list[Candidate | Skipped] = [Candidate(f"compile:{m}", {"compile": m}, "speed", trick.ids, tricks=(trick.name,))
                                      for m in ok]
    return out + [Skipped(f"compile:{m}", trick.ids, trick.kind, why) for m, why in refused]


def _float8(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    """The Linear layers float8 takes (both dimensions multiples of 16), counted in the row's note (T37)."""
    names, total = float8_linears(model)
    if not names:
        return f"none of the model's {total} Linear layers has both dimensions divisible by 16"
    return Candidate(trick.name, {"float8": True}, "speed", note=f"{len(names)} of {total} Linear layers in float8")


def _liger(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    ok, why = liger_support(model, device)
    return Candidate(trick.name, {"liger": True}, "speed") if ok else why


def _fused(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    if own_opt:
        return "you pass your own optimizer: build it with fused=True / foreach=True yourself"
    return Candidate(trick.name, {"fused_optimizer": True}, "speed")


def _inplace(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    _, n = inplace_activations(copy.deepcopy(model), return_count=True)
    if not n:
        return "no activation that can safely run in place is out of place already"
    return Candidate(trick.name, {"inplace": True}, "memory")


def _mem_bn(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    try:
        _, n = memory_efficient_bn_act(copy.deepcopy(model), return_count=True)
    except Exception as exc:  # a model the pass cannot handle
        return f"cannot apply: {one_line(exc, 10_000)}"
    if not n:
        return ("no BatchNorm -> activation pair it can convert (in an nn.Sequential, or a BatchNorm whose "
                "only user is an inplace ReLU)")
    return Candidate(trick.name, {"memory_efficient_bn": True}, "memory")


_LOSS_OUTSIDE = ("the loss is computed outside the model (positional inputs, or --loss other than auto): it "
                 "chunks the model's own loss of model(input_ids=..., labels=...); what would change it: name the "
                 "input (--input input_ids=long:SEQ:VOCAB) with --loss auto")


def _lm_loss(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    """A causal LM whose loss goes through transformers' loss_function (the batch must carry its labels)."""
    return why_not_chunkable(model) or Candidate(trick.name, {"chunked_lm_loss": True}, "memory")


def _accumulate(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    if batch < 2:
        return "the batch (1) cannot be split into micro-batches"
    return Candidate(trick.name, {"accumulate": 2}, "memory", note="micro-batch of half the batch, same effective batch")


_LOW_BIT_NOT_TUNED = (
    "torchao compiles its step for each parameter shape before the first step (seconds to tens of seconds with a "
    "cold cache){cpu}: benchmarks/memory.py measures it in fresh processes; try it with optimizer_state = {bits}")
_ON_CPU = ", and on a CPU a compiled step does not run inside the tune's live-tensor counter"


def _optimizer_state(trick: Trick, model, inputs, device, batch, own_opt) -> list[Candidate | Skipped] | str:
    """bf16 state, measured; 8 and 4 bits (torchao) named, with why the tune leaves them to benchmarks/memory.py."""
    if own_opt:
        return ("you pass your own optimizer: wrap it yourself, "
                "torch_tricks.train.optim_state.low_precision_state(optimizer, 'bf16' | '8bit' | '4bit')")
    why = (_LOW_BIT_NOT_TUNED.format(bits="{bits}", cpu=_ON_CPU if device.type == "cpu" else "")
           if module_available("torchao.optim") else f"needs torchao: {install_hint('deploy')}")
    return [Candidate(f"{trick.name}:bf16", {"optimizer_state": "bf16"}, "memory", tricks=(trick.name,)),
            *(Skipped(f"{trick.name}:{bits}", trick.ids, trick.kind, why.replace("{bits}", bits))
              for bits in ("8bit", "4bit"))]


def _simple(key: str, goal: str) -> Callable[..., Candidate]:
    def make(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate:
        return Candidate(trick.name, {key: True}, goal)
    return make


_MAKERS: dict[str, Callable[..., Candidate | str]] = {
    "mixed_precision": _precision,
    "channels_last": _channels_last,
    "fp32_matmul": _fp32_matmul,
    "attention": _attention,
    "checkpointing": _checkpointing,
    "compile": _compile,
    "compile_mode": _compile_mode,
    "float8": _float8,
    "liger": _liger,
    "fused_optimizer": _fused,
    "inplace_activations": _inplace,
    "memory_efficient_bn": _mem_bn,
    "gradient_accumulation": _accumulate,
    "chunked_lm_loss": _lm_loss,
    "low_precision_optimizer_state": _optimizer_state,
    "optimizer_in_backward": _simple("optimizer_in_backward", "memory"),
    "offload_activations": _simple("offload_activations", "memory"),
    "cudnn_benchmark": _simple("cudnn_benchmark", "speed"),
    "ema": _simple("ema", "cost"),
    "deterministic": lambda *a: _deterministic(*a),
}


def _deterministic(trick: Trick, model, inputs, device, batch, own_opt) -> Candidate | str:
    if device.type == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC_CONFIGS:
        # cuBLAS reads it when CUDA starts, which it has by now: setting it here would be too late
        return ("deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set before CUDA starts: "
                "export it and tune again to measure it")
    return Candidate(trick.name, {"deterministic": True}, "cost")
