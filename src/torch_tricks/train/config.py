"""The switches of :func:`torch_tricks.train.fit`, one dataclass shared by Python, CLI and config files.

Every field is a key of the TOML/YAML config file and a ``--flag`` of ``torch-tricks
train`` (underscores become dashes), so a recommended configuration written by the tuner
runs unchanged everywhere. Unknown keys and wrong types are errors, not silently ignored.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from torch_tricks.errors import UserError, one_line

__all__ = ["TrainConfig", "load_config", "DISTRIBUTED_MODES", "COMPILE_MODES", "why_not_in_backward"]

DISTRIBUTED_MODES = ("auto", "ddp", "zero1", "fsdp", "off")  # TrainConfig.distributed (T18)
TOKEN_BATCHES = ("padded", "grouped", "packed", "max")  # TrainConfig.token_batches (T39-T41; max: the baseline)
# torch.compile's modes (T35; train.compile_modes says where each runs); here torch-free, for validate()
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# attention (T34): a transformers implementation, or one SDPA kernel (train.attention, train.sdpa_backend)
ATTENTION_VALUES = ("", "eager", "sdpa", "flex", "flash2", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")


@dataclass
class TrainConfig:
    """Switches for the training loop. Defaults are the plain fp32 loop."""

    # what to run
    epochs: int = 10
    max_steps: int = 0  # optimizer steps; 0 = no limit besides epochs
    batch_size: int = 64  # used where the loop builds the loader (CLI, built-in data)
    token_batches: str = "padded"  # rows of different lengths: padded (T39: to the batch's longest, x8) | grouped (T40) | packed (T41) | max (to the model's positions)
    lr: float = 1e-3
    optimizer: str = "adamw"  # sgd | adam | adamw
    weight_decay: float = 0.0
    momentum: float = 0.9
    schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0  # T21
    scale_lr: bool = False  # T21: lr x batch / base_batch (linear rule)
    base_batch: int = 256
    # precision and speed
    precision: str = "fp32"  # T1: fp32 | bf16 | fp16
    channels_last: bool = False
    attention: str = ""  # T34: "" (the model's own) | eager | sdpa | flex | flash2 (transformers) | sdpa-math | sdpa-flash ...
    compile: bool | str = False  # T24; T35: true (the default mode) | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    cudnn_benchmark: bool = False  # T2 (CUDA, fixed shapes only)
    fused_optimizer: bool = True  # T7: fused or foreach step where available
    no_decay_norm_bias: bool = True  # T14/T15
    keep_heap: bool = True  # CPU, glibc: freed memory stays in the process (no page faults per step)
    fp32_matmul: str = ""  # T33: "" (the process's own) | ieee | tf32 (CUDA 8.0+) | bf16 (CPU with AVX512-BF16/AMX)
    float8: bool = False  # T37: float8 matmuls in the Linear layers (torchao; CUDA capability 8.9+)
    liger: bool = False  # T38: Liger's fused kernels for a transformers LM (CUDA)
    threads: int = 0  # intra-op CPU threads (torch.set_num_threads), at most the cores here; 0 = the process's own
    # memory
    accumulate: int = 1  # T11
    bn_momentum_adjust: bool = False  # T11: BN momentum for k-times smaller batches
    checkpointing: str = ""  # T12: "" off | "blocks" | "sqrt" | a module-name glob
    inplace: bool = False  # T9
    memory_efficient_bn: bool = False  # T10
    chunked_lm_loss: bool = False  # T28: a causal LM's loss from its hidden states chunk by chunk (no whole logits)
    optimizer_state: str = ""  # T29: "" (the optimizer's own) | 8bit | 4bit (torchao) | bf16; adam/adamw
    optimizer_in_backward: bool = False  # T30: each parameter stepped in backward, its gradient freed at once
    offload_activations: bool = False  # T31 (CUDA): saved activations wait in pinned host memory
    auto_micro_batch: bool = False  # halve the micro-batch on out-of-memory, keep the effective batch
    grad_clip: float = 0.0  # max grad norm; 0 = off
    # weight averaging
    ema: bool = False  # T22
    ema_decay: float = 0.999
    swa: bool = False  # T22
    swa_start: float = 0.75  # fraction of the epochs after which SWA averages
    swa_lr: float = 0.0  # 0 = keep the current lr
    # reproducibility and safety
    seed: int = 0
    deterministic: bool = False  # T17
    detect_anomaly: bool = False  # T25 (slow: debugging only)
    nan_guard: bool = True  # T25: stop on a non-finite loss, naming the step
    # checkpoints and logging
    checkpoint_dir: str = ""  # T20/T26: where last.pt goes; "" = no checkpoints
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0 = every epoch
    keep_checkpoints: int = 2  # complete checkpoints kept: last.pt + last.step-N.pt (step-N.dcp/ sharded); 0 = all
    resume: bool = False  # continue from checkpoint_dir/last.pt (or the newest kept one that loads) if present
    log_every: int = 20  # T3: host syncs only every N steps
    log_dir: str = ""  # metrics.csv (and TensorBoard when installed)
    progress: bool = True
    # distributed
    distributed: str = "auto"  # T18: auto (ddp under torchrun) | ddp | zero1 | fsdp | off
    fsdp_reshard: bool = True  # fsdp: free a block's gathered parameters after forward (else keep them for backward)
    sync_bn: bool = False  # T19
    device: str = "auto"  # auto | cpu | cuda | cuda:N

    def __post_init__(self) -> None:
        # Built directly, the keys given are those whose value is not the default; from_dict and replace name
        # them exactly (a file's ``fused_optimizer = true`` is given although it is the default).
        self._given = frozenset(k for k, v in _DEFAULTS.items() if getattr(self, k) != v)

    @property
    def given(self) -> frozenset[str]:
        """The keys this configuration was given (by its file, dict, flags or :meth:`replace`), not defaulted:
        what the trainer integrations route, so a default of torch-tricks never replaces one of the trainer's."""
        return self._given

    def given_dict(self) -> dict[str, Any]:
        """The given keys and their values, in field order."""
        return {k: getattr(self, k) for k in _FIELDS if k in self._given}

    def replace(self, **changes: Any) -> "TrainConfig":
        coerced = _coerce(changes)
        out = dataclasses.replace(self, **coerced)
        out._given = self._given | frozenset(coerced)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        return cls().replace(**dict(data))

    def validate(self) -> "TrainConfig":
        checks = [
            (self.epochs >= 1 or self.max_steps >= 1, "epochs (or max_steps) must be >= 1"),
            (self.accumulate >= 1, "accumulate must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.lr > 0, "lr must be > 0"),
            (self.log_every >= 1, "log_every must be >= 1"),
            (self.threads >= 0, f"threads must be >= 0 (0 keeps the process's own thread count), not {self.threads}"),
            (self.keep_checkpoints >= 0, "keep_checkpoints must be >= 0 (0 keeps every checkpoint)"),
            (self.precision in ("fp32", "bf16", "fp16"), f"precision must be fp32, bf16 or fp16, not {self.precision!r}"),
            (self.attention in ATTENTION_VALUES,
             f"attention must be eager, sdpa, flex, flash2 or one SDPA kernel (sdpa-math, sdpa-flash, sdpa-efficient, "
             f"sdpa-cudnn), or empty (the model's own), not {self.attention!r}"),
            (not (self.attention.startswith("sdpa-") and self.compile),
             f"attention = {self.attention} holds SDPA to one kernel around the eager forward; under compile inductor "
             "lowers attention itself: switch one of them off"),
            (self.compile in (False, True) or self.compile in COMPILE_MODES[1:],
             f"compile must be true, false or a mode ({', '.join(COMPILE_MODES[1:])}), not {self.compile!r}"),
            (self.fp32_matmul in ("", "ieee", "tf32", "bf16"),
             f"fp32_matmul must be ieee, tf32 or bf16 (or empty: the process's own), not {self.fp32_matmul!r}"),
            (self.token_batches in TOKEN_BATCHES,
             f"token_batches must be {', '.join(TOKEN_BATCHES[:-1])} or {TOKEN_BATCHES[-1]}, not {self.token_batches!r}"),
            (self.schedule in ("constant", "cosine", "linear"), f"schedule must be constant, cosine or linear, not {self.schedule!r}"),
            (0.0 < self.ema_decay < 1.0, "ema_decay must be between 0 and 1"),
            (0.0 <= self.swa_start < 1.0, "swa_start is a fraction of the epochs, in [0, 1)"),
            (self.distributed in DISTRIBUTED_MODES,
             f"distributed must be {', '.join(DISTRIBUTED_MODES[:-1])} or off, not {self.distributed!r}"),
            (not self.resume or bool(self.checkpoint_dir), "resume needs checkpoint_dir"),
            (self.optimizer_state in ("", "8bit", "4bit", "bf16"),
             f"optimizer_state must be 8bit, 4bit, bf16 or empty (the optimizer's own), not {self.optimizer_state!r}"),
            (not self.optimizer_state or self.optimizer in ("adam", "adamw"),
             f"optimizer_state = {self.optimizer_state} needs optimizer = adamw or adam (it stores their two "
             f"moments), not {self.optimizer!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(f"bad training config: {message}")
        if self.optimizer_in_backward:
            why = why_not_in_backward(accumulate=self.accumulate, grad_clip=self.grad_clip, precision=self.precision,
                                      distributed=False)
            if not why and self.auto_micro_batch:
                why = ("optimizer_in_backward steps at every backward, so auto_micro_batch cannot split a batch into "
                       "micro-batches: switch one of them off")
            if why:
                raise UserError(f"bad training config: {why}")
        return self


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file of :class:`TrainConfig` keys.

    A ``[train]`` table, if present, is used; otherwise the top level. Keys are checked
    against :class:`TrainConfig` here, so a typo is reported with the file name.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {str(p)!r} not found")
    text = p.read_text()
    parse = _PARSERS.get(p.suffix)
    if parse is None:
        raise UserError(f"config file {str(p)!r}: use a .toml, .yaml or .yml file")
    try:
        data = parse(text)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"config file {str(p)!r} does not parse: {one_line(exc, 10_000)}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {str(p)!r} must hold a table of keys")
    data = data.get("train", data)
    try:
        _coerce(data)
    except UserError as exc:
        raise UserError(f"config file {str(p)!r}: {exc}") from None
    return data


def _parse_toml(text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads(text)


def _parse_yaml(text: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise UserError("YAML configs need PyYAML: pip install pyyaml (or use a .toml file)") from None
    return yaml.safe_load(text) or {}


_PARSERS = {".toml": _parse_toml, ".yaml": _parse_yaml, ".yml": _parse_yaml}

_FIELDS = {f.name: f for f in fields(TrainConfig)}
_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def _coerce(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Check keys and convert values to the field types (ints from TOML floats, etc.)."""
    out = {}
    hints = typing.get_type_hints(TrainConfig)
    for key, value in changes.items():
        key = key.replace("-", "_")
        if key not in _FIELDS:
            raise _unknown_option(key)
        typ = hints[key]
        convert = _KEY_CONVERTERS.get(key) or _CONVERTERS.get(typ)
        if convert is not None:
            try:
                value = convert(value)
            except (TypeError, ValueError):
                raise UserError(f"option {key!r} must be {getattr(typ, '__name__', typ)}, got {value!r}") from None
        out[key] = value
    return out


def _unknown_option(key: str) -> UserError:
    """The error for a key that is no TrainConfig field, suggesting fields that start alike."""
    close = [k for k in _FIELDS if k.startswith(key[:4])]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return UserError(f"unknown training option {key!r}{hint}")


def _to_bool(value: Any) -> bool:
    """A bool, also from the words a config file or command line may use ("yes", "off", "1" ...)."""
    if not isinstance(value, str):
        return bool(value)
    if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise ValueError(value)
    return value.lower() in ("true", "1", "yes", "on")


def _to_int(value: Any) -> int:
    """An int, also from a whole float (TOML and YAML may give 1e3 for 1000), never by rounding."""
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return int(value)


def _to_str(value: Any) -> str:
    """A str; None and false are "", true is "blocks" (``checkpointing = true``)."""
    if value is None or value is False:
        return ""
    return "blocks" if value is True else str(value)


def _to_compile(value: Any) -> bool | str:
    """``compile``: a bool (also from the words :func:`_to_bool` takes; "default" is true), else a mode's name,
    checked by :meth:`TrainConfig.validate`."""
    if value == "default":
        return True
    if value is None or value == "":
        return False
    if isinstance(value, str) and value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return value
    return _to_bool(value)


_CONVERTERS: dict[Any, Any] = {bool: _to_bool, int: _to_int, float: float, str: _to_str}
_KEY_CONVERTERS: dict[str, Any] = {"compile": _to_compile}


def why_not_in_backward(*, accumulate: int, grad_clip: float, precision: str, distributed: bool) -> str:
    """Why the optimizer step cannot move into backward (T30) under these settings ('' if it can); here, torch-free,
    for :meth:`TrainConfig.validate`."""
    if accumulate > 1:
        return (f"optimizer_in_backward steps at every backward, so it cannot accumulate {accumulate} micro-batches: "
                "set accumulate = 1 (or switch optimizer_in_backward off)")
    if grad_clip:
        return ("optimizer_in_backward steps each parameter before the others' gradients exist, so global-norm "
                "clipping (grad_clip) cannot be applied: set grad_clip = 0 (or switch optimizer_in_backward off)")
    if precision == "fp16":
        return ("optimizer_in_backward cannot run under fp16: its grad scaler must see every gradient before a step; "
                "use bf16 (no scaler), or switch optimizer_in_backward off")
    if distributed:
        return ("optimizer_in_backward steps on the local gradient, before DDP/ZeRO/FSDP reduce it across ranks: "
                "switch it off under torchrun")
    return ""
