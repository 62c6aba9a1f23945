"""Where each key of ``[train]`` goes in each trainer: the one table (issue 22, item 4).

For every :class:`~torch_tricks.train.TrainConfig` key and every target, a :class:`Place` says in
words where the key goes (the docs' table is made from these words) and routes a value:

* ``arg``: keywords of the target's own object (``TrainingArguments``, ``lightning.Trainer``,
  ``Accelerator``), the value converted (``precision = "bf16"`` -> ``bf16=True``);
* ``callback``: the target has no argument for it; torch-tricks' callback for that target applies it
  from the target's own hooks;
* ``code``: it belongs to a line of the user's own script (a ``Trainer`` keyword outside
  ``TrainingArguments``, ``trainer.train(resume_from_checkpoint=True)``): the report prints the line.

A value that has no place in a target (``optimizer_in_backward`` under the Trainer, which steps its
optimizer after backward) raises one line naming the key, the target and what to do instead: a key
is never dropped in silence. A target without a table yet raises the same way.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from torch_tricks.errors import UserError
from torch_tricks.train.config import TrainConfig
from torch_tricks.train.schedule import scale_lr
from torch_tricks.train.tricks import as_config

__all__ = ["TARGETS", "Route", "Place", "Make", "routes", "keywords", "sourced_keywords", "code_lines", "OPTIMIZER_KEYS",
           "check_keywords", "build", "place_table", "places", "config_of", "changed_keys"]

TARGETS = {"fit": "torch-tricks fit / Tricks", "hf": "transformers Trainer", "lightning": "lightning.Trainer",
           "accelerate": "Accelerate"}


@dataclass(frozen=True)
class Route:
    """Where one value goes: ``arg`` (``kwargs`` of the target's object), ``callback``, or ``code`` (``line``)."""

    how: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    line: str = ""


@dataclass(frozen=True)
class Make:
    """An object a keyword takes (``ModelCheckpoint(dirpath=...)``), named by its import path and built on use, so
    the table imports no trainer; its repr is the source line (what ``tune --emit`` prints)."""

    path: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        module, _, name = self.path.rpartition(".")
        return getattr(importlib.import_module(module), name)(**self.kwargs)

    def __repr__(self) -> str:
        return f"{self.path.rpartition('.')[2]}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


@dataclass(frozen=True)
class Place:
    """Where a key goes in a target, in words (``doc``), and how a value is routed (``route(config)``)."""

    doc: str
    route: Callable[[TrainConfig], Route]


def routes(config: TrainConfig, target: str, *, given: bool = False) -> dict[str, Route]:
    """Every key of ``config`` routed into ``target`` (one line naming key and target where a value has no place);
    with ``given``, only the keys the configuration was given (:attr:`TrainConfig.given`): a default of
    torch-tricks is never routed into a trainer, whose own default it would replace."""
    table = places(target)
    config.validate()
    keys = [k for k in _keys() if k in config.given] if given else _keys()
    out = {key: table[key].route(config) for key in keys}
    for key, needs in _NEEDS.items() if target != "fit" else ():
        if key in config.given and getattr(config, key) and not needs & config.given:
            raise UserError(f"{key} = {getattr(config, key)!r} needs {' or '.join(sorted(needs))} in the same "
                            f"configuration (it is computed from it): add it, or leave {key} out")
    return out


# A given key whose routed value is computed from another key that must be given too (else from a default).
_NEEDS = {"scale_lr": frozenset({"lr"}), "swa": frozenset({"lr", "swa_lr"})}


def keywords(config: TrainConfig, target: str) -> dict[str, Any]:
    """The keywords of ``target``'s own object that carry the given keys of ``config``: their ``arg`` routes in one
    dict, the lists several keys give (Lightning's ``callbacks``) joined; objects still as :class:`Make` (see
    :func:`build`)."""
    return {k: v for k, (v, _) in sourced_keywords(config, target).items()}


def sourced_keywords(config: TrainConfig, target: str) -> dict[str, tuple[Any, str]]:
    """:func:`keywords` with, for each keyword, the configuration key that set it (what a conflict names)."""
    out: dict[str, tuple[Any, str]] = {}
    for key, route in routes(config, target, given=True).items():
        if route.how == "callback":
            continue  # an arg's keywords, or those a code line comes with (group_by_length beside its collator)
        for k, v in route.kwargs.items():
            joined = isinstance(v, list) and k in out
            out[k] = (out[k][0] + v, out[k][1] + ", " + key) if joined else (v, out[k][1] if k in out else key)
    return out


def code_lines(config: TrainConfig, target: str) -> dict[str, str]:
    """The lines of the user's own script that the given keys of ``config`` need, by key."""
    return {k: r.line for k, r in routes(config, target, given=True).items() if r.how == "code"}


def check_keywords(kwargs: dict[str, Any], have: set[str], target: str, package: Any, what: str) -> None:
    """Each keyword is one the installed ``package`` takes (``have``), else one line naming it and the upgrade."""
    for name in kwargs:
        if name not in have:
            raise UserError(f"the installed {package.__name__} {package.__version__} has no {what} {name!r} (needed "
                            f"for the {TARGETS[target]} mapping): upgrade {package.__name__} (pip install -U "
                            f"{package.__name__}), or leave that switch off")


def build(value: Any) -> Any:
    """``value`` with each :class:`Make` in it (alone or in a list) built."""
    if isinstance(value, Make):
        return value.build()
    if isinstance(value, list):
        return [build(v) for v in value]
    return value


def places(target: str) -> dict[str, Place]:
    """The key -> :class:`Place` table of ``target``."""
    if target not in TARGETS:
        raise UserError(f"unknown target {target!r}: use one of {', '.join(TARGETS)}")
    build = _BUILDERS.get(target)
    if build is None:
        raise UserError(f"no mapping into {TARGETS[target]} yet: use torch-tricks train or Tricks in your own loop")
    return build()


def place_table() -> list[dict[str, str]]:
    """One row per ``[train]`` key: where it goes in each target that has a table (for the docs)."""
    tables = {t: places(t) for t in TARGETS if t in _BUILDERS}
    return [{"key": key, **{t: table[key].doc for t, table in tables.items()}} for key in _keys()]


def no_place(key: str, value: Any, target: str, instead: str) -> UserError:
    """The one line for a value that ``target`` has no place for."""
    return UserError(f"{key} = {value!r} has no place in {TARGETS[target]}: {instead}")


# -- building blocks of the tables ---------------------------------------------------------------

def _keys() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def arg(doc: str, convert: Callable[[TrainConfig], dict[str, Any]]) -> Place:
    """A keyword of the target's own object."""
    return Place(doc, lambda c: Route("arg", convert(c)))


def callback(doc: str, check: Callable[[TrainConfig], None] | None = None) -> Place:
    """Applied by torch-tricks' callback; ``check(config)`` raises for a value the callback cannot serve."""
    def route(c: TrainConfig) -> Route:
        if check is not None:
            check(c)
        return Route("callback")
    return Place(f"TricksCallback: {doc}", route)


def refuse_unless(key: str, target: str, ok: Callable[[Any], bool], instead: str, place: Place) -> Place:
    """``place``, except for a value of ``key`` that ``ok`` refuses: one line saying what to do instead."""
    def route(c: TrainConfig) -> Route:
        value = getattr(c, key)
        if not ok(value):
            raise no_place(key, value, target, instead)
        return place.route(c)
    return Place(place.doc, route)


def off(target: str, key: str, instead: str) -> Place:
    """A switch ``target`` cannot serve when on: refused with ``instead``; off, it needs nothing."""
    return refuse_unless(key, target, lambda v: not v, instead, Place("refused when on", lambda c: Route("arg")))


def no_zero1(c: TrainConfig, target: str, how: str) -> None:
    """``distributed = zero1`` where ``target`` shards optimizer state only through DeepSpeed (``how``)."""
    if c.distributed == "zero1":
        raise no_place("distributed", "zero1", target, f"it shards optimizer state only through DeepSpeed ({how}): "
                       "use distributed = fsdp, or ddp")


def config_of(cfg: Any) -> TrainConfig:
    """A validated TrainConfig from a path to tricks.toml, a TrainConfig or a dict of its keys."""
    config = as_config(cfg)
    if config is None:
        raise UserError("give the configuration: a path to tricks.toml, a TrainConfig or a dict of its keys")
    return config.validate()


def changed_keys(config: TrainConfig) -> dict[str, Any]:
    """The keys ``config`` was given (what an emitted script states)."""
    return config.given_dict()


def world_size() -> int:
    """Processes of this run (torchrun's WORLD_SIZE; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def learning_rate(c: TrainConfig) -> float:
    """``lr``, scaled to the global batch when ``scale_lr`` (as ``Tricks`` does)."""
    if not c.scale_lr:
        return c.lr
    return scale_lr(c.lr, c.batch_size * c.accumulate * world_size(), base_batch=c.base_batch)


# -- lightning.Trainer: its keywords (callbacks and logger included), configure_optimizers, TricksCallback ---------

# The keys of the optimizer and its lr schedule: a trainer integration builds them with the user's own settings.
OPTIMIZER_KEYS = frozenset({"lr", "optimizer", "weight_decay", "momentum", "schedule", "warmup_steps", "scale_lr",
                            "base_batch", "fused_optimizer", "no_decay_norm_bias", "optimizer_state"})

# No trainer has an argument for the intra-op thread count: the process's, set where the callback (or Tricks) starts.
_THREADS = "intra-op CPU threads, `torch.set_num_threads` (0: the process's own; at most the cores here)"
# A setting of the process too, for the device it trains on (checked there: tf32 on a CPU is refused in one line).
_FP32_MATMUL = ("fp32 matmul/conv mode, `torch.backends.{cuda.matmul,cudnn.conv,mkldnn.matmul,mkldnn.conv}"
                ".fp32_precision` (tf32: CUDA 8.0+; bf16: a CPU with AVX512-BF16 or AMX)")
# A transformers model's attn_implementation, switched on the model the trainer was given (from_pretrained's keyword
# is the other place: the key then stays unwritten).
_ATTENTION = "the model's `set_attn_implementation` (eager, sdpa, flex_attention, flash_attention_2)"
_FLOAT8 = "torchao's `convert_to_float8_training` of the Linear layers float8 takes (CUDA 8.9+)"
_LIGER = "Liger's `_apply_liger_kernel_to_instance` on the model (CUDA)"

_TOKENS_IMPORT = "# from torch_tricks.data.token_batches import max_positions, packing_keywords, token_loader"


def _token_loader(name: str) -> Place:
    """The DataLoader line (``name = token_loader(...)``) of a script over token rows batched as token_batches says."""
    return Place("your DataLoader over token rows: `token_loader(..., mode=token_batches)` (T39-T41)", lambda c: Route(
        "code", line=f"{name} = token_loader(dataset, batch_size={c.batch_size}, mode={c.token_batches!r}, "
                     f"row_len=max_positions(model), keywords=packing_keywords(model))  {_TOKENS_IMPORT}"))


def _hf_token_batches(c: TrainConfig) -> Route:
    """The Trainer's ``data_collator`` for token_batches (and ``group_by_length`` for grouped)."""
    imp = "# from torch_tricks.data.token_batches import max_positions, pack_collate, packing_keywords, pad_collate"
    collate = {"padded": "pad_collate()", "grouped": "pad_collate()",
               "packed": "pack_collate(max_positions(model), keywords=packing_keywords(model))",
               "max": "pad_collate(pad_to=max_positions(model))"}[c.token_batches]
    kwargs = _hf_group_by_length() if c.token_batches == "grouped" else {}
    return Route("code", kwargs, line=f"Trainer(..., data_collator={collate})  {imp}")


def _hf_group_by_length() -> dict[str, Any]:
    """transformers 5's ``train_sampling_strategy="group_by_length"``; ``group_by_length=True`` before it."""
    try:
        import transformers
    except ImportError:
        return {"train_sampling_strategy": "group_by_length"}
    names = {f.name for f in fields(transformers.TrainingArguments)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": "group_by_length"}
    return {"group_by_length": True}


_PL = "lightning"
_OPTIMIZERS = "`configure_optimizers`: `return optimizers_from(cfg, self)`"


def _pl_strategy(c: TrainConfig) -> dict[str, Any]:
    no_zero1(c, _PL, 'strategy="deepspeed_stage_1"')
    if c.distributed == "fsdp":
        sharding = "FULL_SHARD" if c.fsdp_reshard else "SHARD_GRAD_OP"
        return {"strategy": Make("lightning.pytorch.strategies.FSDPStrategy", {"sharding_strategy": sharding})}
    return {"strategy": {"off": "auto", "auto": "auto", "ddp": "ddp"}[c.distributed],
            **({"devices": 1} if c.distributed == "off" else {})}


def _pl_device(c: TrainConfig) -> dict[str, Any]:
    if c.device.startswith("cuda:"):
        return {"accelerator": "gpu", "devices": [int(c.device.split(":")[1])]}
    return {"accelerator": {"auto": "auto", "cpu": "cpu", "cuda": "gpu"}[c.device]}


def _pl_checkpoints(c: TrainConfig) -> dict[str, Any]:
    if not c.checkpoint_dir:
        return {}
    every = {"every_n_train_steps": c.checkpoint_every} if c.checkpoint_every else {"every_n_epochs": 1}
    return {"default_root_dir": c.checkpoint_dir, "callbacks": [Make(
        "lightning.pytorch.callbacks.ModelCheckpoint",
        {"dirpath": c.checkpoint_dir, **every, "save_last": True,
         # the newest N: Lightning keeps the top k of a monitored value, and "step" rises
         **_pl_keep(c)})]}


def _pl_keep(c: TrainConfig) -> dict[str, Any]:
    """ModelCheckpoint's keep: Lightning's own unless keep_checkpoints is given (the newest N: Lightning keeps the
    top k of a monitored value, and "step" rises)."""
    if "keep_checkpoints" not in c.given:
        return {}
    if not c.keep_checkpoints:
        return {"save_top_k": -1}
    return {"save_top_k": c.keep_checkpoints, "monitor": "step", "mode": "max"}


def _pl_swa(c: TrainConfig) -> dict[str, Any]:
    if not c.swa:
        return {}
    start = {"swa_epoch_start": c.swa_start} if "swa_start" in c.given else {}
    return {"callbacks": [Make("lightning.pytorch.callbacks.StochasticWeightAveraging",
                               {"swa_lrs": c.swa_lr or learning_rate(c), **start})]}


def _pl_code(line: str, when: Callable[[TrainConfig], bool] = lambda c: True) -> Callable[[TrainConfig], Route]:
    return lambda c: Route("code", line=line) if when(c) else Route("arg")


_LIGHTNING: dict[str, Place] = {
    "epochs": arg("`max_epochs`", lambda c: {"max_epochs": c.epochs}),
    "max_steps": arg("`max_steps` (0: -1)", lambda c: {"max_steps": c.max_steps or -1}),
    "batch_size": Place("your DataLoader's `batch_size`",
                        lambda c: Route("code", line=f"DataLoader(dataset, batch_size={c.batch_size}, shuffle=True)")),
    "token_batches": _token_loader("train_loader"),
    "lr": Place(_OPTIMIZERS, _pl_code("def configure_optimizers(self):\n    return optimizers_from(cfg, self)  "
                                      "# from torch_tricks.integrations.lightning import optimizers_from")),
    **{k: Place(_OPTIMIZERS, lambda c: Route("arg")) for k in (
        "optimizer", "weight_decay", "momentum", "schedule", "warmup_steps", "scale_lr", "base_batch",
        "fused_optimizer", "no_decay_norm_bias", "optimizer_state")},
    "precision": arg("`precision` (`bf16-mixed`, `16-mixed`, `32-true`)", lambda c: {"precision": {
        "fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[c.precision]}),
    "channels_last": callback("the model's weights channels_last"),
    "compile": callback("`torch.compile` (in its mode) of each child module of the LightningModule, in place"),
    "cudnn_benchmark": arg("`benchmark`", lambda c: {"benchmark": c.cudnn_benchmark}),
    "keep_heap": callback("glibc keeps freed memory (CPU)"),
    "threads": callback(_THREADS),
    "fp32_matmul": callback(_FP32_MATMUL),
    "attention": callback(_ATTENTION),
    "float8": callback(_FLOAT8),
    "liger": callback(_LIGER),
    "accumulate": arg("`accumulate_grad_batches`", lambda c: {"accumulate_grad_batches": c.accumulate}),
    "bn_momentum_adjust": callback("BatchNorm momentum for the micro-batches"),
    "checkpointing": callback("activation checkpointing of the repeated blocks, `sqrt` or a name pattern"),
    "inplace": callback("in-place activations"),
    "memory_efficient_bn": callback("memory-efficient BatchNorm + activation"),
    "chunked_lm_loss": callback("the causal LM's loss chunk by chunk (the LM inside the LightningModule)"),
    "optimizer_in_backward": off(_PL, "optimizer_in_backward", "Lightning steps its optimizer after backward "
                                     "(automatic optimization): train with torch-tricks train or Tricks"),
    "offload_activations": callback("saved activations in pinned host memory from batch start to backward (CUDA)"),
    "auto_micro_batch": off(_PL, "auto_micro_batch", "Lightning's BatchSizeFinder changes the batch without keeping "
                                "the effective batch: set auto_micro_batch = false and lower batch_size"),
    "grad_clip": arg("`gradient_clip_val` (0: None)", lambda c: {"gradient_clip_val": c.grad_clip or None}),
    "ema": callback("EMA weights after each optimizer step, kept in the checkpoint"),
    "ema_decay": callback("the EMA's decay"),
    "swa": arg("`callbacks`: `StochasticWeightAveraging`", _pl_swa),
    "swa_start": arg("`StochasticWeightAveraging(swa_epoch_start=...)`", lambda c: {}),
    "swa_lr": arg("`StochasticWeightAveraging(swa_lrs=...)` (0: lr)", lambda c: {}),
    "seed": Place("`lightning.seed_everything(seed, workers=True)` before building the model (TricksCallback "
                  "checks it)", lambda c: Route("code", line=f"lightning.seed_everything({c.seed}, workers=True)")),
    "deterministic": arg("`deterministic`", lambda c: {"deterministic": c.deterministic}),
    "detect_anomaly": arg("`detect_anomaly`", lambda c: {"detect_anomaly": c.detect_anomaly}),
    "nan_guard": callback("stops on a non-finite loss, naming the step"),
    "checkpoint_dir": arg("`callbacks`: `ModelCheckpoint(dirpath=...)`, `default_root_dir`", _pl_checkpoints),
    "checkpoint_every": arg("`ModelCheckpoint(every_n_train_steps=...)` (0: every epoch)", lambda c: {}),
    "keep_checkpoints": arg("`ModelCheckpoint(save_top_k=...)` (0: all)", lambda c: {}),
    "resume": Place("`trainer.fit(module, ckpt_path=\"last\")`",
                    _pl_code('trainer.fit(module, ckpt_path="last")', lambda c: c.resume)),
    "log_every": arg("`log_every_n_steps`", lambda c: {"log_every_n_steps": c.log_every}),
    "log_dir": arg("`logger`: `CSVLogger` (metrics.csv)", lambda c: {"logger": Make(
        "lightning.pytorch.loggers.CSVLogger", {"save_dir": c.log_dir, "name": "", "version": ""})}
        if c.log_dir else {}),
    "progress": arg("`enable_progress_bar`", lambda c: {"enable_progress_bar": c.progress}),
    "distributed": arg("`strategy` (`ddp`; fsdp: `FSDPStrategy`)", _pl_strategy),
    "fsdp_reshard": arg("`FSDPStrategy(sharding_strategy=...)`", lambda c: {}),
    "sync_bn": arg("`sync_batchnorm`", lambda c: {"sync_batchnorm": c.sync_bn}),
    "device": arg("`accelerator` / `devices`", _pl_device),
}


# -- Accelerate: Accelerator's keywords, Tricks.prepare / Tricks.after_step for the rest, lines of your loop ----

_AC = "accelerate"
_TRICKS = "Tricks (tricks_for(cfg)): "


def _ac_tricks(doc: str) -> Place:
    """Applied by the Tricks that ``tricks_for(cfg)`` makes: its ``prepare`` (model, optimizer, schedule, EMA)
    and ``after_step`` (NaN guard, schedule, EMA after your optimizer step)."""
    return Place(_TRICKS + doc, lambda c: Route("callback"))


def _dynamo_mode(c: TrainConfig) -> dict[str, Any]:
    """TorchDynamoPlugin's ``mode`` for a compile mode other than the default (T35)."""
    return {"mode": c.compile} if isinstance(c.compile, str) else {}


def _ac_distributed(c: TrainConfig) -> dict[str, Any]:
    no_zero1(c, _AC, "deepspeed_plugin, ZeRO stage 1")
    if c.distributed != "fsdp":
        return {}  # one process, or DDP under accelerate launch / torchrun: the Accelerator's own behaviour
    return {"fsdp_plugin": Make("accelerate.utils.FullyShardedDataParallelPlugin",
                                {"fsdp_version": 2, "reshard_after_forward": c.fsdp_reshard})}


def _ac_device(c: TrainConfig) -> dict[str, Any]:
    if c.device.startswith("cuda:"):
        raise no_place("device", c.device, _AC, f"the Accelerator takes the process's device: run with "
                       f"CUDA_VISIBLE_DEVICES={c.device.split(':')[1]} and device = cuda")
    return {"cpu": True} if c.device == "cpu" else {}


def _ac_checkpoints(c: TrainConfig) -> dict[str, Any]:
    if not c.checkpoint_dir:
        return {}
    keep = {"total_limit": c.keep_checkpoints or None} if "keep_checkpoints" in c.given else {}
    return {"project_config": Make("accelerate.utils.ProjectConfiguration", {
        "project_dir": c.checkpoint_dir, "automatic_checkpoint_naming": True, **keep})}


def _ac_code(line: Callable[[TrainConfig], str], when: Callable[[TrainConfig], bool] = lambda c: True
             ) -> Callable[[TrainConfig], Route]:
    return lambda c: Route("code", line=line(c)) if when(c) else Route("arg")


_ACCELERATE: dict[str, Place] = {
    "epochs": Place("your loop: `for epoch in range(epochs)`",
                    _ac_code(lambda c: f"for epoch in range({c.epochs}):  # and stop at max_steps")),
    "max_steps": Place("your loop: stop after max_steps optimizer steps (`tricks.step_count`)",
                       _ac_code(lambda c: f"if tricks.step_count >= {c.max_steps}: break", lambda c: c.max_steps > 0)),
    "batch_size": Place("your DataLoader's `batch_size`",
                        _ac_code(lambda c: f"DataLoader(dataset, batch_size={c.batch_size}, shuffle=True)")),
    "token_batches": _token_loader("loader"),
    **{k: _ac_tricks("the optimizer it builds (no-decay groups, fused step, low-precision state, scaled lr)")
       for k in ("lr", "optimizer", "weight_decay", "momentum", "scale_lr", "base_batch", "fused_optimizer",
                 "no_decay_norm_bias", "optimizer_state")},
    "schedule": _ac_tricks("the lr schedule, stepped by `tricks.after_step`"),
    "warmup_steps": _ac_tricks("the lr schedule's warm-up"),
    "precision": arg("`mixed_precision` (`no`, `bf16`, `fp16`)", lambda c: {"mixed_precision": {
        "fp32": "no", "bf16": "bf16", "fp16": "fp16"}[c.precision]}),
    "channels_last": _ac_tricks("the model's weights channels_last (`tricks.to_device` for the inputs)"),
    "compile": arg("`dynamo_plugin`: `TorchDynamoPlugin(backend=\"inductor\", mode=...)`", lambda c: {"dynamo_plugin": Make(
        "accelerate.utils.TorchDynamoPlugin", {"backend": "inductor", **_dynamo_mode(c)})} if c.compile else {}),
    "cudnn_benchmark": _ac_tricks("torch.backends.cudnn.benchmark"),
    "keep_heap": _ac_tricks("glibc keeps freed memory (CPU)"),
    "threads": _ac_tricks(_THREADS),
    "fp32_matmul": _ac_tricks(_FP32_MATMUL),
    "attention": _ac_tricks(_ATTENTION),
    "float8": _ac_tricks(_FLOAT8),
    "liger": _ac_tricks(_LIGER),
    "accumulate": arg("`gradient_accumulation_steps`, with `accelerator.accumulate(model)` in your loop",
                      lambda c: {"gradient_accumulation_steps": c.accumulate}),
    "bn_momentum_adjust": _ac_tricks("BatchNorm momentum for the micro-batches"),
    "checkpointing": _ac_tricks("activation checkpointing"),
    "inplace": _ac_tricks("in-place activations"),
    "memory_efficient_bn": _ac_tricks("memory-efficient BatchNorm + activation"),
    "chunked_lm_loss": _ac_tricks("the causal LM's loss chunk by chunk"),
    "optimizer_in_backward": _ac_tricks("each parameter stepped in backward (your `optimizer.step()` then steps "
                                        "nothing)"),
    "offload_activations": Place(_TRICKS + "saved activations in pinned host memory: the forward inside "
                                 "`with tricks.autocast():`",
                                 _ac_code(lambda c: "with tricks.autocast():  # the activation offload",
                                          lambda c: c.offload_activations)),
    "auto_micro_batch": off(_AC, "auto_micro_batch", "Accelerate's find_executable_batch_size halves the batch "
                                "without keeping the effective batch: set auto_micro_batch = false"),
    "grad_clip": Place("your loop: `accelerator.clip_grad_norm_(model.parameters(), grad_clip)` when "
                       "`accelerator.sync_gradients`",
                       _ac_code(lambda c: f"if accelerator.sync_gradients: accelerator.clip_grad_norm_("
                                          f"model.parameters(), {c.grad_clip})", lambda c: c.grad_clip > 0)),
    "ema": _ac_tricks("EMA weights, updated by `tricks.after_step`"),
    "ema_decay": _ac_tricks("the EMA's decay"),
    "swa": off(_AC, "swa", "Tricks averages weights with EMA only (SWA needs the epochs of torch-tricks train): use "
                   "ema = true"),
    "swa_start": _ac_tricks("read only with swa"),
    "swa_lr": _ac_tricks("read only with swa"),
    "seed": _ac_tricks("seeded when it is made (torch, numpy, random; the same seed fit uses)"),
    "deterministic": _ac_tricks("deterministic algorithms"),
    "detect_anomaly": _ac_tricks("torch.autograd anomaly detection"),
    "nan_guard": _ac_tricks("`tricks.guard(loss)` before your optimizer step stops on a non-finite loss, naming "
                            "the step"),
    "checkpoint_dir": arg("`project_config`: `ProjectConfiguration(project_dir=...)`; "
                          "`accelerator.save_state()` in your loop", _ac_checkpoints),
    "checkpoint_every": Place("your loop: `accelerator.save_state()` every N steps",
                              _ac_code(lambda c: f"if tricks.step_count % {c.checkpoint_every} == 0: "
                                                 "accelerator.save_state()",
                                       lambda c: bool(c.checkpoint_dir and c.checkpoint_every))),
    "keep_checkpoints": arg("`ProjectConfiguration(total_limit=...)`", lambda c: {}),
    "resume": Place("your loop: `accelerator.load_state()` before training",
                    _ac_code(lambda c: "accelerator.load_state()  # the newest checkpoint of project_dir",
                             lambda c: c.resume)),
    "log_every": Place("your loop: `accelerator.log(...)` every N steps",
                       _ac_code(lambda c: f"if tricks.step_count % {c.log_every} == 0: "
                                          "accelerator.log({'loss': loss.item()}, step=tricks.step_count)",
                                lambda c: bool(c.log_dir))),
    "log_dir": arg("`log_with=\"tensorboard\"`, `project_dir`", lambda c: {"log_with": "tensorboard",
                                                                          "project_dir": c.log_dir}
                   if c.log_dir else {}),
    "progress": Place("your loop: a tqdm bar on the main process",
                      _ac_code(lambda c: "tqdm(loader, disable=not accelerator.is_local_main_process)",
                               lambda c: c.progress)),
    "distributed": arg("DDP under `accelerate launch` / torchrun as Accelerate does; fsdp: `fsdp_plugin` "
                       "(FSDP2)", _ac_distributed),
    "fsdp_reshard": arg("`FullyShardedDataParallelPlugin(reshard_after_forward=...)`", lambda c: {}),
    "sync_bn": Place("your script: `SyncBatchNorm.convert_sync_batchnorm(model)` before `accelerator.prepare`",
                     _ac_code(lambda c: "model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # before "
                                        "accelerator.prepare", lambda c: c.sync_bn)),
    "device": arg("`cpu=True` for cpu; the process's device otherwise", _ac_device),
}


def _fit_table() -> dict[str, Place]:
    return {key: Place(f"`{key}`", lambda c, k=key: Route("arg", {k: getattr(c, k)})) for key in _keys()}


# -- transformers' Trainer: TrainingArguments keywords, the Trainer's own keywords, TricksCallback ------------

def _hf_optim(c: TrainConfig) -> dict[str, Any]:
    """``optim`` (and ``optim_args``) for the optimizer, its fused step and its state."""
    if c.optimizer == "sgd":
        return {"optim": "sgd", "optim_args": f"momentum={c.momentum}"}
    if c.optimizer == "adam" and c.weight_decay:
        raise no_place("optimizer", "adam", "hf", "the Trainer's Adam is AdamW (decoupled weight decay); Adam's "
                       "weight decay goes into the gradient: use optimizer = adamw, or weight_decay = 0")
    if c.optimizer_state in ("8bit", "4bit"):
        return {"optim": f"adamw_torch_{c.optimizer_state}"}
    if c.optimizer_state == "bf16":
        return {}  # Trainer(optimizer_cls_and_kwargs=...): see optimizer_state
    return {"optim": "adamw_torch_fused" if c.fused_optimizer else "adamw_torch"}


def _hf_schedule(c: TrainConfig) -> dict[str, Any]:
    kind = {"constant": "constant_with_warmup" if c.warmup_steps else "constant"}.get(c.schedule, c.schedule)
    return {"lr_scheduler_type": kind}


def _hf_saving(c: TrainConfig) -> dict[str, Any]:
    if not c.checkpoint_dir:
        return {"save_strategy": "no"}
    every = {"save_strategy": "steps", "save_steps": c.checkpoint_every} if c.checkpoint_every else \
        {"save_strategy": "epoch"}
    keep = {"save_total_limit": c.keep_checkpoints or None} if "keep_checkpoints" in c.given else {}
    return {"output_dir": c.checkpoint_dir, **every, **keep}


def _hf_save_every(c: TrainConfig) -> dict[str, Any]:
    if "checkpoint_dir" in c.given or not c.checkpoint_every:
        return {}  # with checkpoint_dir; 0 (each epoch) alone would change no saving of the Trainer's own
    return {"save_strategy": "steps", "save_steps": c.checkpoint_every}


def _hf_distributed(c: TrainConfig) -> dict[str, Any]:
    no_zero1(c, "hf", "deepspeed=... with a ZeRO-1 config")
    if c.distributed != "fsdp":
        return {}  # one process, or DDP under torchrun: the Trainer's own behaviour
    return {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": c.fsdp_reshard}}


def _hf_device(c: TrainConfig) -> dict[str, Any]:
    if c.device.startswith("cuda:"):
        raise no_place("device", c.device, "hf", f"the Trainer takes the process's device: run with "
                       f"CUDA_VISIBLE_DEVICES={c.device.split(':')[1]} and device = cuda")
    return {"use_cpu": True} if c.device == "cpu" else {}


def _hf_bf16_state(c: TrainConfig) -> Route:
    if c.optimizer_state != "bf16":
        return Route("arg", _hf_optim(c) if c.optimizer_state else {})
    decoupled = c.optimizer == "adamw"
    return Route("code", line=(
        "Trainer(..., optimizer_cls_and_kwargs=(Bf16StateAdam, {'lr': args.learning_rate, 'weight_decay': "
        "args.weight_decay, 'decoupled': %r}))  # from torch_tricks.train.optim_state import Bf16StateAdam"
        % decoupled))


def _hf_resume(c: TrainConfig) -> Route:
    return Route("code", line="trainer.train(resume_from_checkpoint=True)") if c.resume else Route("arg")


_HF: dict[str, Place] = {
    "epochs": arg("`num_train_epochs`", lambda c: {"num_train_epochs": float(c.epochs)}),
    "max_steps": arg("`max_steps` (0: -1)", lambda c: {"max_steps": c.max_steps or -1}),
    "batch_size": arg("`per_device_train_batch_size`", lambda c: {"per_device_train_batch_size": c.batch_size}),
    "token_batches": Place("`data_collator` (a `Trainer` keyword) for token rows (T39-T41); grouped also "
                           "`train_sampling_strategy=\"group_by_length\"` (`group_by_length` before transformers 5)",
                           _hf_token_batches),
    "lr": arg("`learning_rate`", lambda c: {"learning_rate": learning_rate(c)}),
    "optimizer": arg("`optim` (adamw: `adamw_torch`; sgd: `sgd` with `optim_args` momentum)", _hf_optim),
    "weight_decay": arg("`weight_decay`", lambda c: {"weight_decay": c.weight_decay}),
    "momentum": arg("`optim_args=\"momentum=...\"` (sgd)", lambda c: _hf_optim(c) if c.optimizer == "sgd" else {}),
    "schedule": arg("`lr_scheduler_type`", _hf_schedule),
    "warmup_steps": arg("`warmup_steps`", lambda c: {"warmup_steps": c.warmup_steps}),
    "scale_lr": arg("`learning_rate`, scaled to the global batch", lambda c: {}),
    "base_batch": arg("`learning_rate`, scaled to the global batch", lambda c: {}),
    "precision": arg("`bf16` / `fp16`", lambda c: {"bf16": c.precision == "bf16", "fp16": c.precision == "fp16"}),
    "channels_last": callback("the model's weights channels_last"),
    "compile": arg("`torch_compile` (and `torch_compile_mode`)", lambda c: {
        "torch_compile": bool(c.compile), **({"torch_compile_mode": c.compile} if isinstance(c.compile, str) else {})}),
    "cudnn_benchmark": callback("torch.backends.cudnn.benchmark"),
    "fused_optimizer": arg("`optim=\"adamw_torch_fused\"`", _hf_optim),
    "no_decay_norm_bias": refuse_unless(
        "no_decay_norm_bias", "hf", lambda v: v, "the Trainer always exempts biases and LayerNorm weights from "
        "weight decay: set no_decay_norm_bias = true (or weight_decay = 0)",
        Place("the Trainer's own parameter groups (biases and LayerNorm weights without decay)",
              lambda c: Route("arg"))),
    "keep_heap": callback("glibc keeps freed memory (CPU)"),
    "threads": callback(_THREADS),
    "fp32_matmul": callback(_FP32_MATMUL),
    "attention": callback(_ATTENTION),
    "float8": callback(_FLOAT8),
    "liger": arg("`use_liger_kernel` (the Trainer applies Liger itself)", lambda c: {"use_liger_kernel": c.liger}),
    "accumulate": arg("`gradient_accumulation_steps`", lambda c: {"gradient_accumulation_steps": c.accumulate}),
    "bn_momentum_adjust": callback("BatchNorm momentum for the micro-batches"),
    "checkpointing": arg(
        "`gradient_checkpointing` for `blocks` (a transformers model); TricksCallback for `sqrt` or a name pattern",
        lambda c: {"gradient_checkpointing": c.checkpointing == "blocks",
                   **({"gradient_checkpointing_kwargs": {"use_reentrant": False}} if c.checkpointing == "blocks"
                      else {})}),
    "inplace": callback("in-place activations"),
    "memory_efficient_bn": callback("memory-efficient BatchNorm + activation"),
    "chunked_lm_loss": callback("the causal LM's loss chunk by chunk"),
    "optimizer_state": Place("`optim=\"adamw_torch_8bit\"` / `\"adamw_torch_4bit\"`; bf16: "
                             "`Trainer(optimizer_cls_and_kwargs=(Bf16StateAdam, ...))`", _hf_bf16_state),
    "optimizer_in_backward": off("hf", "optimizer_in_backward", "the Trainer steps its optimizer after backward and clips "
                                  "the whole gradient: train with torch-tricks train or Tricks"),
    "offload_activations": callback("saved activations in pinned host memory during forward (CUDA)"),
    "auto_micro_batch": off("hf", "auto_micro_batch", "the Trainer's auto_find_batch_size halves the batch without "
                             "keeping the effective batch: set auto_micro_batch = false and lower batch_size"),
    "grad_clip": arg("`max_grad_norm` (0: off)", lambda c: {"max_grad_norm": c.grad_clip}),
    "ema": callback("EMA weights after each step, saved as ema.pt beside each checkpoint"),
    "ema_decay": callback("the EMA's decay"),
    "swa": off("hf", "swa", "the Trainer's scheduler owns the lr that SWA holds: use ema = true, or torch-tricks train"),
    "swa_start": callback("read only with swa"),
    "swa_lr": callback("read only with swa"),
    "seed": arg("`seed`", lambda c: {"seed": c.seed}),
    "deterministic": arg("`full_determinism`", lambda c: {"full_determinism": c.deterministic}),
    "detect_anomaly": callback("torch.autograd anomaly detection"),
    "nan_guard": callback("stops on a non-finite loss, naming the step"),
    "checkpoint_dir": arg("`output_dir` (and `save_strategy`)", _hf_saving),
    "checkpoint_every": arg("`save_steps` (0: `save_strategy=\"epoch\"`)", _hf_save_every),
    "keep_checkpoints": arg("`save_total_limit` (0: all)", lambda c: {"save_total_limit": c.keep_checkpoints or None}),
    "resume": Place("`trainer.train(resume_from_checkpoint=True)`", _hf_resume),
    "log_every": arg("`logging_steps`", lambda c: {"logging_steps": c.log_every}),
    "log_dir": callback("metrics.csv of the Trainer's logs"),
    "progress": arg("`disable_tqdm`", lambda c: {"disable_tqdm": not c.progress}),
    "distributed": arg("DDP under torchrun as the Trainer does; fsdp: `fsdp=\"full_shard\"`, FSDP2", _hf_distributed),
    "fsdp_reshard": arg("`fsdp_config[\"reshard_after_forward\"]`", lambda c: {}),
    "sync_bn": callback("SyncBatchNorm under torchrun"),
    "device": arg("`use_cpu` for cpu; the process's device otherwise", _hf_device),
}


_BUILDERS: dict[str, Callable[[], dict[str, Place]]] = {"fit": _fit_table, "hf": lambda: _HF,
                                                          "lightning": lambda: _LIGHTNING,
                                                          "accelerate": lambda: _ACCELERATE}
