"""Measuring one candidate configuration of the training step: time, memory, drift.

Every candidate runs the step ``fit`` would run (:class:`~torch_tricks.train.loop.TrainStep`)
on its own copy of the same initial weights:

* **drift**: the first gradients, and the losses of the first few steps on fixed
  batches, against the plain fp32 run from the same seed, with dropout off: its masks
  depend on how a kernel draws from the generator (CUDA's bf16 and fp32 dropout draw
  differently; accumulation draws per micro-batch), so with dropout on the drift would
  measure the masks rather than the trick (GPT-2 on an H100: bf16's loss drift 11% with
  dropout, 0.5% without);
* **memory**: the peak of live tensor bytes from building the copy through a step and
  one more forward/backward with everything resident (weights, gradients, optimizer
  state, EMA copy, activations): CUDA's ``max_memory_allocated``, elsewhere a dispatch
  mode that counts each *newly allocated* storage once (the CPU allocator has no
  counter, and process RSS cannot separate one configuration from the next). The
  activation memory is what one forward keeps alive for its backward (live bytes
  after forward + loss); the same at half the batch gives bytes per sample, and so the
  largest batch under a memory limit (a straight-line estimate, stated as such);
* **time**: steps timed round-robin against the baseline, a new random order every round
  (see :mod:`torch_tricks.tuning.race`), so drift of the machine hits all alike; compile
  time is the first call, apart.

Switches that are process-wide rather than per model (``deterministic``,
``cudnn_benchmark``, the intra-op ``threads``) are set around every call of a candidate and put back after it,
so one candidate's switch never leaks into another's timings.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from torch_tricks.batches import batch_size, map_tensors
from torch_tricks.data.prefetch import batch_nbytes
from torch_tricks.device import resolve as resolve_device
from torch_tricks.device import synchronize
from torch_tricks.inspect.memory import LiveTensors
from torch_tricks.train.matmul_mode import fp32_matmul
from torch_tricks.train.loop import TrainStep, micro_batches

__all__ = ["Runner", "StepAt", "Memory", "TooSlow", "build_runner", "probe_seconds", "measure_memory", "paired_ratio",
           "relative_diff"]


# -- process-wide switches ---------------------------------------------------------------------

def _global_state() -> tuple[bool, bool, bool, bool]:
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            bool(torch.backends.cudnn.deterministic), bool(torch.backends.cudnn.benchmark))


def _set_global_state(state: tuple[bool, bool, bool, bool]) -> None:
    det, warn_only, cudnn_det, bench = state
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            det, warn_only):  # the setter is slow the first time (it imports inductor): only on change
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.backends.cudnn.deterministic = cudnn_det
    torch.backends.cudnn.benchmark = bench


@contextlib.contextmanager
def switches(config: Any) -> Iterator[None]:
    """The process-wide switches of ``config`` (a dict or TrainConfig) inside, the previous ones after."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    before, threads = _global_state(), torch.get_num_threads()
    det = bool(get("deterministic", False))
    bench = bool(get("cudnn_benchmark", False)) and not det
    _set_global_state((det, False, det, bench))
    want = int(get("threads", 0) or 0)  # intra-op threads: each lane's own, set around each of its calls
    if want and want != threads:
        torch.set_num_threads(want)
    dev = str(get("device", "cpu") or "cpu")
    # the fp32 matmul mode: each lane's own, the process's back after (a build under Tricks sets it too)
    with fp32_matmul(str(get("fp32_matmul", "") or ""), "cuda" if dev.startswith("cuda") else "cpu"):
        try:
            yield
        finally:
            _set_global_state(before)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[bool]:
    """Every dropout layer of ``model`` at ``p = 0`` inside (yields whether any was on), as before after.

    Setting ``p`` rather than ``eval()`` reaches the attention dropout that transformers
    models pass to ``scaled_dot_product_attention`` from their dropout layer's ``p``.
    """
    layers = [m for m in model.modules() if isinstance(m, _DROPOUTS) and m.p > 0]
    before = [m.p for m in layers]
    for m in layers:
        m.p = 0.0
    try:
        yield bool(layers)
    finally:
        for m, p in zip(layers, before):
            m.p = p


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


# -- runners -----------------------------------------------------------------------------------

@dataclass
class Runner:
    """A candidate's live training step, and what was measured of it so far."""

    name: str
    step: TrainStep
    batches: list[Any]
    first_call_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None
    step_times: list[float] = field(default_factory=list)  # of the drift steps (a first estimate only)
    probe_s: float | None = None  # one forward/backward on an eighth of the batch, before anything else
    error: str | None = None  # set when a timed step raised: the runner is out
    _i: int = 0

    def __call__(self) -> torch.Tensor:
        batch = self.batches[self._i % len(self.batches)]
        self._i += 1
        with switches(self.step.config):
            return self.step(batch)


class StepAt:
    """``step`` at another intra-op thread count (``config.threads``, which :func:`switches` sets around each
    call): the same model and optimizer, so a thread count is timed as a lane of its own without a copy."""

    def __init__(self, step: TrainStep, threads: int) -> None:
        self._step = step
        self.config = step.config.replace(threads=threads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def __call__(self, batch: Any) -> torch.Tensor:
        return self._step(batch)


class TooSlow(Exception):
    """A candidate's probe step (or first full step) took longer than the limit: not worth measuring further."""

    def __init__(self, seconds: float, limit_s: float, what: str = "probe") -> None:
        super().__init__(f"its {what} step took {seconds:.3g} s, over the limit of {limit_s:.3g} s")
        self.seconds, self.limit_s, self.what = seconds, limit_s, what


def build_runner(
    name: str,
    model: nn.Module,
    config: dict[str, Any],
    batches: list[Any],
    *,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None,
    drift_steps: int = 3,
    probe: bool = True,
    probe_limit_s: float | None = None,
    first_limit_s: float | None = None,
) -> Runner:
    """A runner on a copy of ``model`` under ``config``, with its drift figures measured.

    With ``probe``, a forward/backward on an eighth of the first batch comes first
    (timed as ``probe_s``; buffers such as BatchNorm statistics and the random state
    are put back after it, so probed and unprobed runners compare); past ``probe_limit_s`` it raises
    :class:`TooSlow` before the full-batch work (an emulated fp16 step on a CPU can
    take 100 times the fp32 one), and so does a first full-batch call past
    ``first_limit_s`` (a probe batch can be too small to show it), unless a second full-batch call is
    within it (the first carries one-time costs). Then the first call (which includes
    ``torch.compile``'s compilation when on) is timed apart as ``first_call_s``:
    gradients of the first batch, then ``drift_steps`` steps.
    """
    with switches(config):
        step = TrainStep(copy.deepcopy(model), loss_fn=loss_fn, optimizer=optimizer_fn, config=config)
        r = Runner(name, step, batches)
        dev = step.device
        if probe:
            r.probe_s = _probe_within(step, batches[0], probe_limit_s)
        calibrate_grad_scaler(step, batches[0])
        with dropout_off(step.model) as had_dropout:
            t0 = time.perf_counter()
            r.grads = step.gradients(batches[0])
            synchronize(dev)
            r.first_call_s = time.perf_counter() - t0
            if first_limit_s is not None and r.first_call_s > first_limit_s:
                # a first call carries one-time costs that a slow trick's steady step does not (on an H200
                # GPT-2's first bf16 step took 13x the plain one, and the tune called bf16 slower unmeasured:
                # cuBLAS's kernel choice for new shapes and dtypes, the allocator growing): a second one decides
                second = probe_seconds(step, batches[0], fraction=1)
                _check_within(min(r.first_call_s, second), first_limit_s, "first")
            for i in range(drift_steps):
                t0 = time.perf_counter()
                r.losses.append(float(step(batches[i % len(batches)])))  # float() waits for the device
                r.step_times.append(time.perf_counter() - t0)
        if had_dropout and step.config.compile:
            step(batches[0])  # the recompilation for dropout back on, here and not in the timed race
    return r


def _probe_within(step: TrainStep, batch: Any, limit_s: float | None) -> float:
    """The probe step's seconds; past ``limit_s`` (after a second try: not a hiccup of the machine?) TooSlow."""
    probe_s = probe_seconds(step, batch)
    if limit_s is not None and probe_s > limit_s:
        probe_s = min(probe_s, probe_seconds(step, batch, repeats=2))
        _check_within(probe_s, limit_s, "probe")
    return probe_s


def _check_within(seconds: float, limit_s: float | None, what: str) -> None:
    """:class:`TooSlow` where ``seconds`` is over ``limit_s`` (None: no limit)."""
    if limit_s is not None and seconds > limit_s:
        raise TooSlow(seconds, limit_s, what)


def calibrate_grad_scaler(step: TrainStep, batch: Any, tries: int = 24) -> int:
    """Halve an fp16 grad scaler's scale until ``batch`` gives finite gradients; returns the halvings.

    ``fit``'s scaler starts at 2**16 and skips the steps that overflow while it halves
    its way down: a few skipped steps at the start of a run, which say nothing about
    the steady state but would make the drift steps compare a run that skipped updates
    with one that did not. Buffers and the random state are put back, as for a probe.
    A no-op without an enabled scaler.
    """
    scaler = step.scaler
    if not scaler.is_enabled():
        return 0
    halvings = 0
    with _put_back(step.model), switches(step.config):
        for _ in range(tries):
            grads = step.gradients(batch)
            if all(bool(torch.isfinite(g).all()) for g in grads):
                break
            scaler.update(float(scaler.get_scale()) / 2)
            halvings += 1
    return halvings


def probe_seconds(step: TrainStep, batch: Any, repeats: int = 1, fraction: int = 8) -> float:
    """Fastest of ``repeats`` forward/backward passes of ``step`` on ``1/fraction`` of ``batch``.

    Buffers (BatchNorm statistics ...) and the random state are put back afterwards, so
    the probe leaves no trace in what is measured next.
    """
    n = _batch_len(batch)
    small = _slice(batch, max(n // fraction, min(n, 2)))  # 2 at least: BatchNorm cannot train on 1 sample at 1x1
    best = math.inf
    with _put_back(step.model), switches(step.config):
        for _ in range(repeats):
            t0 = time.perf_counter()
            step.gradients(small)
            synchronize(step.device)
            best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def _put_back(model: nn.Module) -> Iterator[None]:
    """The model's buffers (BatchNorm statistics ...) and the random state as they were, on leaving (not
    after an error: the caller then drops the model)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    yield
    with torch.no_grad():
        for b, old in buffers:
            b.copy_(old)
    torch.random.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


# -- memory ------------------------------------------------------------------------------------

@dataclass
class Memory:
    """Tensor bytes of one configuration."""

    peak_bytes: int  # build + two steps at the batch (the second with optimizer state), plus the batch itself
    state_bytes: int  # live between steps: weights, optimizer state, EMA copy ...
    activation_bytes: int | None  # kept alive by one forward (one micro-batch) for its backward
    bytes_per_sample: float | None  # slope of the memory a step needs in the batch (see measure_memory)
    micro_batch: int  # samples per forward: the batch / accumulate


def measure_memory(
    model: nn.Module,
    config: dict[str, Any],
    batch: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None,
    per_sample: bool = True,
) -> Memory:
    """Peak tensor bytes of building a copy of ``model`` under ``config`` and training on ``batch``.

    Inside one measurement: the copy, the optimizer, a first step (which creates the
    optimizer state), then a second step with everything resident. Then, apart: the
    activation memory of one forward at the batch and at half of it, and the peak of
    one step at each. Bytes per sample is the larger of the two slopes (activations,
    step peak) between the batch and half of it, per sample of a forward (of a
    micro-batch under accumulation).
    """
    gc.collect()
    dev = resolve_device(config.get("device", "cpu"))
    extra = batch_nbytes(batch)
    k = max(int(config.get("accumulate", 1)), 1)
    n = _batch_len(batch)
    with switches(config):
        with _Peak(dev) as whole:
            step = TrainStep(copy.deepcopy(model), loss_fn=loss_fn, optimizer=optimizer_fn, config=config)
            step(batch)
            state = whole.live()
            first_peak = whole.reset_peak()
            step(batch)  # now with the optimizer state resident
            step_full = whole.peak_now() - state  # what the step itself adds at the batch
        peak = max(first_peak, whole.peak)
        act_full = _activation_bytes(step, batch)
        slope = None
        micro = _batch_len(micro_batches(batch, k)[0])
        if per_sample and n >= 2 * k:
            half = _slice(batch, n // 2)
            micro_half = _batch_len(micro_batches(half, k)[0])
            with _Peak(dev) as step_half:
                step(half)
            act_half = _activation_bytes(step, half)
            if micro > micro_half:
                slopes = [(step_full - step_half.peak) / (micro - micro_half)]
                if act_full is not None and act_half is not None:
                    slopes.append((act_full - act_half) / (micro - micro_half))
                slope = max(max(slopes), 1.0)
        del step
    gc.collect()
    return Memory(peak + extra, state, act_full, slope, micro)


def _activation_bytes(step: TrainStep, batch: Any) -> int | None:
    """Live tensor bytes one forward + loss leaves for backward (the first micro-batch of ``batch``)."""
    if step.config.compile:
        return None  # a compiled graph plans its own buffers; measured eagerly elsewhere
    with _Peak(step.device) as p:  # the very forward fit runs (autocast, channels_last input, checkpointed blocks)
        out, loss = step.forward_loss(batch)
        live = p.live()
        del out, loss
    return max(live, 0)


class _Peak:
    """Peak and live bytes allocated in a region: CUDA's counters, else :class:`LiveTensors`."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.peak = 0

    def __enter__(self) -> "_Peak":
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.reset_peak_memory_stats(self.dev)
            self._base = torch.cuda.memory_allocated(self.dev)
        else:
            self._live = LiveTensors()
            self._live.__enter__()
        return self

    def peak_now(self) -> int:
        """The peak so far (since the start, or the last :meth:`reset_peak`)."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            return torch.cuda.max_memory_allocated(self.dev) - self._base
        return self._live.peak_bytes

    def reset_peak(self) -> int:
        """Return the peak so far and restart it from what is live now."""
        peak = self.peak_now()
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dev)
        else:
            self._live.peak_bytes = self._live.live_bytes
        return peak

    def live(self) -> int:
        """Bytes allocated in the region and still live now."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            return torch.cuda.memory_allocated(self.dev) - self._base
        return self._live.live_bytes

    def __exit__(self, *exc: Any) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            self.peak = torch.cuda.max_memory_allocated(self.dev) - self._base
        else:
            self._live.__exit__(*exc)
            self.peak = self._live.peak_bytes


# -- time --------------------------------------------------------------------------------------

def paired_ratio(times: list[float], base: list[float]) -> tuple[float, float]:
    """Median of per-round time ratios to the baseline, and the half-width of its ~95% interval.

    Pairing by round cancels slow drift of the machine that hits both alike. The
    interval is the distribution-free one of a median (order statistics
    ``n/2 -+ 0.98 sqrt(n)``); with fewer than 6 rounds it is the whole range.
    """
    n = min(len(times), len(base))
    ratios = sorted(t / b for t, b in zip(times[:n], base[:n]) if b > 0)
    if not ratios:
        return math.nan, math.nan
    m = len(ratios)
    k = max(int(math.floor((m - 1.96 * math.sqrt(m)) / 2)), 0)
    return statistics.median(ratios), (ratios[m - 1 - k] - ratios[k]) / 2


def relative_diff(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> float | None:
    """``||a - b|| / ||b||`` over all tensors; ``None`` if the parameter lists do not line up."""
    if not _line_up(a, b):
        return None
    num = math.sqrt(sum(float((x.float() - y.float()).pow(2).sum()) for x, y in zip(a, b)))
    den = math.sqrt(sum(float(y.float().pow(2).sum()) for y in b))
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def _line_up(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    """Both lists are there, as long as each other, with the same shapes in the same places."""
    return a is not None and b is not None and len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))


# -- helpers -----------------------------------------------------------------------------------

def _batch_len(batch: Any) -> int:
    return batch_size(batch)


def _slice(batch: Any, n: int) -> Any:
    return map_tensors(batch, lambda t: t[:n] if t.dim() > 0 else t)
