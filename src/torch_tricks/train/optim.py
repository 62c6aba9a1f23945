"""Optimizers built the fast and the correct way (catalogue T7, T14, T15).

* :func:`param_groups` splits a model's parameters into a decayed and a non-decayed
  group. Weight decay pulls a weight towards zero; on a bias or a normalisation scale
  that only shifts or rescales a feature, so it removes capacity instead of regularising
  (T15). Frozen parameters (``requires_grad=False``) are left out entirely (T14): given to
  an optimizer they cost state memory, and where a gradient tensor exists (zeros from an
  old ``zero_grad(set_to_none=False)``) weight decay still shrinks them towards zero.
* :func:`build_optimizer` makes SGD / Adam / AdamW / RMSprop with PyTorch's fastest step
  on the parameters' device (T7): the *fused* kernels (one kernel for the whole update of
  many tensors; what apex's FusedAdam did) where PyTorch has them for that optimizer and
  device, else the *foreach* (multi-tensor) step where PyTorch has foreach kernels for the
  device, else the plain per-parameter loop. PyTorch's own default never picks fused, and
  on CPU picks the loop; measured on a ResNet-18's parameters (torch 2.13, 2 CPU cores),
  the fused step took about 0.15x (Adam, AdamW) and 0.4x (SGD) the time of the loop,
  while CPU foreach (a fallback that loops in C++) was 0.9-1.6x, no reliable gain, so it
  is not chosen on CPU.

  ``name="adam"`` with ``weight_decay > 0`` becomes AdamW (``decoupled=True``, the
  default): Adam adds ``weight_decay * w`` to the gradient (L2), and Adam then divides it
  by the running gradient scale, so weights with large gradients are barely decayed; that
  is not weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization").
  Pass ``decoupled=False`` to keep coupled L2. What was chosen, and why, is in
  :func:`optimizer_info`.
"""

from __future__ import annotations

import fnmatch
import inspect
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
import torch.nn as nn

from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import register_trick

__all__ = [
    "OptimizerInfo",
    "param_groups",
    "build_optimizer",
    "optimizer_info",
    "fast_step_available",
    "NORM_TYPES",
    "OPTIMIZERS",
]

# Normalisation layers whose parameters are per-feature scales/shifts. Matched by type
# (subclasses included: ConvNeXt's LayerNorm2d, SyncBatchNorm, lazy BN); modules whose
# class name contains "Norm" count too, for hand-written ones (RMSNorm before torch 2.4,
# FrozenBatchNorm2d, T5's LayerNorm).
NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.batchnorm._NormBase,  # BatchNorm*, SyncBatchNorm, InstanceNorm*
        nn.GroupNorm,
        nn.LayerNorm,
        nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)

# name -> torch class. "adam" may become AdamW (see build_optimizer).
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
}

_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)
# Learned position tables and special tokens stored as bare parameters (ViT, DeiT, BERT).
_POSITION_NAMES = ("*pos_embed*", "*pos_emb*", "*position_embedding*", "*cls_token", "*dist_token", "*mask_token")
_INFO_ATTR = "torch_tricks_info"


@dataclass
class OptimizerInfo:
    """What :func:`build_optimizer` built, attached to the optimizer (see :func:`optimizer_info`)."""

    requested: str  # the name asked for
    name: str  # the optimizer built: "adamw" when "adam" + decay was switched
    implementation: str  # "fused" | "foreach" | "for-loop"
    device: str  # device type of the parameters ("cpu", "cuda", "mixed")
    groups: list[dict[str, Any]] = field(default_factory=list)  # name, params, numel, weight_decay
    frozen_excluded: int = 0  # parameters left out because requires_grad=False
    notes: list[str] = field(default_factory=list)  # decisions worth telling the user

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@register_trick(
    "no_decay_groups",
    ids=("T14", "T15"),
    kind="train",
    trades="nothing: removes weight decay where it only hurts (bias, norm, 1-D) and frozen params from the optimizer",
    needs="a model with weight decay > 0, or frozen parameters",
    config_key="no_decay_norm_bias",
)
def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    no_decay_bias_and_norm: bool = True,
    no_decay_embeddings: bool = False,
    extra_no_decay: Iterable[str | type[nn.Module]] = (),
    with_names: bool = False,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups: ``[{"name": "decay", ...}, {"name": "no_decay", ...}]``.

    Trainable parameters only (frozen ones are left out; unfreeze later with
    ``optimizer.add_param_group``). Each parameter appears once, however many modules
    share it. A parameter goes to ``no_decay`` (``weight_decay=0.0``) when
    ``no_decay_bias_and_norm`` and any module holding it says so: it belongs to a
    normalisation layer (:data:`NORM_TYPES`, or a class named ``*Norm*``), it is named
    ``bias``, or it is 0-/1-D (biases, norm scales, PReLU slopes, learned temperatures).
    ``no_decay_embeddings`` also spares ``nn.Embedding`` tables and bare position tables /
    special tokens (``pos_embed``, ``cls_token``...). ``extra_no_decay`` adds name patterns
    (``fnmatch``, e.g. ``"head.*"``) or module types; a model's ``no_weight_decay()``
    method (timm's convention) is honoured as well.

    Empty groups are dropped. ``with_names=True`` stores the names under PyTorch's
    ``"param_names"`` key (saved in the optimizer's state dict); it is off by default
    because PyTorch then refuses ``add_param_group`` calls without names.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"param_groups needs an nn.Module, got {type(model).__name__}: pass the model")
    weight_decay = _check_weight_decay(weight_decay)
    patterns, types = _split_extra(extra_no_decay)
    patterns.extend(_model_no_weight_decay(model))

    rules = _NoDecayRules(patterns, types, no_decay_bias_and_norm, no_decay_embeddings)
    return _decay_groups(_no_decay_flags(model, rules), weight_decay, with_names)


@register_trick(
    "fused_optimizer",
    ids=("T7",),
    kind="train",
    trades="nothing but a numerically equivalent kernel: one fused/multi-tensor launch instead of one per parameter",
    needs="SGD/Adam/AdamW on a device with PyTorch fused (CUDA, CPU, MPS, XPU) or foreach kernels",
    config_key="fused_optimizer",
    available=lambda device: fast_step_available(device),
)
def build_optimizer(
    model_or_params: nn.Module | Iterable[Any],
    name: str = "adamw",
    *,
    lr: float = 1e-3,
    weight_decay: float | None = None,
    momentum: float | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    fused: bool | None = None,
    foreach: bool | None = None,
    decoupled: bool = True,
    no_decay_bias_and_norm: bool = True,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """An optimizer over ``model_or_params`` with the fastest step PyTorch has for them.

    ``model_or_params``: a model (its parameters are split with :func:`param_groups`),
    or an iterable of parameters or of param-group dicts (used as given, frozen
    parameters removed). ``name``: one of :data:`OPTIMIZERS`. ``weight_decay`` defaults to
    PyTorch's default for that optimizer (0.01 for AdamW, else 0). ``momentum`` defaults
    to 0.9 for SGD (plain SGD is rarely wanted) and 0 for RMSprop; Adam/AdamW have none
    (it is ignored, with a note; ``betas[0]`` is their momentum). Other keyword arguments (``eps``, ``nesterov``, ``amsgrad``, ``alpha``...)
    go to the PyTorch class.

    ``fused`` / ``foreach``: ``None`` picks fused where PyTorch has a fused kernel for this
    optimizer, device and dtype, else foreach where the device has foreach kernels (not
    CPU, whose foreach is a slow fallback), else the loop. ``True`` insists (a
    :class:`UserError` if impossible); ``False`` rules that implementation out.

    ``decoupled``: with ``name="adam"`` and ``weight_decay > 0``, build AdamW instead (see
    the module docstring); AdamW's decay per step is ``lr * weight_decay``, so values of
    1e-2..1e-1 are typical where Adam+L2 used 1e-4. The switch and the implementation
    used are recorded in :func:`optimizer_info`.
    """
    key = str(name).lower()
    if key not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    if fused and foreach:
        raise UserError("fused=True and foreach=True exclude each other: set at most one of them")
    lr = _check_number("lr", lr, minimum=0.0)
    notes: list[str] = []
    weight_decay, built = _decay_and_class(key, weight_decay, decoupled, notes)
    groups, frozen, sparse = _trainable_groups(model_or_params, weight_decay, no_decay_bias_and_norm)
    params = _params_or_raise(groups)
    if sparse:
        notes.append("sparse embedding gradients: fused/foreach steps do not take them, the loop is used")
    opts = _optimizer_options(built, lr, weight_decay, momentum, betas, notes)
    opts.update(kwargs)

    implementation, optimizer = _construct(OPTIMIZERS[built], groups, opts, fused=fused, foreach=foreach, sparse=sparse)
    devices = {p.device.type for p in params}
    info = OptimizerInfo(
        requested=key,
        name=built,
        implementation=implementation,
        device=devices.pop() if len(devices) == 1 else "mixed",
        groups=_group_summaries(optimizer, weight_decay),
        frozen_excluded=frozen,
        notes=notes,
    )
    setattr(optimizer, _INFO_ATTR, info)
    return optimizer


def optimizer_info(optimizer: torch.optim.Optimizer) -> OptimizerInfo | None:
    """What :func:`build_optimizer` recorded about ``optimizer``; ``None`` for any other optimizer."""
    return getattr(optimizer, _INFO_ATTR, None)


def fast_step_available(device: torch.device | str) -> tuple[bool, str]:
    """(a fused or foreach optimizer step exists for ``device``, reason if not)."""
    dev = torch.device(device)
    if dev.type in _fused_devices() or dev.type in _foreach_devices():
        return True, ""
    return False, f"torch {torch.__version__} has no fused or foreach optimizer kernels for {dev.type}; the loop is used"


# --- helpers ---------------------------------------------------------------------------


def _construct(
    cls: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
    opts: dict[str, Any],
    *,
    fused: bool | None,
    foreach: bool | None,
    sparse: bool,
) -> tuple[str, torch.optim.Optimizer]:
    """Try fused, then foreach, then the loop, as allowed; return (implementation, optimizer)."""
    params = [p for g in groups for p in g["params"]]
    fused_ok = _fused_allowed(cls, params, sparse, fused)
    foreach_ok = _foreach_possible(params, sparse)

    last_error: Exception | None = None
    for impl in _implementations_to_try(fused, foreach, fused_ok, foreach_ok):
        impl_opts = _options_for(impl, opts)
        try:
            return impl, cls(_copy_groups(groups), **impl_opts)
        except TypeError as exc:
            raise UserError(f"bad option for {cls.__name__}: {exc}; see torch.optim.{cls.__name__}") from None
        except (RuntimeError, ValueError) as exc:
            last_error = exc
            if impl == "for-loop" or _insisted_on(impl, fused, foreach):
                raise UserError(f"cannot build {cls.__name__} ({impl}): {one_line(exc)}") from None
    raise UserError(f"cannot build {cls.__name__}: {one_line(last_error) if last_error else 'unknown error'}")  # pragma: no cover


def _params_or_raise(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Every parameter of ``groups``; a UserError when there is none to train."""
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise UserError(
            "the optimizer has no trainable parameters (all are frozen or none were given): "
            "set requires_grad=True on the layers to train"
        )
    return params


def _group_summaries(optimizer: torch.optim.Optimizer, weight_decay: float) -> list[dict[str, Any]]:
    """Name, parameter count, values and weight decay of each group, for :class:`OptimizerInfo`."""
    return [
        {
            "name": g.get("name", f"group{i}"),
            "params": len(g["params"]),
            "numel": sum(p.numel() for p in g["params"]),
            "weight_decay": g.get("weight_decay", weight_decay),
        }
        for i, g in enumerate(optimizer.param_groups)
    ]


def _fused_allowed(cls: type[torch.optim.Optimizer], params: list[torch.Tensor], sparse: bool,
                   fused: bool | None) -> bool:
    """Whether a fused step is possible for ``params``; with ``fused=True`` a UserError saying why not if not."""
    has_fused = "fused" in inspect.signature(cls.__init__).parameters
    fused_ok, why_not_fused = _fused_possible(cls, params, has_fused, sparse)
    if fused is True and not fused_ok:
        raise UserError(f"fused=True is not possible here: {why_not_fused}; leave fused=None to use the fastest available")
    return fused_ok


def _foreach_possible(params: list[torch.Tensor], sparse: bool) -> bool:
    return not sparse and all(p.device.type in _foreach_devices() for p in params)


def _options_for(impl: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with the flags that select ``impl``: fused=True for fused, foreach=True only for foreach."""
    impl_opts = dict(opts)
    if impl == "fused":
        impl_opts["fused"] = True
    impl_opts["foreach"] = impl == "foreach"
    return impl_opts


def _implementations_to_try(fused: bool | None, foreach: bool | None, fused_ok: bool, foreach_ok: bool) -> list[str]:
    """Fused, foreach, the loop: in that order, those that the arguments allow and the parameters can use."""
    order: list[str] = []
    if fused is not False and fused_ok and foreach is not True:
        order.append("fused")
    if foreach is True or (foreach is None and foreach_ok and fused is not True):
        order.append("foreach")
    if fused is not True and foreach is not True:
        order.append("for-loop")
    return order


def _insisted_on(impl: str, fused: bool | None, foreach: bool | None) -> bool:
    """The caller asked for exactly this implementation (True), so failing it is an error, not a fallback."""
    return (impl == "fused" and fused is True) or (impl == "foreach" and foreach is True)


def _decay_and_class(key: str, weight_decay: float | None, decoupled: bool, notes: list[str]) -> tuple[float, str]:
    """``(weight decay, optimizer to build)``: PyTorch's default decay when None; Adam with decay as AdamW
    when ``decoupled`` (module docstring). The decision goes into ``notes``."""
    if weight_decay is None:
        weight_decay = 0.01 if key == "adamw" else 0.0
    weight_decay = _check_weight_decay(weight_decay)
    if key != "adam" or weight_decay <= 0:
        return weight_decay, key
    if not decoupled:
        notes.append("adam with coupled L2 (decoupled=False): decay is weakened where gradients are large")
        return weight_decay, key
    notes.append(
        f"adam with weight_decay={weight_decay:g} built as AdamW: Adam+L2 is not weight decay "
        "(the L2 gradient is rescaled by Adam); pass decoupled=False to keep Adam+L2"
    )
    return weight_decay, "adamw"


def _trainable_groups(
    model_or_params: nn.Module | Iterable[Any], weight_decay: float, no_decay_bias_and_norm: bool
) -> tuple[list[dict[str, Any]], int, bool]:
    """``(param groups, frozen parameters left out, sparse embedding gradients)``: a model split with
    :func:`param_groups`, anything else used as given."""
    if not isinstance(model_or_params, nn.Module):
        groups, frozen = _groups_from_iterable(model_or_params)
        return groups, frozen, False
    groups = param_groups(model_or_params, weight_decay, no_decay_bias_and_norm=no_decay_bias_and_norm)
    frozen = sum(1 for p in _unique_params(model_or_params) if not p.requires_grad)
    sparse = any(getattr(m, "sparse", False) for m in model_or_params.modules() if isinstance(m, _EMBEDDING_TYPES))
    return groups, frozen, sparse


def _optimizer_options(built: str, lr: float, weight_decay: float, momentum: float | None,
                       betas: tuple[float, float], notes: list[str]) -> dict[str, Any]:
    """The class's options: momentum for SGD (0.9 by default) and RMSprop, betas for Adam / AdamW."""
    opts: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if built in _DEFAULT_MOMENTUM:
        opts["momentum"] = _DEFAULT_MOMENTUM[built] if momentum is None else _check_number("momentum", momentum,
                                                                                           minimum=0.0)
    else:
        if momentum is not None:  # a config's shared momentum field: not an error, but not silent
            notes.append(f"momentum={momentum:g} ignored: {built} has none (its betas[0]={betas[0]:g} plays that part)")
        opts["betas"] = tuple(betas)
    return opts


_DEFAULT_MOMENTUM = {"sgd": 0.9, "rmsprop": 0.0}  # the optimizers with a momentum option, and its default here


@dataclass(frozen=True)
class _NoDecayRules:
    """What :func:`param_groups` spares from weight decay."""

    patterns: list[str]  # fnmatch patterns on full parameter names
    types: tuple[type, ...]  # module types whose parameters all go without decay
    bias_and_norm: bool
    embeddings: bool

    def for_module(self, module: nn.Module) -> bool:
        """Every parameter held directly by ``module`` goes without decay."""
        if self.types and isinstance(module, self.types):
            return True
        if self.bias_and_norm and _is_norm(module):
            return True
        return self.embeddings and isinstance(module, _EMBEDDING_TYPES)

    def for_param(self, full: str, p_name: str, p: torch.Tensor) -> bool:
        """This parameter goes without decay, by its name or its shape."""
        if _matches_any(full, self.patterns):
            return True
        if self.bias_and_norm and (p_name == "bias" or p.ndim <= 1):
            return True
        return self.embeddings and _matches_any(full, _POSITION_NAMES)


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer: one of :data:`NORM_TYPES`, or a class named ``*Norm*`` (timm's, your own)."""
    return isinstance(module, NORM_TYPES) or "Norm" in type(module).__name__


def _matches_any(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def _no_decay_flags(model: nn.Module, rules: _NoDecayRules) -> dict[int, list[Any]]:
    """id -> [name, param, no_decay] for each parameter once, in ``named_parameters`` order; a shared
    parameter goes without decay when any module holding it says so."""
    seen: dict[int, list[Any]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        module_no_decay = rules.for_module(module)
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            entry = seen.setdefault(id(p), [full, p, False])
            if p.requires_grad:
                entry[2] = entry[2] or module_no_decay or rules.for_param(full, p_name, p)
    return seen


def _decay_groups(seen: dict[int, list[Any]], weight_decay: float, with_names: bool) -> list[dict[str, Any]]:
    """The "decay" and "no_decay" groups of the trainable parameters, empty ones dropped."""
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    for name, p, nd in seen.values():
        if p.requires_grad:
            (no_decay if nd else decay).append((name, p))
    return [_named_group(gname, items, wd, with_names)
            for gname, items, wd in (("decay", decay, weight_decay), ("no_decay", no_decay, 0.0)) if items]


def _named_group(gname: str, items: list[tuple[str, nn.Parameter]], wd: float, with_names: bool) -> dict[str, Any]:
    group: dict[str, Any] = {"name": gname, "params": [p for _, p in items], "weight_decay": wd}
    if with_names:
        group["param_names"] = [n for n, _ in items]
    return group


def _fused_possible(
    cls: type[torch.optim.Optimizer], params: list[torch.Tensor], has_fused: bool, sparse: bool
) -> tuple[bool, str]:
    if not has_fused:
        return False, f"torch {torch.__version__} has no fused {cls.__name__}"
    if sparse:
        return False, "sparse gradients (nn.Embedding(sparse=True)) are not supported by fused steps"
    devices = _fused_devices()
    for p in params:
        if p.device.type not in devices:
            return False, f"torch {torch.__version__} has no fused kernels for {p.device.type}"
        if not torch.is_floating_point(p):
            return False, f"fused steps need floating point parameters, got {p.dtype}"
    if cls not in _FUSED_ON_DTENSOR and any(hasattr(p, "to_local") for p in params):  # DTensor parameters
        # fit under FSDP on a CPU crashed at the first step: "aten._fused_sgd_ has no sharding strategy"
        return False, f"sharded (DTensor) parameters: torch has no sharded fused {cls.__name__} step"
    return True, ""


# The optimizers whose fused step DTensor (FSDP2's sharded parameters) has a sharding rule for.
_FUSED_ON_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)


def _fused_devices() -> list[str]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # older torch: fused only on CUDA
        return ["cuda"]


def _foreach_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        return list(_get_foreach_kernels_supported_devices())
    except ImportError:
        return ["cuda"]


def _copy_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # torch.optim mutates the dicts it is given (setdefault of every option); keep ours clean
    # so a failed attempt leaves nothing behind for the next one.
    return [dict(g, params=list(g["params"])) for g in groups]


def _groups_from_iterable(params: Iterable[Any]) -> tuple[list[dict[str, Any]], int]:
    if isinstance(params, torch.Tensor):
        params = [params]
    try:
        items = list(params)
    except TypeError:
        raise UserError(
            f"build_optimizer needs a model, parameters or param-group dicts, got {type(params).__name__}"
        ) from None
    if not items:
        return [], 0
    if all(isinstance(it, dict) for it in items):
        return _trainable_of_dicts(items)
    if all(isinstance(it, torch.Tensor) for it in items):
        return _trainable_of_tensors(items)
    raise UserError("build_optimizer: give either tensors or param-group dicts, not a mix of both")


def _trainable_of_tensors(items: list[torch.Tensor]) -> tuple[list[dict[str, Any]], int]:
    """One group of the trainable tensors given, each once; how many were left out."""
    keep = list({id(p): p for p in items if p.requires_grad}.values())
    return ([{"params": keep}] if keep else []), len(items) - len(keep)


def _trainable_of_dicts(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The param-group dicts given, frozen parameters removed (and groups left empty); how many were frozen."""
    groups, frozen = [], 0
    for i, g in enumerate(items):
        if "params" not in g:
            raise UserError(f"param group {i} has no 'params' key: give each group dict a 'params' list")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        keep = [p for p in ps if p.requires_grad]
        frozen += len(ps) - len(keep)
        if keep:
            groups.append(dict(g, params=keep))
    return groups, frozen


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def _split_extra(extra: Iterable[str | type[nn.Module]]) -> tuple[list[str], tuple[type, ...]]:
    if isinstance(extra, (str, type)):
        extra = [extra]
    patterns: list[str] = []
    types: list[type] = []
    for e in extra:
        if isinstance(e, str):
            patterns.append(e)
        elif isinstance(e, type) and issubclass(e, nn.Module):
            types.append(e)
        else:
            raise UserError(f"extra_no_decay takes name patterns or nn.Module types, got {e!r}")
    return patterns, tuple(types)


def _model_no_weight_decay(model: nn.Module) -> list[str]:
    fn = getattr(model, "no_weight_decay", None)
    if not callable(fn):
        return []
    names = fn()
    # timm returns bare names ("pos_embed") or prefixes; match the name itself and below it
    return [pat for n in names for pat in (str(n), f"{n}.*")]


def _check_weight_decay(weight_decay: Any) -> float:
    return _check_number("weight_decay", weight_decay, minimum=0.0)


def _check_number(name: str, value: Any, *, minimum: float) -> float:
    if isinstance(value, bool):
        raise UserError(f"{name} must be a number >= {minimum:g}, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{name} must be a number >= {minimum:g}, got {value!r}") from None
    if not v >= minimum or v != v or v == float("inf"):
        raise UserError(f"{name} must be a finite number >= {minimum:g}, got {value!r}")
    return v

