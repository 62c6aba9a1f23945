"""The deploy-step protocol: one :class:`DeployStep` per step, registered once next to its code.

A step is what :func:`torch_tricks.deploy.pipeline.optimize` chains by name (``"fuse,int8"``).
:func:`deploy_step` decorates the step's ``apply(model, ctx) -> (model, StepResult)`` in the
module that holds its code (``fuse.py``, ``quantize.py`` ...) and registers, in one place,
both the step (for the planner) and its trick (:func:`torch_tricks.registry.register_trick`,
so the tuner, ``list_tricks()`` and ``docs/tricks.md`` list it). Adding a step therefore
touches one module: the planner, the CLI's ``--steps`` and ``list_steps()`` find it here.

Each step has one name, the one ``optimize`` and ``--steps`` take (``fuse``, ``int8`` ...),
and its trick entry has the same name. The trick names that came first (``fuse_conv_bn``,
``int8_static`` ...) stay aliases of both, so user code and ``--skip`` that name them work.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from torch_tricks.deploy.step_report import Agreement
from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import always, register_trick, unregister_trick

__all__ = [
    "Coverage",
    "DeployStep",
    "StepContext",
    "StepResult",
    "Tolerance",
    "deploy_step",
    "get_step",
    "list_steps",
    "registered_steps",
]

INT8_TARGETS = ("vnni", "no-vnni")  # the int8 setting a step can be forced to (:vnni / :no-vnni)
TOP1_MIN_ROWS = 10  # top-1 agreement on fewer rows is too coarse to hold a step to


@dataclass(frozen=True)
class Tolerance:
    """How far a step's outputs may move from the model before it (None = not checked).

    ``max_rel_diff`` is ``max|a - b| / max|b|``; ``max_abs_diff`` passes on its own (an
    ``or``); ``min_top1`` applies to 2-D outputs of at least ``TOP1_MIN_ROWS`` rows.
    """

    max_rel_diff: float | None = None
    max_abs_diff: float | None = None
    min_top1: float | None = None

    def describe(self) -> str:
        parts = []
        if self.max_abs_diff is not None and self.max_rel_diff is not None:
            parts.append(f"max abs diff <= {self.max_abs_diff:g} or max rel diff <= {self.max_rel_diff:g}")
        elif self.max_rel_diff is not None:
            parts.append(f"max rel diff <= {self.max_rel_diff:g}")
        elif self.max_abs_diff is not None:
            parts.append(f"max abs diff <= {self.max_abs_diff:g}")
        if self.min_top1 is not None:
            parts.append(f"top-1 agreement >= {self.min_top1:.0%}")
        return " and ".join(parts)

    def holds(self, a: Agreement) -> bool:
        if not self._diff_holds(a):
            return False
        return bool(self._top1_holds(a))

    def _diff_holds(self, a: Agreement) -> bool:
        """The rel or the abs diff within its bound (either passes; no bound given passes)."""
        if self.max_rel_diff is None and self.max_abs_diff is None:
            return True
        return bool(_within(a.max_rel_diff, self.max_rel_diff) or _within(a.max_abs_diff, self.max_abs_diff))

    def _top1_holds(self, a: Agreement) -> bool:
        """Top-1 agreement within its bound (passes when either the bound or the measure is missing)."""
        return self.min_top1 is None or a.top1_agreement is None or a.top1_agreement >= self.min_top1


def _within(value: float, bound: float | None) -> bool:
    return bound is not None and value <= bound


EXACT = Tolerance(max_rel_diff=1e-4)
# int8 moves outputs by a few % of their range (more on random weights, whose margins are
# thin); this catches a broken calibration (ranges from the wrong data: rel diff ~1, top-1
# near chance), not rounding.
INT8 = Tolerance(max_rel_diff=0.3, min_top1=0.9)


@dataclass
class Coverage:
    """How many of the layers a step targets it changed, and why it left the others as they were.

    A step's speed-up or size says nothing about *what* it changed: int8-dynamic once quantized
    only GPT-2's head and still showed a speed-up. ``kept``: layers the step leaves on purpose
    (a head tied to the input embedding stays fp32, or the file would hold a second copy;
    a BatchNorm after no conv); ``missed``: layers the step is meant to change and could not.
    Both map a layer name (or a count, where the backend gives no names) to why. A step with
    ``missed`` layers is ``partial``; one that changed none, ``no change`` (:attr:`StepResult.status`).
    """

    verb: str  # what the step does to a layer: "quantized", "folded", "cast", "pruned"
    changed: int
    total: int
    kind: str  # what it counts: "matmul layers", "BatchNorm layers" ...
    left_as: str = "as they were"  # how the others stay: "fp32"
    kept: dict[str, str] = field(default_factory=dict)
    missed: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """``"quantized 8 of 9 matmul layers; lm_head left fp32: tied to the input embedding ..."``."""
        text = f"{self.verb} {self.changed} of {self.total} {self.kind}"
        for why, names in _by_reason({**self.kept, **self.missed}).items():
            text += f"; {_some_names(names)} left {self.left_as}: {why}"
        return text


def _by_reason(left: Mapping[str, str]) -> dict[str, list[str]]:
    """Layer -> why, as why -> layers (in order), so one reason is said once."""
    out: dict[str, list[str]] = {}
    for name, why in left.items():
        out.setdefault(why, []).append(name)
    return out


def _some_names(names: list[str], shown: int = 3) -> str:
    """``lm_head``, or ``5 layers (a, b, c, ...)``: a line stays short on a large model."""
    if len(names) == 1:
        return names[0]
    more = ", ..." if len(names) > shown else ""
    return f"{len(names)} layers ({', '.join(names[:shown])}{more})"


@dataclass
class StepResult:
    """One model of the chain (``"original"`` or a step) measured against the original.

    ``agreement`` compares with the original model, ``step_agreement`` with the model
    just before this step (what ``tolerance`` is about: a pruned-then-fused model differs
    from the original because of the pruning, not the fusion). ``backend`` says which
    implementation ran (``fx``/``eager`` fusion, ``pt2e``/``fx`` int8, ...); ``details`` is
    the step's own report (:class:`~torch_tricks.deploy.quantize.QuantReport` etc.) as a
    dict. ``size_bytes`` is ``torch.save(state_dict)`` bytes for modules and the file size
    for ONNX; ``latency_s``/``speedup`` map a batch size to the median seconds and to
    original / this (``None`` where the model cannot run that batch, or not measured).
    ``int8_setting`` (int8 steps): the int8 range and types the kernels got and why
    (:meth:`~torch_tricks.deploy.cpu_int8.Int8Setting.to_dict`). ``coverage``: how many of the
    layers it targets it changed (None for steps that do not count layers); a coverage of none
    makes ``changed`` False. :attr:`status` is the word the table shows.
    """

    step: str
    name: str
    backend: str = ""
    changed: bool = True
    seconds: float = 0.0
    agreement: Agreement | None = None
    step_agreement: Agreement | None = None
    tolerance: str | None = None
    within_tolerance: bool | None = None
    params: int = 0
    size_bytes: int = 0
    size_method: str = "torch.save(state_dict()) bytes"
    latency_s: dict[int, float | None] = field(default_factory=dict)
    latency_iqr_s: dict[int, float | None] = field(default_factory=dict)
    speedup: dict[int, float | None] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    int8_setting: dict[str, Any] | None = None
    coverage: Coverage | None = None
    model: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.coverage is not None and self.coverage.changed == 0:
            self.changed = False

    @property
    def status(self) -> str:
        """``EXCEEDED`` (outside its tolerance), ``no change``, ``partial`` (layers it targets
        missed), ``ok`` (changed the model, within its tolerance), or ``-`` (not held to one)."""
        if self.within_tolerance is False:
            return "EXCEEDED"
        if not self.changed:
            return "no change"
        if self.coverage is not None and self.coverage.missed:
            return "partial"
        return "ok" if self.within_tolerance else "-"

    def to_dict(self) -> dict[str, Any]:
        shallow = copy.copy(self)
        shallow.model = None  # asdict would deep-copy the model
        d = {k: v for k, v in asdict(shallow).items() if k != "model"}
        d["status"] = self.status
        d["coverage_text"] = self.coverage.describe() if self.coverage is not None else None
        return json_safe(d)


@dataclass
class StepContext:
    """What a step's ``apply`` gets besides the model: the chain's inputs and its own argument.

    ``arg`` is the argument as typed (``"macs=0.5"`` for ``prune:macs=0.5``), ``mode`` the
    checked choice among :attr:`DeployStep.args` (lower case, the first one by default);
    ``for_vnni`` the int8 setting forced for kernels with (True) / without (False) VNNI,
    None for this CPU's; ``workdir`` a temporary folder for steps that write files.
    """

    example: tuple[Any, ...]
    calib: list[tuple[Any, ...]] | None
    device: torch.device
    workdir: Any = None
    index: int = 1
    text: str = ""
    name: str = ""
    arg: str = ""
    mode: str = ""
    for_vnni: bool | None = None

    def result(self, **fields: Any) -> StepResult:
        """A :class:`StepResult` for this step, named as the chain gave it; its coverage (how many
        layers it changed) is its first note, so every view that lists the notes says it."""
        cov = fields.get("coverage")
        if cov is not None:
            fields["notes"] = [cov.describe(), *fields.get("notes", [])]
        return StepResult(step=self.text, name=self.name, **fields)


Apply = Callable[[Any, StepContext], "tuple[Any, StepResult]"]


@dataclass(frozen=True)
class DeployStep:
    """One deploy step: what it does, what it takes, and how the chain must treat it.

    ``final`` steps turn the model into something no other step can take (quantized
    kernels, an ONNX Runtime session): at most one per chain, last. ``args`` are the
    argument forms it takes (the first is the default mode); ``check_arg`` replaces the
    choice among them for free-form arguments (``prune:0.3``); ``targets``: takes
    ``:vnni`` / ``:no-vnni``; ``one_int8_setting``: an int8 step with a single setting (why
    ``int8_for="vnni"`` is refused). ``before``: step name -> why this step must come
    before it. ``check_device`` / ``check_needs(mode)`` raise a :class:`UserError` before
    any work; ``needs_calib(mode)`` and ``needs_workdir`` say what the chain must prepare.
    """

    name: str
    summary: str
    apply: Apply
    args: tuple[str, ...] = ()
    final: bool = False
    cpu_only: bool = False
    tolerance: Tolerance | None = None
    ids: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    trick: str = ""  # its entry in the trick registry: the same name
    order: int = 100
    targets: bool = False
    one_int8_setting: str = ""
    check_arg: Callable[[str], None] | None = None
    check_device: Callable[[torch.device], None] | None = None
    check_needs: Callable[[str], None] | None = None
    needs_calib: Callable[[str], bool] | bool = False
    needs_workdir: bool = False
    before: Mapping[str, str] = field(default_factory=dict)
    writes_onnx: bool = False  # its final model is an ONNX Runtime session, saved as an .onnx file

    def parse(self, arg: str) -> tuple[str, str]:
        """Check the step's argument; return (mode, int8 target: auto | vnni | no-vnni)."""
        if self.targets:
            return self._int8_arg(arg)
        if not arg:
            return "", "auto"
        if not self.args:
            raise UserError(f"step {self.name!r} takes no argument, got {self.name}:{arg}")
        if self.check_arg is not None:
            self.check_arg(arg)
            return "", "auto"
        if arg.lower() not in self.args:
            raise UserError(f"bad argument for {self.name}: {arg!r}; choose {self.name}:"
                            + f" or {self.name}:".join(self.args))
        return arg.lower(), "auto"

    def calibrates(self, mode: str) -> bool:
        """Whether the step, given ``mode``, needs calibration batches."""
        return self.needs_calib(mode) if callable(self.needs_calib) else bool(self.needs_calib)

    def _int8_arg(self, arg: str) -> tuple[str, str]:
        """``int8:pt2e:no-vnni``, ``onnx-int8:vnni`` ...: at most one mode and one target, any order."""
        tokens = [t.strip().lower() for t in arg.split(":")] if arg else []
        modes = [t for t in tokens if t in self.args]
        targets = [t for t in tokens if t in INT8_TARGETS]
        if len(modes) > 1 or len(targets) > 1 or len(modes) + len(targets) != len(tokens):
            raise UserError(f"bad argument for {self.name}: {arg!r}; choose {self.name}:"
                            + f" or {self.name}:".join(self.args)
                            + ", optionally followed by :vnni or :no-vnni (the int8 setting for kernels with or "
                            "without VNNI; default: chosen for this CPU)")
        return (modes[0] if modes else self.args[0]), (targets[0] if targets else "auto")


_STEPS: dict[str, DeployStep] = {}
_ALIASES: dict[str, str] = {}  # another name a step is known by -> its name


def deploy_step(
    name: str,
    *,
    summary: str,
    ids: tuple[str, ...] = (),
    trades: str = "",
    needs: str = "",
    fn: Callable[..., Any] | None = None,
    earlier_name: str = "",
    aliases: tuple[str, ...] = (),
    measured_in: str = "",
    switch_on: str = "",
    available: Callable[[torch.device], tuple[bool, str]] = always,
    **options: Any,
) -> Callable[[Apply], Apply]:
    """Decorator: register ``apply`` as the deploy step ``name`` and its trick; ``apply`` is returned unchanged.

    The trick (kind ``deploy``) is registered under the same name, with ``fn`` (default:
    ``apply``), the function a user calls alone; ``earlier_name`` is the name the trick had
    before it took the step's (an alias of both, like ``aliases``).
    ``options`` are the other :class:`DeployStep` fields (``final``, ``tolerance`` ...).
    """

    def deco(apply: Apply) -> Apply:
        key = name.strip().lower()
        names = [key, *(a.strip().lower() for a in aliases)]
        if earlier_name and earlier_name != key:
            names.append(earlier_name)
        taken = [n for n in names if n in _STEPS or n in _ALIASES]
        if taken:
            raise ValueError(f"deploy step name {taken[0]!r} is registered twice")
        step = DeployStep(key, summary, apply, ids=tuple(ids), aliases=tuple(names[1:]), trick=key, **options)
        register_trick(key, ids=tuple(ids), kind="deploy", trades=trades or summary, needs=needs,
                       measured_in=measured_in, switch_on=switch_on or f"torch-tricks optimize --steps {key}",
                       available=available, aliases=step.aliases)(fn or apply)
        _STEPS[key] = step
        _ALIASES.update({a: key for a in step.aliases})
        return apply

    return deco


def get_step(name: str) -> DeployStep:
    """The step ``name`` (or one of its aliases); a :class:`UserError` listing the steps if unknown."""
    key = name.strip().lower()
    step = _STEPS.get(_ALIASES.get(key, key))
    if step is None:
        raise UserError(f"unknown step {key!r}: choose from {', '.join(s.name for s in registered_steps())}")
    return step


def registered_steps() -> list[DeployStep]:
    """Every step, in the order they usually chain (``order``, then registration)."""
    return sorted(_STEPS.values(), key=lambda s: s.order)


def list_steps() -> dict[str, str]:
    """Step name -> one-line description, in the order they usually chain."""
    return {s.name: s.summary for s in registered_steps()}


def unregister_step(name: str) -> None:
    """Remove the step ``name``, its aliases and its trick (a step registered for a test, say)."""
    step = _STEPS.pop(name)
    for a in step.aliases:
        _ALIASES.pop(a, None)
    unregister_trick(step.trick)


# -- helpers the steps share ------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain_line(exc: BaseException, with_type: bool = True) -> str:
    """:func:`one_line` without the colour codes torch puts in some messages for terminals."""
    return _ANSI.sub("", one_line(exc, 300, with_type=with_type))


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """Silence warnings, log lines and prints from torch's deprecated ao APIs, export and
    inductor around our calls: the library never prints; what matters goes into the report.

    ``torch.export`` prints the partial graph of a failed capture straight to
    ``sys.stderr`` (not through logging), which would bury a one-line error: both streams
    are redirected to a discarded buffer for the duration.
    """
    loggers = _torch_loggers()
    levels = [lg.level for lg in loggers]
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.CRITICAL + 1)
        try:
            yield
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)


def _torch_loggers() -> list[logging.Logger]:
    """The loggers of torch, torchao and every module of theirs that has one."""
    names = ["torch", "torchao"] + [
        n for n in list(logging.Logger.manager.loggerDict) if n.startswith(("torch.", "torchao."))
    ]
    return [logging.getLogger(n) for n in names]


def report_details(rep: Any) -> dict[str, Any]:
    """A step report as :attr:`StepResult.details`: without what the chain measures or holds itself."""
    d = rep.to_dict()
    d.pop("agreement", None)  # measured by optimize itself, against the original
    d.pop("notes", None)
    d.pop("int8_setting", None)  # a field of the step itself
    d.pop("coverage", None)  # likewise
    return d


def json_safe(obj: Any) -> Any:
    """``obj`` as JSON-ready data: str keys, non-finite floats as None, dtypes by name, else ``str``."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    return str(obj)


def batch_rows(args: tuple[Any, ...]) -> int | None:
    """The batch size of positional inputs: dim 0 of the first tensor with one (None without)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
    return None
