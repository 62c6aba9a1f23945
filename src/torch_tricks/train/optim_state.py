"""T29: the optimizer's state in 8 or 4 bits (torchao) or in bf16, a quarter, an eighth or half of AdamW's 8 bytes a
parameter.

AdamW keeps two fp32 moments per parameter: for a model of N parameters, 8N bytes that live
through the whole run, as much as the weights and gradients together. torchao's
``AdamW8bit`` / ``AdamW4bit`` (and ``Adam8bit`` / ``Adam4bit``) keep them block-quantized
(blocks of 256 / 128 values, each with its own scale; tensors under 4,096 values stay fp32,
as in bitsandbytes) and compute each update in fp32. :func:`low_precision_state` rebuilds an
Adam or AdamW with the same parameter groups and hyper-parameters on that state;
``Tricks`` does it under ``optimizer_state = "8bit" | "4bit" | "bf16"``. :func:`state_bytes`
measures what the state really holds (a quantized state's codes and scales).

``"bf16"`` keeps both moments in bfloat16 for fp32 weights, rounded stochastically
(:class:`Bf16StateAdam`): no torchao and no compilation, 4 bytes a parameter.

torchao compiles its per-parameter step (``torch.compile``, once per parameter shape): on a
CPU the first step costs seconds to tens of seconds of compilation with a cold inductor
cache, then each step is about as fast as the loop's. Under
``torch.compiler.set_stance("force_eager")`` it runs uncompiled.

Written here rather than used directly: the 8 and 4-bit optimizers are torchao's; this module only
carries an optimizer's groups and settings over, and counts the quantized state's bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tricks._optional import available as module_available
from torch_tricks._optional import install_hint, require
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = ["STATES", "Bf16StateAdam", "already_on", "low_precision_state", "state_bytes", "available"]

STATES = ("8bit", "4bit", "bf16")
_CLASSES = {("adamw", "8bit"): "AdamW8bit", ("adamw", "4bit"): "AdamW4bit", ("adam", "8bit"): "Adam8bit",
            ("adam", "4bit"): "Adam4bit"}


def available(device: torch.device) -> tuple[bool, str]:
    """bf16 state runs everywhere; 8 and 4 bits need torchao (its optimizers run on CPU and CUDA)."""
    if not module_available("torchao.optim"):
        return True, f"bf16 state only: 8 and 4 bits need torchao ({install_hint('deploy')})"
    return True, ""


@register_trick(
    "low_precision_optimizer_state",
    ids=("T29",),
    kind="train",
    trades="Adam/AdamW moments kept block-quantized in 8 or 4 bits (2 or 1 bytes a parameter instead of 8; torchao "
           "compiles its step, seconds on first use) or in bf16 rounded stochastically (4 bytes); the update in fp32",
    needs="Adam or AdamW; torchao for 8 and 4 bits",
    config_key="optimizer_state",
    measured_in="benchmarks/memory.py",
    available=available,
)
def low_precision_state(optimizer: torch.optim.Optimizer, bits: str = "8bit") -> torch.optim.Optimizer:
    """torchao's Adam/AdamW on ``bits`` state (``"bf16"``: :class:`Bf16StateAdam`) over ``optimizer``'s parameter
    groups and settings (a new one; one already on that state is returned as it is).

    ``optimizer`` must be a ``torch.optim.Adam`` or ``AdamW`` (decoupled weight decay: AdamW's
    step) that has not stepped yet: its fp32 moments have no place in the new state, so a
    resumed run converts first and loads its saved state after. Its groups keep their lr, betas,
    eps, weight decay, amsgrad and any other key (a scheduler's ``initial_lr``, a group's name);
    a setting the new state cannot honour (``maximize``, ``capturable``, ``differentiable``;
    amsgrad on bf16 state) is refused, not dropped.
    """
    if bits not in STATES:
        raise UserError(f"optimizer_state must be {' or '.join(STATES)} (or empty for the optimizer's own), "
                        f"not {bits!r}")
    if already_on(optimizer, bits):
        return optimizer
    kind = _adam_kind(optimizer)
    _check_carries_over(optimizer, bits)
    if bits == "bf16":
        return Bf16StateAdam([_group(g, lr_tensor=False) for g in optimizer.param_groups], decoupled=kind == "adamw")
    ao = require("torchao.optim", "deploy", f"optimizer_state = {bits}")
    cls = getattr(ao, _CLASSES[(kind, bits)])
    groups = [_group(g) for g in optimizer.param_groups]
    return cls(groups, lr=groups[0]["lr"], betas=groups[0]["betas"], eps=groups[0]["eps"],
               weight_decay=groups[0]["weight_decay"], amsgrad=groups[0].get("amsgrad", False))


def already_on(optimizer: torch.optim.Optimizer, bits: str) -> bool:
    """Whether ``optimizer`` keeps its state in ``bits`` already (built so by you): :func:`low_precision_state`
    keeps it as it is."""
    if bits == "bf16":
        return isinstance(optimizer, Bf16StateAdam)
    cls = type(optimizer)
    return cls.__module__.startswith("torchao.") and cls.__name__ in {v for (_, b), v in _CLASSES.items() if b == bits}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes the optimizer's state holds: every tensor, a quantized one by its parts (codes, scales, map)."""
    seen: set[int] = set()
    return sum(_tensor_bytes(v, seen) for s in optimizer.state.values() for v in s.values())


class Bf16StateAdam(torch.optim.Optimizer):
    """Adam (``decoupled=False``) or AdamW whose two moments are stored in bfloat16: 4 bytes a parameter, not 8.

    Each step reads a moment into fp32, updates it and the parameter in fp32, and stores it back
    rounded *stochastically* to bf16 (up or down with the probability of the distance), so that the
    stored moment equals the fp32 one in expectation. Round-to-nearest would stall: with beta2 = 0.999
    the second moment moves 0.1% a step, under bf16's 0.4% resolution. Large tensors are updated in
    slices (``2**18`` values on a CPU, ``2**22`` on a GPU, where each slice costs kernel launches), so
    the fp32 copies of a step stay a few MiB, not a copy of the largest weight. The rounding draws
    from its own generator (``seed``), not the global one, whose state the state dict holds (a resumed run
    rounds as the uninterrupted one). A loaded state keeps its moments in bf16 (``Optimizer.load_state_dict``
    casts them to the parameter's dtype; they are cast back, exactly).

    Written here rather than taken from torchao: torchao's AdamW keeps its state in the parameter's
    dtype (bf16 state only for bf16 weights, its stochastic rounding a private function), and
    ``torch.optim.AdamW`` updates its state in the state's dtype.
    """

    SLICE = 1 << 18
    SLICE_GPU = 1 << 22

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, decoupled: bool = True, seed: int = 0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": False, "decoupled": decoupled})
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state, and the rounding generators' states: a resumed run draws what this one would."""
        return {**super().state_dict(), "rounding_rng": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.restore_state_dtypes()
        here = {str(p.device) for g in self.param_groups for p in g["params"]}
        for device, rng in (state_dict.get("rounding_rng") or {}).items():
            if device in here:  # a state saved on another device than these parameters' starts from the seed
                self._generator(torch.device(device)).set_state(rng.cpu())

    def restore_state_dtypes(self) -> None:
        """The moments back in bf16 after a load (``Optimizer.load_state_dict`` casts them to the parameter's
        dtype); also what a step in backward calls after loading its per-parameter optimizers' shared state."""
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        if p.grad.is_sparse:
            raise UserError("optimizer_state = bf16 does not take sparse gradients: use the optimizer's own state")
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
        state["step"] += 1
        t = float(state["step"])
        lr, (beta1, beta2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
        hyper = (lr, beta1, beta2, wd, group["eps"], 1 - beta1 ** t, 1 - beta2 ** t, group["decoupled"])
        parts = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
        if all(x.is_contiguous() for x in parts):
            parts = tuple(x.view(-1) for x in parts)
            n = self.SLICE if p.device.type == "cpu" else self.SLICE_GPU
            for i in range(0, parts[0].numel(), n):
                self._update_slice(*(x[i:i + n] for x in parts), hyper)
        else:
            self._update_slice(*parts, hyper)

    def _update_slice(self, p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                      hyper: tuple[float, ...]) -> None:
        lr, beta1, beta2, wd, eps, bias1, bias2, decoupled = hyper
        g = grad.float()
        if wd and decoupled:
            p.mul_(1 - lr * wd)
        elif wd:
            g = g.add(p.float(), alpha=wd)
        m32 = m.float().lerp_(g, 1 - beta1)
        v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        self._store(m, m32)
        self._store(v, v32)
        p.addcdiv_(m32, v32.div_(bias2).sqrt_().add_(eps), value=-lr / bias1)

    def _store(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``src`` (fp32) into ``dst`` (bf16), rounded up or down at random with the probability of its distance:
        16 random low bits added to the fp32 pattern, then cut to bf16's 16 high bits (exact in bf16)."""
        bits = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device,
                             generator=self._generator(src.device))
        dst.copy_(bits.add_(src.view(torch.int32)).bitwise_and_(-65536).view(torch.float32))

    def _generator(self, device: torch.device) -> torch.Generator:
        """The rounding's generator on ``device``, seeded with ``seed`` on first use."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return gen


# -- internals ------------------------------------------------------------------------------------

def _adam_kind(optimizer: torch.optim.Optimizer) -> str:
    """"adamw" or "adam": the weight decay's kind, AdamW's decoupled or Adam's L2 (Adam's own
    ``decoupled_weight_decay=True`` is AdamW's step)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise UserError(f"optimizer_state needs Adam or AdamW (it stores their two moments), not "
                        f"{type(optimizer).__name__}: use torch.optim.AdamW (in the config: optimizer = adamw), or "
                        f"leave optimizer_state empty")
    default = isinstance(optimizer, torch.optim.AdamW)
    decoupled = {bool(g.get("decoupled_weight_decay", default)) for g in optimizer.param_groups}
    if len(decoupled) > 1:
        raise UserError("optimizer_state: the optimizer's groups mix decoupled (AdamW) and L2 (Adam) weight decay, "
                        "which one low-precision optimizer cannot: give every group the same decoupled_weight_decay")
    return "adamw" if decoupled.pop() else "adam"


# Settings of torch's Adam/AdamW the low-precision optimizers have no such switch for: True is refused, not dropped.
_NOT_CARRIED = {"maximize": "it would minimise", "capturable": "CUDA graphs", "differentiable": "autograd through "
                "the step"}
# torch's implementation switches (the new optimizer has its own step), left out of the new groups.
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay")


def _check_carries_over(optimizer: torch.optim.Optimizer, bits: str) -> None:
    """Refuse what the new optimizer could not keep: a state (it has stepped), or a setting it has no switch for."""
    name = type(optimizer).__name__
    if any(optimizer.state.values()):
        raise UserError(f"optimizer_state = {bits} builds a new optimizer on low-precision state, and the state your "
                        f"{name} holds (it has stepped, or loaded a state dict) cannot carry over: convert it before "
                        "its first step (tricks.prepare() first), then resume from a state saved after converting")
    for key, what in _NOT_CARRIED.items():
        if any(g.get(key) for g in optimizer.param_groups):
            raise UserError(f"optimizer_state = {bits} has no {key} ({what}): build your {name} with {key}=False, or "
                            "leave optimizer_state empty")
    if bits == "bf16" and any(g.get("amsgrad") for g in optimizer.param_groups):
        raise UserError("optimizer_state = bf16 has no amsgrad: build the optimizer with amsgrad=False, or use "
                        "8bit / 4bit state")


def _group(g: dict[str, Any], lr_tensor: bool = True) -> dict[str, Any]:
    """One group: its parameters, settings and other keys (an lr scheduler's 'initial_lr', a name), without torch's
    implementation switches; for torchao lr as a tensor (its step requires it; an lr scheduler fills it in place)."""
    out = {k: v for k, v in g.items() if k not in _IMPLEMENTATION}
    out["params"] = list(g["params"])
    out["lr"] = torch.tensor(float(g["lr"])) if lr_tensor else float(g["lr"])
    return out


def _tensor_bytes(t: Any, seen: set[int]) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), seen) for n in names)
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen:  # a shared part (the quantization map) counted once
        return 0
    seen.add(ptr)
    return t.untyped_storage().nbytes()
