"""``tune``: measure every applicable trick on the user's model and hardware, then recommend.

The plan, inside ``budget_s``:

1. the plain fp32 baseline (a model that cannot run the input stops here, with one
   line), and a second, identical baseline: the A/A pair whose disagreement is the
   stated noise;
2. for each candidate trick (see :mod:`torch_tricks.tuning.candidates`): drift against
   fp32 from the same seed, and memory (peak, activations, bytes per sample);
3. the race (:mod:`torch_tricks.tuning.race`): all candidates' steps and both baselines
   timed round-robin, a new random order every round. A candidate leaves once its
   question is answered (it cannot be ``MIN_EFFECT`` faster than plain; it is faster
   and slower than the best beyond their interval; a memory or cost trick, timed for
   its cost only, after the least rounds); the contenders and both baselines get the
   rounds, so the intervals and the noise narrow. The race stops when settled, or at
   its share of the budget (what the combinations and compile need is kept back);
4. greedy combinations for throughput: the fastest trick that fits the memory limit,
   plus the next one while the pair beats the current best beyond the noise, each
   raced against it side by side until that is settled or its share is spent. If the
   plain step does not fit the memory limit: first the single tricks that fit, else the
   memory tricks together, then with micro-batches (accumulation), until one fits;
5. the largest batch: all memory tricks that cut bytes per sample, together; its largest batch
   under the limit (and plain's) then *run*: a search on tiled batches, each a build and two
   steps with the peak measured (a straight line through two batch sizes only says where to
   start: attention and logits grow faster than linearly in a sequence);
6. ``compile`` on top of the best configuration (one compilation), raced against it,
   if the budget has room for it (also when it was not planned at the start, if the
   races settled early and saved the time);
7. what is left of the training budget goes to the races still open (more rounds), and
   every decision is taken again with the final rounds; ``report.stop_reason`` says
   whether the tune stopped settled or for the budget, and what was still open;
8. with ``data``, the loader; with ``deploy``, the inference chain (fixed shares).

A trick that fails (while checking, building, or in the middle of timing) is recorded
as failed with its reason, and the tune goes on. Nothing is printed; the progress bar
goes to stderr.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import re
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from torch_tricks import batches as B
from torch_tricks._format import human_bytes
from torch_tricks._gc import new_objects_only
from torch_tricks.batches import example_batch  # the CLI's way in, re-exported
from torch_tricks.data.loader_tune import tune_loader_path
from torch_tricks.device import resolve as resolve_device
from torch_tricks.device import is_oom, synchronize
from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.peak import cached_peak, device_peak
from torch_tricks.outputs import get_loss
from torch_tricks.registry import get_trick
from torch_tricks.seed import seed_everything
from torch_tricks.train.config import TrainConfig
from torch_tricks.train.distributed import cleanup, init_distributed
from torch_tricks.tuning import distributed as D
from torch_tricks.tuning import fit as fit_mod
from torch_tricks.tuning.candidates import Candidate, training_candidates
from torch_tricks.tuning.efficiency import efficiency, step_cost
from torch_tricks.tuning.measure import (
    Runner,
    TooSlow,
    build_runner,
    measure_memory,
    paired_ratio,
    probe_seconds,
    relative_diff,
)
from torch_tricks.tuning.race import Lane, Race, margin
from torch_tricks.tuning.report import TUNED_KEYS, Result, TuneReport

__all__ = ["tune", "example_batch", "parse_size", "TUNED_KEYS", "DRIFT_TOLERANCE", "MIN_EFFECT", "ASSUMED_RUN_STEPS"]

# Drift decides on the losses only: after the drift steps, the largest difference from the fp32
# losses of the same seed, relative to the first fp32 loss. Past this a trick changes the
# numbers too much to recommend it for speed (it catches broken numerics: overflow, a wrong
# accumulation; a non-finite loss always drifts). The first-step gradient difference is
# reported but does not decide: at initialisation a deep net's early-layer gradients are
# chaotic (ResNet-50, random batch: bf16 autocast alone gives a relative difference of 1.3,
# cosine 0.13, while its losses after 3 steps stay within 0.5% of the first fp32 loss).
DRIFT_TOLERANCE = {"loss": 0.05}
# With several processes (--processes N, or under torchrun) the distributed rows get this share of the budget.
DIST_SHARE = 0.4
# Effects smaller than this are not called faster/slower even when the A/A noise is smaller.
MIN_EFFECT = 0.02
# The run a one-off cost must pay back within, when the caller does not say (tune(steps=N)): compile is
# recommended only if its first call's extra seconds over what it extends, divided by the seconds it saves
# a step, is at most this (the break-even step count, stated in the report either way).
ASSUMED_RUN_STEPS = 10_000
# A candidate whose probe step (an eighth of the batch) takes this many times the plain one is
# reported slower from the probe and not measured further (emulated fp16 on a CPU: ~100x).
SLOW_FACTOR = 10.0
# The race (see torch_tricks.tuning.race): every runner gets at least _MIN_ROUNDS rounds; the race of the
# single tricks is called settled after _SETTLE_ROUNDS at the earliest, and once the stated noise (which
# comes from its rounds) is itself known to ±MIN_EFFECT/4, so that it is never the loose term of a call;
# a side-by-side race after _SIDE_SETTLE_ROUNDS; no race runs more than its cap, a safety net for models
# whose steps take milliseconds.
_MIN_ROUNDS = 5
_SETTLE_ROUNDS = 30
_SIDE_SETTLE_ROUNDS = 12
_MAX_ROUNDS = 150
_MEMORY_RUN_MARGIN = 1.5  # a combination's memory run, in plain's memory runs (more switches, a little more)
_FIT_COMBO_TRIES = 3  # combinations of peak cutters measured for a faster fit under the limit
# MFU (issue 22): counting a step's FLOPs costs a few plain steps (the counter sees every operator); a machine's
# first peak measurement (square matmuls up to 4096 in each dtype) some seconds, once
_COUNT_STEPS = 4
_PEAK_MEASURE_S = 8.0
_EFFICIENCY_SHARE = 0.15  # the most of the budget they may take
# The search for the largest batch under the memory limit (per configuration searched: the largest-batch one and plain).
_BATCH_PROBES = 6
_BATCH_SEARCH_SHARE = 0.25
_MAX_SIDE_ROUNDS = 100


def tune(
    model_fn: Callable[[], nn.Module] | nn.Module,
    example_batch: tuple[Any, Any],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None = None,
    *,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    device: str | torch.device = "cpu",
    budget_s: float = 120.0,
    memory_limit: int | None = None,
    data: str | None = None,
    deploy: bool = False,
    seed: int = 0,
    progress: bool = True,
    name: str = "",
    skip: Sequence[str] = (),
    processes: int | None = None,
    steps: int | None = None,
    fit: str | None = None,
    _channel: Any = None,
) -> TuneReport:
    """Measure the training tricks on ``model_fn()`` with ``example_batch``, one batch of fit's.

    ``example_batch``: ``(inputs, target)`` with ``inputs`` a tensor, a tuple of positional
    inputs or a dict of keyword inputs, batch first; or a transformers-style dict with
    ``labels`` (see :mod:`torch_tricks.batches`; :func:`example_batch` makes one from inputs).
    ``loss_fn(output, target)`` must return the mean loss of the batch (default
    cross-entropy); ``optimizer_fn(params)`` builds the optimizer (default: the
    ``optimizer`` by name with ``fit``'s no-decay groups). ``memory_limit`` in bytes
    (default: CUDA's total memory, or 80% of the RAM available now). ``data``: a
    dataset path for the loader measurement; ``deploy``: also measure the inference
    chain. ``skip``: trick names to leave out. Returns a :class:`TuneReport`; nothing
    is printed (the progress bar goes to stderr; ``progress=False`` hides it).

    ``processes=N`` (N >= 2) also measures ``ddp``, ``zero1`` and ``fsdp`` on N ranks that
    the tune launches itself (torchrun's engine, on this machine), with ``example_batch``
    as the global batch (N must divide it): see :mod:`torch_tricks.tuning.distributed`.
    Called on every rank under ``torchrun``, the tune does the same on the ranks it was
    given: rank 0 measures the single-process tricks while the others wait, then every
    rank times the modes; every rank returns the same report. The model and functions
    must pickle for ``processes`` (spawned ranks); under torchrun rank 0's are sent.

    ``steps``: the optimizer steps of the training run the recommendation is for
    (default: ``ASSUMED_RUN_STEPS``, said so in the report). A trick with a one-off cost
    (``compile``: its first call) is recommended only where it pays back within them;
    every row's verdict says why it is or is not recommended (:meth:`TuneReport.explain`).
    """
    t_start = time.perf_counter()
    _check_budget_and_steps(budget_s, steps)
    dev = resolve_device(device)
    parts = B.unpack(example_batch)  # a UserError for what is not a batch
    _check_skip_and_data(skip, data)
    fit_t = fit_mod.parse_fit(fit)
    seed_everything(seed)
    model = _build_model(model_fn)
    if fit_t is not None:  # tuned at the target's batch or sequence length
        example_batch = fit_mod.apply_fit(fit_t, example_batch, model)
        parts = B.unpack(example_batch)
    inputs_t = parts.inputs
    batch = B.batch_size(example_batch)
    world, dist_world = _worlds(processes, batch, dev)
    if world > 1 and _channel is None:
        return _tune_on_ranks(model, example_batch, loss_fn, optimizer_fn, dict(
            optimizer=optimizer, lr=lr, device=device, budget_s=budget_s, memory_limit=memory_limit, data=data,
            deploy=deploy, seed=seed, progress=progress, name=name, skip=skip, steps=steps), budget_s)
    limit, limit_source = _memory_limit(memory_limit, dev)
    if fit_t is not None and fit_t.search_seq and limit_source != "given" and dev.type != "cuda":
        raise UserError("--fit seq searches the longest sequence under --memory-limit: give one (on a CPU the "
                        "host's RAM is no limit to search against: each run there is large and slow)")
    base_cfg = {"optimizer": optimizer, "lr": lr, "fused_optimizer": False, "device": str(dev), "seed": seed,
                "batch_size": batch}
    own_opt = optimizer_fn is not None
    report = TuneReport(model=name or type(model).__name__, batch=batch, device=str(dev),
                        optimizer="your optimizer_fn" if own_opt else optimizer, own_optimizer=own_opt,
                        memory_limit=limit, memory_limit_source=limit_source, budget_s=float(budget_s),
                        drift_tolerance=dict(DRIFT_TOLERANCE), min_effect=MIN_EFFECT,
                        inputs=_input_shapes(inputs_t),
                        run_steps=steps or ASSUMED_RUN_STEPS, run_steps_source="given" if steps else "assumed")
    batches = [B.to_device(example_batch, dev)]
    kw = {"loss_fn": loss_fn, "optimizer_fn": optimizer_fn}
    labels_in = B.labels_go_in(model, example_batch, loss_fn or get_loss("auto"))  # as TrainStep's default loss
    cands, skipped = training_candidates(model, inputs_t, dev, batch=batch, own_optimizer=optimizer_fn is not None,
                                         skip=skip, labels_in_forward=labels_in, optimizer=optimizer)
    report.skipped = skipped

    from tqdm.auto import tqdm

    total = 4 + len(cands) + bool(data) + bool(deploy) + bool(dist_world)
    bar = tqdm(total=total, desc="tune", unit="phase", disable=not progress, leave=False)
    with new_objects_only():  # the collections around every memory measurement skip the caller's objects
        _run_job(_Tune(model, batches, base_cfg, kw, limit, report, bar, t_start, float(budget_s), bool(data),
                       bool(deploy), dist_world=dist_world, channel=_channel, fit=fit_t), cands, data)
    report.elapsed_s = time.perf_counter() - t_start
    report.explain()  # every row's reason (the views take it again from the figures)
    return report


def _input_shapes(inputs: tuple[Any, ...]) -> list[list[int]]:
    """The shape of each tensor input, without its batch dimension."""
    return [list(t.shape[1:]) for t in inputs if isinstance(t, torch.Tensor)]


def _check_budget_and_steps(budget_s: float, steps: int | None) -> None:
    if not budget_s or budget_s <= 0:
        raise UserError("--budget-seconds must be > 0")
    if steps is not None and not _is_count(steps):
        raise UserError(f"steps (the training run's length in optimizer steps) must be a whole number >= 1, "
                        f"not {steps!r}")


def _is_count(n: Any) -> bool:
    """A whole number >= 1 (not a bool)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _check_skip_and_data(skip: Sequence[str], data: str | None) -> None:
    """An unknown trick name to skip, or a data path that is not there: a UserError before anything is measured."""
    for name_ in skip:
        get_trick(name_.split(":")[0])  # an unknown name is a UserError listing the tricks
    if data is not None and not Path(data).exists():
        raise UserError(f"no data set at {str(data)!r} (--data takes a pack, an ImageFolder tree or an HDF5 file)")


def _build_model(model_fn: Callable[[], nn.Module] | nn.Module) -> nn.Module:
    """A copy of the given module, or what ``model_fn()`` builds; what goes wrong is one UserError line."""
    if isinstance(model_fn, nn.Module):
        return copy.deepcopy(model_fn)
    try:
        model = model_fn()
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"building the model raised {one_line(exc, with_type=True)}") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"model_fn returned {type(model).__name__}, not an nn.Module")
    return model


def _worlds(processes: int | None, batch: int, dev: torch.device) -> tuple[int, int]:
    """(the world torchrun launched this process in, the ranks of the distributed rows: 0 for none), checked."""
    world = D.launched_world()
    if processes is not None and world > 1:
        raise UserError("--processes launches the ranks itself: run the tune without torchrun, or drop --processes")
    dist_world = world if world > 1 else (processes or 0)
    if processes is not None or world > 1:
        D.check_world(dist_world, batch, dev)
    return world, dist_world


def _run_job(job: _Tune, cands: list[Candidate], data: str | None) -> None:
    """The job's plan with torch's warnings kept off the table; the progress bar is closed whatever happens."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch/inductor chatter would break the report's table
            job.run(cands, data)
    finally:
        job.bar.close()
    if job.dist_world and job.report.distributed is None:
        job.report.distributed = {"status": "skipped", "processes": job.dist_world, "rows": [], "reason":
                                  "the tune stopped before the distributed rows (over --budget-seconds): raise it"}


def _tune_on_ranks(model, example_batch, loss_fn, optimizer_fn, kwargs: dict[str, Any], budget_s: float
                   ) -> TuneReport:
    """``tune`` on every rank under torchrun: rank 0 runs the tune (the single-process part on all the
    host's cores while the others wait), the ranks measure the modes together, every rank gets the report."""
    import torch.distributed as dist

    created = not (dist.is_available() and dist.is_initialized())
    # the others wait while rank 0 measures alone: the collectives' timeout must outlast the whole tune
    info = init_distributed(timeout=max(1800.0, 3 * float(budget_s) + 600.0), device=kwargs["device"])
    try:
        if info.rank == 0:
            return _tune_on_rank_0(model, example_batch, loss_fn, optimizer_fn, kwargs)
        return _follow_rank_0()
    finally:
        if created:
            cleanup()


def _tune_on_rank_0(model, example_batch, loss_fn, optimizer_fn, kwargs: dict[str, Any]) -> TuneReport:
    """Rank 0: the tune on all the host's cores, the distributed job sent to the others when it comes; the
    report (None where the tune raised) to every rank."""
    import torch.distributed as dist

    channel = _RankChannel(threads=torch.get_num_threads())  # the launcher's: the ranks' threads
    report: Any = None
    try:
        cpu = torch.device(kwargs["device"]).type == "cpu"
        with D._threads(D.usable_cores() if cpu else None):  # torchrun gave each rank 1 thread
            report = tune(model, example_batch, loss_fn, optimizer_fn, **kwargs, _channel=channel)
    finally:
        channel.send(None)  # a no-op once the job was sent; else the others stop waiting for one
        dist.broadcast_object_list([report], src=0)
    return report


def _follow_rank_0() -> TuneReport:
    """The other ranks: wait for rank 0's job, measure the modes with it, then take rank 0's report."""
    import torch.distributed as dist

    got: list[Any] = [None]
    dist.broadcast_object_list(got, src=0)  # the job, once rank 0 has measured alone
    if got[0] is not None:
        D.measure_modes(got[0])
    got = [None]
    dist.broadcast_object_list(got, src=0)
    if got[0] is None:
        raise UserError("rank 0's tune stopped: its error is in rank 0's output")
    return got[0]


class _RankChannel:
    """Rank 0's side under torchrun: sends the distributed job to the waiting ranks once (None: none)."""

    def __init__(self, threads: int | None = None) -> None:
        self.sent = False
        self.threads = threads

    def send(self, job: Any) -> None:
        if self.sent:
            return
        import torch.distributed as dist

        self.sent = True
        dist.broadcast_object_list([job], src=0)


class _Tune:
    """One tune's state: the runners, the deadlines of its phases, the report it fills."""

    def __init__(self, model, batches, base_cfg, kw, limit, report: TuneReport, bar, t0: float, budget: float,
                 data: bool, deploy: bool, dist_world: int = 0, channel: Any = None,
                 fit: fit_mod.FitTarget | None = None) -> None:
        self.model, self.batches, self.base_cfg, self.kw = model, batches, base_cfg, kw
        self.fit = fit
        self.limit, self.report, self.bar = limit, report, bar
        self.deadline = t0 + budget
        # the distributed rows, data and deploy get fixed shares of the budget; training gets the rest
        self.dist_world, self.channel = dist_world, channel
        self.dist_share = DIST_SHARE * budget if dist_world else 0.0
        self.data_share = 0.15 * budget if data else 0.0
        self.train_end = self.deadline - self.dist_share - self.data_share - (0.25 * budget if deploy else 0.0)
        self.deploy_start_share = 0.25 * budget if deploy else 0.0
        self.t0 = t0
        self.phase_s: dict[str, float] = {}  # wall seconds per phase (report.phase_s)
        self.singles: Race | None = None  # the race of the single tricks with both baselines
        self.singles_res: list[Result] = []  # its candidates, in lane order (lanes[2:])
        self.side: dict[int, tuple[Race, Result | None]] = {}  # id(result) -> its side-by-side race, what it extends
        self.choice_notes: list[str] = []  # notes of the decisions (taken again after more rounds)
        self._combos: dict[Any, Result] = {}  # timed combinations, by (changes, what they extend)
        self._fit_tries: dict[Any, Result] = {}  # configurations measured while looking for one that fits
        self.compile_target: Result | None = None  # what compile was measured as (on top of compile_base)
        self.compile_base: Result | None = None
        self.compile_row: Result | None = None
        self.compile_skip_reason = ""
        self.memory_s = 0.0  # what plain's memory run at the example batch took (the largest-batch search's unit)
        self.memory_reserve = 0.0  # kept back from the race and the combinations for the memory tricks together
        self.efficiency_reserve = 0.0  # kept back for the MFU figures (0: not measured, the report says why)

    def _setup_candidate(self, res: Result, c: Candidate, setup_end: float, retry: bool = True) -> None:
        """Drift and memory of one candidate, unless its probe step says it is far too slow (or too slow for the budget)."""
        cfg = {**self.base_cfg, **c.changes}
        base_probe = self.base.probe_s
        by_speed = SLOW_FACTOR * base_probe
        # the baseline's set-up took setup_s; a candidate takes about that times its probe ratio
        by_budget = base_probe * max(setup_end - time.perf_counter(), 0.0) / max(self.setup_s, 1e-6)
        try:
            r = build_runner(c.name, self.model, cfg, self.batches, probe_limit_s=max(min(by_speed, by_budget), 1e-3),
                             first_limit_s=SLOW_FACTOR * self.base.first_call_s, **self.kw)
        except TooSlow as exc:
            base_now, what = self._plain_now(exc.what)
            ratio = exc.seconds / base_now
            took = f"{what} took {exc.seconds:.2g} s"
            if ratio >= SLOW_FACTOR:
                res.probe_ratio = ratio
                res.status, res.verdict = "measured (probe)", "slower"
                res.reason = f"{took}, {ratio:.0f}x the plain one: not measured further"
            elif (exc.what == "probe" and exc.limit_s < by_speed) or not retry:
                res.status, res.verdict = "skipped", "skipped"
                res.reason = f"over --budget-seconds: {took}, too long to set it up in the time left; raise it"
            else:  # the machine was busy during the first probe
                self._setup_candidate(res, c, setup_end, retry=False)
            return
        _drift_into(res, r, self.base)
        self._memory_into(res, cfg)
        res.runner = r

    def _plain_now(self, what: str) -> tuple[float, str]:
        """The plain step's seconds for what a candidate was too slow at (``what``: its "probe" or its "first"
        step), taken again now, under the same load of the machine; and what that step was, in words."""
        batch = self.report.batch
        if what == "probe":
            return (min(self.base.probe_s, probe_seconds(self.base.step, self.batches[0], repeats=2)),
                    f"a probe step on {max(batch // 8, min(batch, 2))} samples")
        return (min(self.base.first_call_s, probe_seconds(self.base.step, self.batches[0], fraction=1)),
                f"its first step on the batch of {batch}")

    def left(self, until: float | None = None) -> float:
        return (self.train_end if until is None else until) - time.perf_counter()

    def phase(self, label: str) -> None:
        self.bar.set_postfix_str(label, refresh=True)

    # -- the plan ----------------------------------------------------------------------------
    def run(self, cands: list[Candidate], data: str | None) -> None:
        """The plan (see the module's docstring): the baselines, each candidate's drift and memory, the race,
        the combinations and the largest batch, compile, more rounds, then the distributed rows, data and deploy."""
        if not self._baselines(cands):
            return
        self._reserve_efficiency()
        compile_res, others = self._plan_compile(cands)
        results = self._set_up_candidates(others)
        if compile_res is not None:
            results.append(compile_res)
        self.report.results = results
        self._race_singles(results)
        self._combinations()
        if compile_res is not None:
            self._compile_phase(compile_res)
        self._more_rounds_phase()
        self._close_training(results)
        self._efficiency_phase()
        self._other_phases(data)
        self.report.phase_s = {k: round(v, 2) for k, v in self.phase_s.items()}

    def _baselines(self, cands: list[Candidate]) -> bool:
        """1. the plain step and its A/A twin, with the plain step's memory; False when the budget cannot
        hold even one trick's measurement (the report then says so, see :meth:`_too_slow_for_the_budget`)."""
        report = self.report
        self.phase("baseline")
        t_base = time.perf_counter()
        base = self._build_plain()
        self.base = base
        base_res = Result("plain", "baseline", {}, (), status="measured", verdict="baseline")
        base_res.first_call_s, base_res.losses = base.first_call_s, base.losses
        if self._too_slow_for_the_budget(base, time.perf_counter() - t_base, base_res, cands):
            return False
        # what one candidate's drift + memory costs, roughly: timed after the first build, which
        # pays one-off costs (imports, kernel caches) that later builds do not
        t0 = time.perf_counter()
        twin = build_runner("plain (A/A)", self.model, self.base_cfg, self.batches, **self.kw)
        report.aa_grad_drift = relative_diff(twin.grads, base.grads)  # run-to-run differences of plain itself
        report.aa_loss_drift = _loss_drift(twin.losses, base.losses)
        twin.grads = None
        t_mem = time.perf_counter()
        self._memory_into(base_res, self.base_cfg)
        self.memory_s = time.perf_counter() - t_mem  # one memory run: a copy's build and its steps
        self.setup_s = time.perf_counter() - t0
        report.baseline = base_res
        self.base, self.twin = base, twin
        self.step_s = max(_median(base.step_times) if base.step_times else 0.0, 1e-4)
        self.bar.update(1)
        return True

    def _build_plain(self) -> Runner:
        """The plain fp32 step's runner; a UserError where the model cannot train on the input, or its loss
        is not finite."""
        model = self.report.model
        try:
            base = build_runner("plain", self.model, self.base_cfg, self.batches, **self.kw)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{model} cannot run a training step on the given input: {one_line(exc, with_type=True)}") from None
        if not all(math.isfinite(x) for x in base.losses):
            raise UserError(f"{model}: the plain fp32 loss is not finite on the given batch ({base.losses})")
        return base

    def _plan_compile(self, cands: list[Candidate]) -> tuple[Result | None, list[Candidate]]:
        """(compile's row or None, the other candidates, speed first): compile is planned, with the time it
        needs kept back, only if the budget holds it after the others; else it is tried at the end if the
        races settle early (:meth:`_compile_phase`)."""
        compile_cand = next((c for c in cands if c.changes.get("compile")), None)
        order = {"speed": 0, "memory": 1, "cost": 2}  # what a short budget leaves out last
        others = sorted((c for c in cands if c is not compile_cand), key=lambda c: order.get(c.goal, 3))
        self.compile_reserve = 0.0
        self.compile_planned = False
        if compile_cand is None:
            return None, others
        compile_res = Result(compile_cand.name, compile_cand.goal, compile_cand.changes, compile_cand.ids,
                             note=compile_cand.note)
        est = self.compile_est = _compile_estimate(self.model, self.step_s)
        self.compile_need = est + self._race_need(3, _MIN_ROUNDS + 3)  # its compilation, then a short race
        # the others first: their set-up, the least race worth having, one combination
        need_rest = (len(others) * self.setup_s * 1.3 + self._race_need(len(others) + 2, _MIN_ROUNDS)
                     + self._race_need(4, _SETTLE_ROUNDS // 2) + self._combo_need())
        if self.left() < self.compile_need + need_rest:
            # not planned: tried at the end only if the races settle early and leave the time for it
            self.compile_skip_reason = (
                f"compiling takes about {est:.0f} s here (a first estimate from the model's size), more than "
                f"--budget-seconds leaves after the other tricks: raise it to about "
                f"{math.ceil(self.report.budget_s + self.compile_need + need_rest - self.left()):.0f} to measure it")
        else:
            self.compile_planned = True
            self.compile_reserve = self.compile_need
        return compile_res, others

    def _set_up_candidates(self, others: list[Candidate]) -> list[Result]:
        """2. each candidate alone: drift and memory now (time together, in the race), within half the time left."""
        results: list[Result] = []
        setup_end = time.perf_counter() + 0.5 * self.left(self.train_end - self.compile_reserve)
        built = 0
        for c in others:
            res = Result(c.name, c.goal, c.changes, c.ids, note=c.note)
            results.append(res)
            self.phase(c.name)
            self._set_up_in_turn(res, c, setup_end, built)
            built += res.runner is not None
            self.bar.update(1)
        return results

    def _set_up_in_turn(self, res: Result, c: Candidate, setup_end: float, built: int) -> None:
        """One candidate's set-up, after ``built`` others: not measured further when its probe was far slower,
        skipped when the time left would not hold it, failed (with the reason) when it raises."""
        if c.probe_ratio is not None and c.probe_ratio >= SLOW_FACTOR:
            res.probe_ratio = c.probe_ratio
            res.status, res.verdict = "measured (probe)", "slower"
            res.reason = f"{c.probe_what} took {c.probe_ratio:.0f}x fp32 here: not measured further"
            return
        # room for its set-up and for the least timing of all built so far (5 rounds and a warm-up)
        timing_need = (_MIN_ROUNDS + 1) * (built + 3) * self.step_s
        # set-up gets half the time left, but the first trick (the most promising: speed first) may take
        # more: a race of the two baselines alone answers nothing (a 0.76 s GPT-2 step: 35 s per set-up)
        end = min(setup_end if built else math.inf, self.train_end - self.compile_reserve - timing_need)
        if time.perf_counter() + self.setup_s > end:
            res.status, res.verdict = "skipped", "skipped"
            res.reason = "over --budget-seconds before it could be measured: raise it"
            return
        try:
            self._setup_candidate(res, c, end)
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)

    def _race_singles(self, results: list[Result]) -> None:
        """3. the race: all of them with the two baselines, round-robin; losers leave, contenders get the rounds."""
        report = self.report
        t_race = time.perf_counter()
        self.phase_s["set-up"] = t_race - self.t0
        self.phase("race")
        self.singles_res = [r for r in results if r.runner is not None]
        lanes = self._singles_lanes()
        self.singles = Race(lanes, min_effect=MIN_EFFECT, min_rounds=_MIN_ROUNDS, settle_rounds=_SETTLE_ROUNDS,
                            max_rounds=_MAX_ROUNDS, noise_resolution=MIN_EFFECT / 4, seed=int(self.base_cfg.get("seed", 0)), sync=self._sync)
        left = self.left()
        reserve = self._kept_from_the_race(lanes)
        self.singles.run(time.perf_counter() + max(left - reserve, 0.4 * left))
        if self.singles.lanes[0].error:
            raise UserError(f"{report.model}: the plain fp32 step raised while timed: {self.singles.lanes[0].error}")
        self._read_singles()
        self.phase_s["race"] = time.perf_counter() - t_race
        self.bar.update(1)

    def _kept_from_the_race(self, lanes: list[Lane]) -> float:
        """Seconds kept back from the race of the single tricks: compile's, one combination's where two
        contenders could make one, and the memory tricks' together (one memory run: the largest batch's
        configuration) where two of them cut the bytes per sample."""
        contenders = sum(1 for lane in lanes[2:] if lane.contender)
        base = self.report.baseline
        cutters = [r for r in self.singles_res if base.bytes_per_sample and _cuts_bytes_per_sample(r, base)]
        self.memory_reserve = _MEMORY_RUN_MARGIN * self.memory_s if len(_compatible(cutters)[0]) >= 2 else 0.0
        return (self.compile_reserve + (self._combo_need() if contenders >= 2 else 0.0)) + self.memory_reserve

    def _singles_lanes(self) -> list[Lane]:
        """The plain step and its A/A twin, then each single trick (a contender unless it cannot win)."""
        plain_fits = self._fits(self.report.baseline)
        lanes = [Lane("plain", self.base, role="baseline"), Lane("plain (A/A)", self.twin, role="twin")]
        for res in self.singles_res:
            why = self._not_a_contender(res, plain_fits)
            lanes.append(Lane(res.name, res.runner, contender=not why, why_not=why))
        return lanes

    def _combinations(self) -> None:
        """4. combinations for throughput (under the memory limit); 5. the largest batch."""
        t_combo = time.perf_counter()
        self.phase("combinations")
        self._best_throughput()
        self.bar.update(1)
        self.phase("largest batch")
        self._largest_batch()
        if self.fit is not None and self.fit.search_seq:
            self.phase("longest sequence")
            self._longest_seq()
        self.phase_s["combinations"] = time.perf_counter() - t_combo
        self.bar.update(1)

    def _compile_phase(self, compile_res: Result) -> None:
        """6. compile, on top of the best configuration so far, if the time left holds it (else skipped, why)."""
        t_compile = time.perf_counter()
        budget_left = self.left()
        if self.compile_planned:
            room = budget_left >= self.compile_est + self._race_need(3, _MIN_ROUNDS)
        else:  # not planned: it may fit now, with the time the races saved by settling early
            room = budget_left >= self.compile_need
        if room:
            self.phase("compile")
            self._try_compile(compile_res)
        elif self.compile_planned:
            compile_res.status, compile_res.verdict = "skipped", "skipped"
            compile_res.reason = (f"over --budget-seconds: compiling takes about {self.compile_est:.0f} s here "
                                  f"and only {max(budget_left, 0):.0f} s are left; raise it")
        else:
            compile_res.status, compile_res.verdict = "skipped", "skipped"
            compile_res.reason = self.compile_skip_reason
        self.phase_s["compile"] = time.perf_counter() - t_compile
        self.compile_reserve = 0.0
        self.bar.update(1)

    def _more_rounds_phase(self) -> None:
        """What is left of the budget goes to the races still open; then every decision is taken again."""
        t_more = time.perf_counter()
        self.phase("more rounds")
        if self._more_rounds():
            self._read_singles()
            for res in self.report.results + self.report.combos:
                if id(res) in self.side:
                    self._read_side(res)
            self._decide()
            self.phase_s["more rounds"] = time.perf_counter() - t_more

    def _close_training(self, results: list[Result]) -> None:
        """The notes and the stop reason of the training part; the model copies are freed."""
        report = self.report
        report.notes += self.choice_notes
        report.stop_reason = self._stop_reason()
        for res in results + report.combos:
            res.runner = None  # free the model copies
        self.base = self.twin = None
        self.side.clear()

    def _reserve_efficiency(self) -> None:
        """Keep back from the training phases the time of the MFU figures (the step's FLOPs counted, and this
        machine's peak measured if not cached yet), where it is a small share of the budget; else say why not."""
        cached = cached_peak(torch.device(self.report.device)) is not None
        need = _COUNT_STEPS * self.step_s + (0.0 if cached else _PEAK_MEASURE_S)
        if need <= _EFFICIENCY_SHARE * self.report.budget_s:
            self.efficiency_reserve = need
            self.train_end -= need
            return
        self.report.efficiency = {"status": "skipped", "reason": (
            f"it needs about {need:.0f} s, over {_EFFICIENCY_SHARE:.0%} of --budget-seconds"
            + ("" if cached else "; `torch-tricks peak` measures this machine's peak once, for every later tune"))}

    def _efficiency_phase(self) -> None:
        """MFU of the plain step and of the recommendation against this machine's peak (issue 22): the model
        FLOPs of a step counted once, the peak read from its cache (measured there first)."""
        report, base, best = self.report, self.report.baseline, self.report.best_throughput
        if not self.efficiency_reserve or base is None or not base.step_s:
            return
        dev = torch.device(report.device)
        t = time.perf_counter()
        try:
            cost = step_cost(self.model, self.base_cfg, self.batches[0], **self.kw)
            rec = best if best is not None and best.step_s else base
            steps = {"plain": ("plain", "fp32", base.step_s),
                     "recommended": (rec.name, rec.changes.get("precision", "fp32"), rec.step_s)}
            report.efficiency = {"status": "measured", **efficiency(cost, device_peak(dev), steps).to_dict()}
        except UserError as exc:
            report.efficiency = {"status": "failed", "reason": str(exc)}
        except Exception as exc:  # the counter cannot follow this model: said, the tune's verdicts stand
            report.efficiency = {"status": "failed", "reason": one_line(exc, with_type=True)}
        self.phase_s["efficiency"] = time.perf_counter() - t

    def _other_phases(self, data: str | None) -> None:
        """7. the distributed rows, data and deploy, each in its share of the budget."""
        report = self.report
        if self.dist_world:
            report.distributed = self._timed_phase(f"{self.dist_world} processes", "distributed",
                                                   self._measure_distributed)
        if data:
            report.data = self._timed_phase("data", "data", lambda: self._measure_data(data))
        if self.deploy_start_share:
            report.deploy = self._timed_phase("deploy", "deploy", self._measure_deploy)

    def _timed_phase(self, label: str, key: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``measure()`` as the phase ``label``, its wall seconds under ``key`` of the report's phase_s."""
        t = time.perf_counter()
        self.phase(label)
        out = measure()
        self.phase_s[key] = time.perf_counter() - t
        self.bar.update(1)
        return out

    # -- combinations ------------------------------------------------------------------------
    def _fits(self, r: Result) -> bool:
        return r.peak_bytes is not None and r.peak_bytes <= self.limit

    def _best_throughput(self) -> None:
        """Greedy: the fastest fitting trick, plus the next fastest while the pair beats it beyond the noise.

        Taken again after more rounds (see :meth:`_decide`): a combination or a configuration
        measured already is reused, not measured twice.
        """
        report = self.report
        base = report.baseline
        report.best_throughput = base
        plain_fits = self._fits(base)
        good = self._faster_speed_tricks(plain_fits)
        end = self.train_end - self.compile_reserve - self.memory_reserve  # the memory tricks' run comes next
        if not plain_fits:
            self.choice_notes.append(
                f"the plain step needs {_gib(base.peak_bytes)} at batch {report.batch}, over the memory limit "
                f"{_gib(self.limit)}: looking for a configuration that fits")
            current = self._make_it_fit(end)
            if current is None:
                return
            report.fits_with = current.name
            good = [r for r in good if not (set(r.changes) & set(current.changes))]
        else:
            current = good.pop(0) if good else base
        report.best_throughput = current
        self._add_while_faster(current, good, end)
        if report.best_throughput is not base:
            report.best_throughput.chosen = True

    def _faster_speed_tricks(self, plain_fits: bool) -> list[Result]:
        """The speed tricks faster than plain, fastest first: those that fit; when plain does not fit, also
        those that do not fit alone (on top of a configuration that fits they may, and every combination's
        memory is measured). Not compile: it comes last, on top (and its memory is not measured)."""
        good = [r for r in self.report.results if r.goal == "speed" and self._faster(r)
                and (self._fits(r) or not plain_fits) and not r.changes.get("compile")]
        good.sort(key=lambda r: r.ratio)
        return good

    def _add_while_faster(self, current: Result, good: list[Result], end: float) -> None:
        """Each next trick on top of ``current``, kept (as the best) where the pair beats it beyond the noise."""
        for k, nxt in enumerate(good):
            if set(nxt.changes) & set(current.changes) or not _valid_together({**current.changes, **nxt.changes}):
                continue
            combo = self._combination(current, nxt, good[k:], end)
            if combo is not None and self._beats_what_it_extends(combo):
                current = combo
                self.report.best_throughput = current

    def _combination(self, current: Result, nxt: Result, rest: list[Result], end: float) -> Result | None:
        """``current`` with ``nxt`` on top, measured once (reused when decided again); None when over budget.
        It gets its share of the time left among ``rest``, the tricks still to try on top of ``current``."""
        key = (_key({**current.changes, **nxt.changes}), current.name)
        combo = self._combos.get(key)
        if combo is not None:
            return combo
        if self.left(end) < self._combo_need():
            self.choice_notes.append(f"combination of {current.name} with {nxt.name} not tried: over --budget-seconds")
            return None
        n = sum(1 for r in rest if not set(r.changes) & set(current.changes))
        combo = self._measure_combo(current, nxt, end, share=1.0 / max(n, 1))
        self._combos[key] = combo
        self.report.combos.append(combo)
        return combo

    def _beats_what_it_extends(self, combo: Result) -> bool:
        return (combo.status == "measured" and self._fits(combo) and combo.vs_current is not None
                and combo.vs_current < 1 - self._margin(combo.vs_current_half_ci) and _drift_ok(combo))

    def _make_it_fit(self, end: float) -> Result | None:
        """The fastest measured way under the limit: the fastest single trick that fits, or a combination of
        the tricks that cut the peak that was measured to fit and be faster still (a few tried, those whose
        estimate could be faster first); else the cutters, fastest first, added until it fits; else all of
        them with micro-batches (accumulation)."""
        singles = [r for r in self.report.results if r.status == "measured" and r.peak_bytes is not None]
        fit = self._fitting(singles)
        best = min(fit, key=_ratio_or_inf) if fit else None
        for tnames, tchanges in self._combos_that_may_fit_faster(singles, best):
            res = self._fit_try(tnames, tchanges, end)
            if res is None:
                self.choice_notes.append("stopped trying combinations that may fit faster: over --budget-seconds")
                break
            if (res.status == "measured" and self._fits(res) and _drift_ok(res)
                    and (best is None or _ratio_or_inf(res) < _ratio_or_inf(best))):
                best = res
        if best is not None:
            return self._fits_with(best)
        return self._first_that_fits(self._ways_to_fit(singles), end)

    def _combos_that_may_fit_faster(self, singles: list[Result], best: Result | None
                                    ) -> list[tuple[list[str], dict[str, Any]]]:
        """Pairs and triples of the peak cutters whose savings, added, bring the plain peak near the limit
        (within 10%: savings overlap, so each is measured before it counts) and whose time ratios, multiplied,
        beat ``best``'s: an ordering only, estimated fastest first, at most ``_FIT_COMBO_TRIES``."""
        base_peak = self.report.baseline.peak_bytes
        cutters = sorted(self._peak_cutters(singles), key=_ratio_or_inf)
        bar = _ratio_or_inf(best) if best is not None else math.inf
        tries = []
        for k in (2, 3):
            for group in itertools.combinations(cutters, k):
                chosen, changes = _compatible(list(group))
                if len(chosen) != k:
                    continue
                est_peak = base_peak - sum(base_peak - r.peak_bytes for r in group)
                est_ratio = math.prod(_ratio_or_inf(r) for r in group)
                if est_peak <= 1.1 * self.limit and est_ratio < bar:
                    tries.append((est_ratio, [r.name for r in group], changes))
        tries.sort(key=lambda t: t[0])
        return [(names, changes) for _, names, changes in tries[:_FIT_COMBO_TRIES]]

    def _fitting(self, singles: list[Result]) -> list[Result]:
        """The single tricks that fit under the limit: those whose loss does not drift, where there are any."""
        fit = [r for r in singles if self._fits(r)]
        return [r for r in fit if _drift_ok(r)] or fit

    def _fits_with(self, res: Result) -> Result:
        """``res``, the configuration that fits, noted."""
        self.choice_notes.append(f"fits with {res.name}: peak {_gib(res.peak_bytes)} (limit {_gib(self.limit)})")
        return res

    def _ways_to_fit(self, singles: list[Result]) -> list[tuple[list[str], dict[str, Any]]]:
        """(names, changes) to try in turn: every trick that cuts the peak (memory tricks, and speed tricks
        such as bf16 that also do), fastest first, added one by one; then micro-batches on top."""
        cutters = sorted(self._peak_cutters(singles), key=_ratio_or_inf)
        tries: list[tuple[list[str], dict[str, Any]]] = []
        changes: dict[str, Any] = {}
        names: list[str] = []
        for r in cutters:
            if not set(r.changes) & set(changes):
                changes = {**changes, **r.changes}
                names = names + [r.name]
                if len(names) > 1:
                    tries.append((names, changes))
        return tries + _with_micro_batches(names, changes, self.report.batch)

    def _peak_cutters(self, singles: list[Result]) -> list[Result]:
        """The tricks that cut the plain peak by 2% or more without micro-batches, and do not drift."""
        base_peak = self.report.baseline.peak_bytes
        return [r for r in singles if not r.changes.get("accumulate") and _drift_ok(r)
                and r.peak_bytes < base_peak * 0.98]

    def _first_that_fits(self, tries: list[tuple[list[str], dict[str, Any]]], end: float) -> Result | None:
        """The first of ``tries`` that fits under the limit and was timed; None (and the closest, in a note)."""
        closest: Result | None = None
        for tnames, tchanges in tries:
            res = self._fit_try(tnames, tchanges, end)
            if res is None:
                self.choice_notes.append("stopped looking for a configuration that fits: over --budget-seconds")
                break
            if res.status == "measured (memory)":
                closest = _smaller_peak(res, closest)
                continue
            if res.status != "measured":
                continue
            return self._fits_with(res)
        self.choice_notes.append("no configuration tried fits under the memory limit: lower --batch or raise the "
                                 "limit" + (f" (closest: {closest.name}, peak {_gib(closest.peak_bytes)})"
                                            if closest else ""))
        return None

    def _fit_try(self, tnames: list[str], tchanges: dict[str, Any], end: float) -> Result | None:
        """One configuration tried for fit, measured once (reused when decided again); None when over budget."""
        res = self._fit_tries.get(_key(tchanges))
        if res is not None:
            return res
        if time.perf_counter() > end:
            return None
        res = self._try_fit(tnames, tchanges, end)
        self._fit_tries[_key(tchanges)] = res
        self.report.combos.append(res)
        return res

    def _try_fit(self, tnames: list[str], tchanges: dict[str, Any], end: float) -> Result:
        """Memory of one configuration; if it fits, its drift, and its time against the plain step."""
        report = self.report
        res = Result(_fit_name(tnames), "memory", tchanges, _ids_of(report, tchanges))
        cfg = {**self.base_cfg, **tchanges}
        try:
            self._memory_into(res, cfg)
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)
            return res
        if not self._fits(res):
            res.status, res.verdict = "measured (memory)", "over the memory limit"
            return res
        try:
            r = build_runner(res.name, self.model, cfg, self.batches, **self.kw)
            _drift_into(res, r, self.base)
            res.runner = r
            # nothing to decide against plain (it does not fit): timed for its cost, the least rounds
            self._race_side_by_side(res, None, end, contender=False,
                                    why_not="the configuration that fits (plain does not): timed for its cost")
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)
        return res

    def _measure_combo(self, a: Result, b: Result, end: float, share: float = 0.5) -> Result:
        changes = {**a.changes, **b.changes}
        name = "+".join(sorted(set(a.name.split("+")) | set(b.name.split("+"))))
        res = Result(name, "speed", changes, tuple(sorted(set(a.ids) | set(b.ids))))
        cfg = {**self.base_cfg, **changes}
        try:
            r = build_runner(name, self.model, cfg, self.batches, **self.kw)
            _drift_into(res, r, self.base)
            self._memory_into(res, cfg)
            res.runner = r
            self._race_side_by_side(res, a if a is not self.report.baseline else None, end, share=share)
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)
            res.runner = None
        return res

    def _race_side_by_side(self, res: Result, current: Result | None, end: float, *, share: float = 0.5,
                           contender: bool = True, why_not: str = "") -> None:
        """Race ``res`` with the plain step (and ``current``, the configuration it extends, to compare directly).

        The question: is ``res`` faster than ``current`` (else plain) beyond the margin? The
        race ends when that is settled, at ``share`` of the time left until ``end``, or at the
        cap on rounds; it can get more rounds at the end (:meth:`_more_rounds`).
        """
        lanes = [Lane("plain", self.base, role="baseline")]
        if current is not None and current.runner is not None:
            lanes.append(Lane(current.name, current.runner, role="ref"))
        else:
            current = None
        lanes.append(Lane(res.name, res.runner, ref=len(lanes) - 1, contender=contender and _drift_ok(res),
                          why_not=why_not or "its loss drifts from fp32 beyond the tolerance: timed for its cost only"))
        race = Race(lanes, noise=self._noise, min_effect=MIN_EFFECT, min_rounds=_MIN_ROUNDS,
                    settle_rounds=_SIDE_SETTLE_ROUNDS, max_rounds=_MAX_SIDE_ROUNDS, seed=int(self.base_cfg.get("seed", 0)),
                    sync=self._sync)
        self.side[id(res)] = (race, current)
        floor = self._race_need(len(lanes), _MIN_ROUNDS)
        race.run(min(end, time.perf_counter() + max(share * self.left(end), floor)))
        self._read_side(res)

    def _read_side(self, res: Result) -> None:
        """``res``'s figures from its side-by-side race, as it stands."""
        race, current = self.side[id(res)]
        lane = race.lanes[-1]
        if res.status == "failed":
            return
        if lane.error:
            res.status, res.verdict, res.reason = "failed", "failed", f"raised while timed: {lane.error}"
            res.runner = None
            res.step_s = res.ratio = res.ratio_half_ci = res.rounds = None
            return
        plain = race.lanes[0].times
        res.step_s = _median(lane.times)
        res.ratio, res.ratio_half_ci = paired_ratio(lane.times, plain)
        res.rounds, res.left_round, res.left_reason = len(lane.times), lane.left_round, lane.left_reason
        res.race_rounds = race.rounds
        res.status = "measured"
        if current is not None:
            res.vs_current, res.vs_current_half_ci = race.ratio(len(race.lanes) - 1, 1)
            res.vs_current_name = current.name
            res.vs_current_step_s = _median(race.lanes[1].times)
        else:
            res.vs_current, res.vs_current_half_ci = res.ratio, res.ratio_half_ci
            res.vs_current_step_s = _median(plain)
        res.verdict = self._verdict(res)

    def _largest_batch(self) -> None:
        """All memory tricks that cut bytes per sample (drift within tolerance), together."""
        report = self.report
        base = report.baseline
        if base.bytes_per_sample is None:
            return
        mem = [r for r in report.results if _cuts_bytes_per_sample(r, base)]
        best = max([base] + mem, key=_max_batch)
        chosen, changes = _compatible(sorted(mem, key=lambda r: r.bytes_per_sample))
        if len(chosen) >= 2:
            together = self._memory_tricks_together(chosen, changes)
            if together is not None and _max_batch(together) > _max_batch(best):
                best = together
        report.best_batch = best
        if report.memory_limit_source != "given" and torch.device(self.base_cfg["device"]).type != "cuda":
            report.notes.append("largest batch: not searched (the limit is this host's RAM, not one you gave): give "
                                "--memory-limit to have it run")
            return
        for r in ([best, base] if best is not base else [base]):
            self._search_largest_batch(r)

    def _longest_seq(self) -> None:
        """``--fit seq``: the longest sequence under the limit for plain, for the recommendation and for the
        memory tricks together (the largest-batch configuration: what a long context needs), each run."""
        report = self.report
        rows: list[Result] = []
        for r in (report.baseline, report.best_throughput, report.best_batch):
            if r is not None and all(r is not x for x in rows):
                rows.append(r)
        for i, r in enumerate(rows):  # asked for: together most of the time left, in equal parts
            self._search_longest_seq(r, share=0.6 / (len(rows) - i))
        report.seq_positions = fit_mod.max_positions(self.model)

    def _search_largest_batch(self, res: Result) -> None:
        """``res``'s largest batch under the limit, run (:meth:`_search_largest`, the example batch tiled)."""
        n0 = B.batch_size(self.batches[0])
        res.max_batch, res.max_batch_bound = self._search_largest(
            res, n0, res.max_batch_guess or 2 * n0, lambda b: fit_mod.tiled(self.batches[0], b))

    def _search_longest_seq(self, res: Result, share: float) -> None:
        """``res``'s longest sequence under the limit, run (:meth:`_search_largest`, the ids tiled along the
        sequence), up to the model's positions, within ``share`` of the time left."""
        t0 = fit_mod.sequence_length(self.batches[0])
        res.max_seq, res.max_seq_bound = self._search_largest(
            res, t0, 2 * t0, lambda t: fit_mod.with_sequence_length(self.batches[0], t),
            cap=fit_mod.max_positions(self.model), share=share)

    def _search_largest(self, res: Result, n0: int, guess: int, resize: Callable[[int], Any],
                        cap: int | None = None, share: float = _BATCH_SEARCH_SHARE) -> tuple[int | None, int | None]:
        """(the largest size that ran under the limit, the smallest that did not) for ``res``'s configuration:
        steps at growing, then bisected sizes (``resize(n)`` the example batch at size n; ``n0`` its own size),
        each a fresh copy's build + two steps with its peak measured, until the boundary is known within 5%,
        ``_BATCH_PROBES`` runs were made, ``cap`` was reached, or the next would not end within
        ``share`` of the budget left (a step's time grows with the size): then the largest is "at least" the
        last that fit, and the report says larger was not run."""
        cfg = {**self.base_cfg, **res.changes}
        fits0 = res.peak_bytes is not None and res.peak_bytes <= self.limit
        lo, hi = (n0, None) if fits0 else (0, n0)
        guess = max(guess, n0 + 1) if fits0 else min(max(guess, 1), max(n0 - 1, 1))
        # a run at size b: about b / n0 times plain's memory run (the fixed part makes it an overestimate)
        per_unit_s = (self.memory_s or res.step_s or self.report.baseline.step_s or 0.0) / max(n0, 1)
        until = time.perf_counter() + share * max(self.left(self.train_end - self.compile_reserve), 0)
        for _ in range(_BATCH_PROBES):
            b = _next_size(lo, hi, guess, cap)
            b = min(b, self._affordable_batch(per_unit_s, until)) if b else 0
            if b <= lo or (hi is not None and b >= hi):
                break
            fits = self._fits_at(cfg, resize(b))
            if fits is None:
                break
            lo, hi, guess = (b, hi, 2 * b) if fits else (lo, b, max(b // 2, 1))
        return lo or None, hi

    def _fits_at(self, cfg: dict[str, Any], batch: Any) -> bool | None:
        """Whether a memory run of ``cfg`` on ``batch`` peaks under the limit; an out-of-memory error is a no,
        any other (the model refuses the size) None: the search stops there."""
        try:
            return measure_memory(self.model, cfg, batch, per_sample=False, **self.kw).peak_bytes <= self.limit
        except Exception as exc:
            return False if is_oom(exc) else None

    def _affordable_batch(self, per_sample_s: float, until: float) -> int:
        """The largest batch whose memory run (a build and a few steps) takes at most half the time to ``until``.

        Scaled from plain's memory run, not from the set-up, which carries one-time costs (on an H200 the
        set-up of GPT-2's tune took 24 s, CUDA's and cuBLAS's start in it, and no larger batch was ever run)."""
        left = until - time.perf_counter()
        if per_sample_s <= 0:
            return 1 << 30
        return max(int(left / 2 / per_sample_s), 0)

    def _memory_tricks_together(self, chosen: list[Result], changes: dict[str, Any]) -> Result | None:
        """The memory of ``chosen`` together (``changes``): measured already while looking for a fit, else
        measured now (memory only) if the time left holds it; None when it failed or did not fit the budget."""
        report = self.report
        same = self._measured_for_memory(changes)
        if same is not None:
            return same
        if time.perf_counter() + _MEMORY_RUN_MARGIN * self.memory_s >= self.train_end - self.compile_reserve:
            report.notes.append("memory tricks not combined for the largest batch: over --budget-seconds")
            return None
        combo = Result("+".join(sorted(r.name for r in chosen)), "memory", changes, _all_ids(chosen))
        try:
            self._memory_into(combo, {**self.base_cfg, **changes})
        except Exception as exc:
            combo.status, combo.verdict, combo.reason = "failed", "failed", one_line(exc, with_type=True)
            report.combos.append(combo)
            return None
        combo.status, combo.verdict = "measured (memory)", "memory only: not timed"
        report.combos.append(combo)
        return combo

    def _measured_for_memory(self, changes: dict[str, Any]) -> Result | None:
        """The combination of exactly ``changes`` measured already, with its largest batch (None: none)."""
        return next((r for r in self.report.combos if r.changes == changes and r.max_batch_guess is not None), None)

    def _try_compile(self, res: Result) -> None:
        """``compile`` on top of the best configuration so far (one compilation), raced against it and plain."""
        report = self.report
        best = report.best_throughput or report.baseline
        on_best = best is not report.baseline
        target = res
        if on_best:
            target = Result(f"{best.name}+{res.name}", "speed", {**best.changes, **res.changes},
                            tuple(sorted(set(best.ids) | set(res.ids))))
        cfg = {**self.base_cfg, **target.changes}
        self.compile_target, self.compile_base, self.compile_row = target, best, res
        try:  # no probe: a second batch shape would make dynamo recompile with dynamic shapes
            r = build_runner(target.name, self.model, cfg, self.batches, probe=False, **self.kw)
            _drift_into(target, r, self.base)
            target.runner = r
            # half of what is left; more rounds at the end are shared with the other open races
            self._race_side_by_side(target, best if on_best else None, self.train_end, share=0.5)
            target.note = (f"first call {target.first_call_s:.1f} s (compilation), not in the step time; "
                           "memory not measured under compile")
        except Exception as exc:
            target.status, target.verdict, target.reason = "failed", "failed", one_line(exc, with_type=True)
        if on_best:
            report.combos.append(target)
            res.status, res.verdict = target.status, target.verdict
            res.reason = f"measured on top of {best.name}: see {target.name}"
        self._compile_decide()

    def _compile_decide(self) -> None:
        """Recommend the compiled configuration if it beats the one it was compiled on top of beyond the margin."""
        report = self.report
        target, base = self.compile_target, self.compile_base
        if target is None or target.status != "measured":
            return
        best = report.best_throughput or report.baseline
        row = self.compile_row
        if row is not target:  # the compile row points at the +compile one
            row.status, row.verdict = target.status, target.verdict
        if best is not base:
            self.choice_notes.append(f"compile was measured on top of {base.name}; after more rounds the "
                                     f"recommendation is {best.name}, on top of which it was not measured: not "
                                     "recommended")
            return
        if self._compile_wins(target):
            best.chosen = False
            target.chosen = True
            report.best_throughput = target

    def _compile_wins(self, target: Result) -> bool:
        """The compiled configuration is faster than what it extends beyond the margin, the plain step fits
        the memory limit, and its compilation pays back within the run."""
        beyond = self._margin(target.vs_current_half_ci)
        if not (target.vs_current is not None and target.vs_current < 1 - beyond and self._faster(target)):
            return False
        if not self._fits(self.report.baseline):  # its memory is not measured: no bet under a tight limit
            self.choice_notes.append(f"{target.name} is faster, but its memory is not measured under compile and "
                                     "the limit is tight: not recommended")
            return False
        # its first call must be paid back within the run (its row says so, with the break-even step count)
        return self.report.amortised(target) is not False

    # -- the race ----------------------------------------------------------------------------
    def _sync(self) -> None:
        synchronize(self.base.step.device if self.base is not None else torch.device("cpu"))

    def _noise(self) -> float:
        return self.report.noise

    def _too_slow_for_the_budget(self, base: Runner, build_s: float, base_res: Result, cands: list[Candidate]) -> bool:
        """Stop after the plain step when the budget cannot hold even one trick's measurement.

        What the least tune costs is known once the plain step is built: the A/A twin and
        the memory measurement (about one build each), one trick's build, and the least race
        of three lanes. A step of seconds (BERT-base at batch 32 on two cores: 8 s) would
        otherwise run the set-up for minutes past the budget and measure nothing; this says
        at once what budget or batch would do, with the plain step's time measured. Only a
        budget under half the estimate stops it: the estimate comes from the first steps.
        """
        step_s = max(_median(base.step_times) if base.step_times else build_s, 1e-4)
        need = 3.0 * build_s + (_MIN_ROUNDS + 1) * 3 * step_s
        spent = time.perf_counter() - self.t0
        if self.left() >= need / 2:  # the first steps can take twice the steady ones (warm-up, a busy machine)
            return False
        report = self.report
        base_res.step_s = step_s
        report.baseline = report.best_throughput = base_res  # the recommendation: the plain step
        suggest = math.ceil((spent + need) / 10.0) * 10
        smaller = max(1, int(report.batch * self.left() / need)) if report.batch > 1 else 1
        why = (f"one plain step takes {step_s:.1f} s here: measuring even one trick needs about {need:.0f} s more "
               f"(the A/A twin, memory, one trick's set-up, {_MIN_ROUNDS} rounds); raise --budget-seconds to about "
               f"{suggest}" + (f" or lower --batch (to about {smaller})" if smaller < report.batch else ""))
        report.results = [Result(c.name, c.goal, c.changes, c.ids, note=c.note, status="skipped", verdict="skipped",
                                 reason="over --budget-seconds before it could be measured: " + why.split(": ", 1)[1])
                          for c in cands]
        report.stop_reason = "budget: " + why
        report.notes.append("only the plain step was measured: " + why)
        self.phase_s["set-up"] = time.perf_counter() - self.t0
        self.base = None
        return True

    def _race_need(self, lanes: int, rounds: int) -> float:
        """Seconds for ``rounds`` rounds (and a warm-up) of ``lanes`` plain-sized steps."""
        return (rounds + 1) * lanes * self.step_s

    def _combo_need(self) -> float:
        """Seconds one combination takes at least: its set-up, then a short race with plain and what it extends."""
        return 1.2 * self.setup_s + self._race_need(3, _SIDE_SETTLE_ROUNDS)

    def _not_a_contender(self, res: Result, plain_fits: bool) -> str:
        """Why ``res`` cannot be the recommendation for throughput ('' if it can): it is timed for its cost only."""
        if not _drift_ok(res):
            return "its loss drifts from fp32 beyond the tolerance: not recommended, timed for its cost only"
        if plain_fits and res.goal != "speed":
            return f"a {res.goal} trick, not a throughput contender while the plain step fits: timed for its cost only"
        if plain_fits and not self._fits(res):
            return "over the memory limit, where the plain step fits: not recommended, timed for its cost only"
        return ""

    def _read_singles(self) -> None:
        """The noise, and every single trick's figures and verdict, from the race as it stands."""
        report, race = self.report, self.singles
        base_t, twin_t = race.lanes[0].times, race.lanes[1].times
        report.rounds = race.rounds
        aa, aa_half = paired_ratio(twin_t, base_t)
        report.noise = max(abs(aa - 1.0), aa_half) if not math.isnan(aa) else math.nan
        report.aa_ratio, report.aa_half_ci = aa, aa_half
        base_res = report.baseline
        base_res.step_s, base_res.ratio, base_res.rounds = _median(base_t), 1.0, race.rounds
        for res, lane in zip(self.singles_res, race.lanes[2:]):
            if res.status == "failed":
                continue
            if lane.error:
                res.status, res.verdict, res.reason = "failed", "failed", f"raised while timed: {lane.error}"
                res.runner = None
                continue
            res.step_s = _median(lane.times)
            res.ratio, res.ratio_half_ci = paired_ratio(lane.times, base_t)
            res.rounds, res.left_round, res.left_reason = len(lane.times), lane.left_round, lane.left_reason
            res.race_rounds = race.rounds
            res.verdict = self._verdict(res)

    def _more_rounds(self) -> bool:
        """What is left of the training budget goes to the races still open: the singles first, then the
        combinations and compile, each until settled or its share of what is left. True if any ran."""
        races = self._singles_race() + [race for race, _ in self.side.values()]
        ran = False
        tried: set[int] = set()
        while True:
            open_ = [r for r in _unsettled(races, "budget") if id(r) not in tried]
            left = self.left()
            if not open_ or left < max(2 * open_[0].last_round_s, 1.0):
                return ran
            r = open_[0]
            if not _ran_a_round(r, time.perf_counter() + left / len(open_)):
                tried.add(id(r))  # no round ran (it cannot go on, or a round would not fit): not tried again
            ran = True

    def _decide(self) -> None:
        """Every decision again, from the races as they stand now (measured combinations are reused)."""
        report = self.report
        for r in report.results + report.combos:
            r.chosen = False
        self.choice_notes = []
        self._best_throughput()
        self._compile_decide()

    def _stop_reason(self) -> str:
        """Why the tune stopped: ``settled: ...`` (every race answered its question), ``budget: ...`` (the
        time ran out with questions open: which), or ``cap: ...`` (the most rounds a race gets)."""
        report = self.report
        races = self._races()
        open_, capped = _unsettled(races, "budget"), _unsettled(races, "cap")
        noise = "n/a" if math.isnan(report.noise) else f"±{report.noise:.1%}"
        after = f"after {report.rounds} rounds (noise {noise})"
        tail = self._not_run_text()
        if open_:
            what = "; ".join(", ".join(r.open_lanes()) for r in open_)
            return f"budget: the time ran out {after} with these still open: {what}{tail}"
        if capped:
            what = "; ".join(f"{', '.join(r.open_lanes())} ({r.rounds} rounds)" for r in capped)
            return f"cap: the most rounds a race gets, with these still open: {what}{tail}"
        return (f"settled: {after} every trick had left the race with its question answered, or won it; "
                f"{self._recommendation_text()}{tail}")

    def _recommendation_text(self) -> str:
        best = self.report.best_throughput
        return "keep the plain step" if best is None or best is self.report.baseline else f"recommended: {best.name}"

    def _singles_race(self) -> list[Race]:
        """The race of the single tricks, as a list: empty where it did not run."""
        return [self.singles] if self.singles is not None else []

    def _not_run_text(self) -> str:
        """'; not measured for the budget: ...' naming the tricks the budget left out ('' when none)."""
        not_run = [r.name for r in self.report.results if r.status == "skipped" and "budget" in r.reason]
        return f"; not measured for the budget: {', '.join(not_run)}" if not_run else ""

    def _races(self) -> list[Race]:
        """The race of the single tricks, then each row's side-by-side race, in the rows' order."""
        races = self._singles_race()
        return races + [self.side[id(res)][0] for res in self.report.results + self.report.combos
                        if id(res) in self.side]

    # -- measurements ------------------------------------------------------------------------
    def _memory_into(self, res: Result, cfg: dict[str, Any]) -> None:
        """Peak, state and activation memory, and where the search for the largest batch under the limit starts."""
        m = measure_memory(self.model, cfg, self.batches[0], **self.kw)
        res.peak_bytes, res.state_bytes, res.activation_bytes = m.peak_bytes, m.state_bytes, m.activation_bytes
        res.bytes_per_sample = m.bytes_per_sample
        if m.bytes_per_sample and int(cfg.get("accumulate", 1)) == 1:
            res.max_batch_guess = max(m.micro_batch + int((self.limit - m.peak_bytes) // m.bytes_per_sample), 0)
        if res.status == "pending":
            res.status = "measured"

    def _margin(self, half_ci: float | None) -> float:
        return margin(self.report.noise, half_ci, MIN_EFFECT)

    def _faster(self, res: Result) -> bool:
        return (res.status == "measured" and res.ratio is not None and not math.isnan(res.ratio) and _drift_ok(res)
                and res.ratio < 1 - self._margin(res.ratio_half_ci))

    def _verdict(self, res: Result) -> str:
        speed = self._speed_verdict(res)
        if res.peak_bytes is not None and res.peak_bytes > self.limit:
            return f"{speed}, over the memory limit"
        return speed

    def _speed_verdict(self, res: Result) -> str:
        """Its speed against plain, in a word or two (a drifting loss first: its speed does not count)."""
        if not _drift_ok(res):
            return "drifts"
        if res.ratio is None or math.isnan(res.ratio):
            return "not timed"
        if res.ratio < 1 - self._margin(res.ratio_half_ci):
            return "faster"
        if res.ratio > 1 + self._margin(res.ratio_half_ci):
            return "slower"
        return "no measurable change"

    def _measure_distributed(self) -> dict[str, Any]:
        """ddp, zero1 and fsdp on the ranks, with the recommended configuration, against one process."""
        world = self.dist_world
        launched = D.launched_world() > 1
        job = self._dist_job(launched)
        why = "" if launched else D.unsendable(job)
        if why:
            return {**D._failed(why), "processes": world}
        budget = self.deadline - self.data_share - self.deploy_start_share - time.perf_counter()  # after the copy
        if budget < 5:
            return {"status": "skipped", "processes": world, "rows": [], "reason":
                    "over --budget-seconds before the distributed rows could be measured: raise it"}
        job.budget_s, job.deadline = budget, time.time() + budget
        result, local = self._run_on_ranks(job, launched)
        result.setdefault("processes", world)
        result["launched_by"] = "torchrun" if launched else f"tune --processes {world}"
        if result.get("status") == "measured":
            rec, why = D.recommend(result, self.limit, local_ranks=local, min_effect=MIN_EFFECT,
                                   drift_tolerance=DRIFT_TOLERANCE["loss"])
            result["recommended"], result["why"] = rec, why
        return result

    def _dist_job(self, launched: bool) -> D.DistJob:
        """The distributed rows' job: the recommended configuration (without compile) on CPU copies of the
        model and batch, its share of the budget, and the threads of a rank and of one process."""
        changes, notes = _eager_changes(self.report.best_throughput or self.report.baseline)
        budget = self.deadline - self.data_share - self.deploy_start_share - time.perf_counter()
        threads, one_process_threads = self._dist_threads(launched)
        return D.DistJob(
            model=copy.deepcopy(self.model).cpu(), batch=B.to_device(self.batches[0], torch.device("cpu")),
            loss_fn=self.kw.get("loss_fn"), optimizer_fn=self.kw.get("optimizer_fn"),
            config={**self.base_cfg, **changes}, changes=changes, limit=self.limit, budget_s=budget,
            deadline=time.time() + budget,
            seed=int(self.base_cfg.get("seed", 0)), notes=notes, min_effect=MIN_EFFECT,
            threads=threads, one_process_threads=one_process_threads)

    def _dist_threads(self, launched: bool) -> tuple[int | None, int | None]:
        """(intra-op threads of a rank, of the one-process lane) on the CPU; None on a GPU (left as they are)."""
        if torch.device(self.base_cfg.get("device", "cpu")).type != "cpu":
            return None, None
        if launched:
            return self.channel.threads, D.usable_cores()
        return max(1, D.usable_cores() // self.dist_world), torch.get_num_threads()

    def _run_on_ranks(self, job: D.DistJob, launched: bool) -> tuple[dict[str, Any], int]:
        """(the result, the ranks on this host): under torchrun, with the ranks waiting for the job; else on
        ranks the tune spawns."""
        world = self.dist_world
        if not launched:
            return D.launch(job, world), world
        self.channel.send(job)  # the other ranks wait for it
        try:
            result = D.measure_modes(job)
        except Exception as exc:
            result = D._failed(one_line(exc, with_type=True))
        return result, int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def _measure_data(self, path: str) -> dict[str, Any]:
        """Loader throughput at the tuned batch vs the recommended step's samples/s: data-bound or not."""
        until = self.deadline - self.deploy_start_share
        left = until - time.perf_counter()
        if left < 3:
            return {"path": path, "status": "skipped", "reason": "over --budget-seconds before the loader could be timed"}
        report = self.report
        try:
            lt = tune_loader_path(path, batch_sizes=(report.batch,), seconds_per_trial=min(max(left / 8, 0.5), 3.0),
                                  progress=False, cold_read=False)
        except Exception as exc:
            return {"path": path, "status": "failed", "reason": one_line(exc, with_type=True)}
        return _loader_against_step(path, lt, report.batch, report.best_throughput or report.baseline)

    def _measure_deploy(self) -> dict[str, Any]:
        """The inference chains (fuse, int8 ...) on an eval copy, each against eager fp32."""
        try:  # here, not at the top: it loads the deploy package and the model zoo, for --deploy only
            from torch_tricks.deploy.pipeline import optimize
        except ImportError as exc:
            return {"status": "failed", "reason": f"the deploy package cannot be imported: {exc}", "steps": []}
        parts = B.unpack(self.batches[0])
        if parts.kwargs:
            return {"status": "skipped", "steps": [], "reason": "the model takes keyword inputs; the deploy chain "
                    "exports positional ones: run `torch-tricks optimize` with positional --input"}
        example = _first_sample(parts.args)
        batch = self.report.batch
        out: dict[str, Any] = {"steps": [], "batches": [1, batch]}
        for chain in (["fuse", "int8"], ["int8-dynamic"], ["bf16"], ["reparam"], ["onnx"]):
            if self.deadline - time.perf_counter() < 3:
                out["steps"].append({"steps": chain, "status": "skipped", "reason": "over --budget-seconds"})
            else:
                out["steps"] += self._deploy_chain(optimize, chain, example, batch)
        return out

    def _deploy_chain(self, optimize: Callable[..., Any], chain: list[str], example: Any, batch: int
                      ) -> list[dict[str, Any]]:
        """The rows of one inference chain on an eval copy (one 'not applicable' row where it raises)."""
        try:
            res = optimize(copy.deepcopy(self.model).eval(), chain, example, batches=(1, batch), warmup=2, repeats=7)
        except Exception as exc:
            return [{"steps": chain, "status": "not applicable", "reason": one_line(exc, with_type=True)}]
        d = res.as_dict()
        return [_deploy_step(chain, s, d["original"]) for s in d["steps"]]


def _eager_changes(best: Result | None) -> tuple[dict[str, Any], list[str]]:
    """(the changes of ``best`` without compile, a note where compile was left out) for the distributed rows."""
    changes = {k: v for k, v in (best.changes if best is not None else {}).items() if k != "compile"}
    if best is not None and best.changes.get("compile"):
        return changes, ["compile is left out of the distributed rows (a compilation per lane and rank would take "
                         "the phase): they are measured eagerly"]
    return changes, []


def _loader_against_step(path: str, lt: Any, batch: int, best: Result | None) -> dict[str, Any]:
    """The loader's samples/s (``lt``: its tune) against the ``best`` step's at ``batch``: data-bound or not."""
    step_rate = _samples_per_s(batch, best)
    load_rate = lt.best.samples_per_s if lt.best else None
    out: dict[str, Any] = {"path": path, "status": "measured", "loader_samples_per_s": load_rate,
                           "step_samples_per_s": step_rate, "step_config": best.name if best else None,
                           "loader": lt.loader_kwargs() if lt.best else None, "verdict": lt.verdict,
                           "reasons": lt.reasons, "advice": lt.advice, "trials": lt.rows()}
    if load_rate and step_rate:
        out["data_bound"] = load_rate < step_rate
        out["summary"] = _data_summary(load_rate, step_rate, lt.verdict, best.name)
    return out


def _samples_per_s(batch: int, r: Result | None) -> float | None:
    return batch / r.step_s if r and r.step_s else None


def _data_summary(load_rate: float, step_rate: float, verdict: str, step_name: str) -> str:
    return (f"the loader delivers {load_rate:,.0f} samples/s ({verdict}), the {step_name} step consumes "
            f"{step_rate:,.0f}: " + ("data-bound: the step waits for data" if load_rate < step_rate
                                     else "not data-bound"))


def _first_sample(args: tuple[Any, ...]) -> Any:
    """The first sample of the positional inputs: the tensor alone for one input, else a tuple."""
    return args[0][:1] if len(args) == 1 else tuple(t[:1] for t in args)


def _deploy_step(chain: list[str], s: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """One step of a deploy chain's result as a row of the report (``steps``: the chain up to it)."""
    return {
        "steps": chain[: chain.index(s["step"]) + 1] if s["step"] in chain else chain,
        "status": "measured" if s.get("changed", True) else "no change",
        "speedup": s.get("speedup"), "latency_s": s.get("latency_s"),
        "agreement": s.get("agreement"), "within_tolerance": s.get("within_tolerance"),
        "tolerance": s.get("tolerance"), "size_bytes": s.get("size_bytes"),
        "original_size_bytes": original.get("size_bytes"), "notes": s.get("notes"),
    }


# -- inputs ------------------------------------------------------------------------------------

# KB/MB/GB are decimal; KiB/MiB/GiB and the bare K/M/G (as docker and free read them) binary.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"8GiB"`` -> 8589934592; ``"512MB"`` (decimal), ``"1.5G"`` (binary), ``"1000000"`` (bytes); else a UserError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"cannot read the size {text!r}: give a number with a unit, e.g. 8GiB, 512MiB or 2GB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"the size {text!r} must be > 0")
    return value


# -- helpers -----------------------------------------------------------------------------------

def _drift_ok(res: Result) -> bool:
    return res.loss_drift is None or res.loss_drift <= DRIFT_TOLERANCE["loss"]


def _loss_drift(losses: list[float], base: list[float]) -> float | None:
    """Largest |loss - fp32 loss| over the drift steps, relative to the first fp32 loss (inf if not finite)."""
    if not losses or len(losses) != len(base):
        return None
    if not all(math.isfinite(x) for x in losses):
        return math.inf
    return max(abs(a - b) for a, b in zip(losses, base)) / max(abs(base[0]), 1e-12)


def _drift_into(res: Result, r: Runner, base: Runner) -> None:
    res.first_call_s = r.first_call_s
    res.losses = r.losses
    res.grad_drift = relative_diff(r.grads, base.grads)
    res.loss_drift = _loss_drift(r.losses, base.losses)
    if r is not base:
        r.grads = None


def _ids_of(report: TuneReport, changes: dict[str, Any]) -> tuple[str, ...]:
    ids = {i for r in report.results if r.changes and set(r.changes) <= set(changes) for i in r.ids}
    return tuple(sorted(ids))


def _compile_estimate(model: nn.Module, step_s: float) -> float:
    """Seconds a first ``torch.compile`` of forward + backward takes, roughly, from the model's size.

    On the 2-core machine this project is tested on, a cold compile took ~10 s for
    small_cnn (13 modules) and ~15-25 s for ResNet-18 (68 modules); a warm inductor
    cache is faster. Only used to decide whether the budget leaves room to try.
    """
    return 8.0 + 0.2 * sum(1 for _ in model.modules()) + 20 * step_s


def _memory_limit(limit: int | None, dev: torch.device) -> tuple[int, str]:
    if limit is not None:
        if limit <= 0:
            raise UserError("--memory-limit must be > 0, e.g. 8GiB")
        return int(limit), "given"
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory), "the GPU's total memory"
    available = _available_ram()
    if available is not None:
        return int(available * 0.8), "80% of the RAM available at start"
    return 8 << 30, "a default of 8 GiB (available RAM unknown)"


def _available_ram() -> int | None:
    """Bytes of RAM available now (/proc/meminfo's MemAvailable); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _ran_a_round(race: Race, until: float) -> bool:
    """Run ``race`` on until ``until``; whether it ran a round."""
    before = race.rounds
    race.run(until)
    return race.rounds != before


def _unsettled(races: list[Race], state: str) -> list[Race]:
    """The races that stopped in ``state`` ("budget": the time ran out; "cap": the most rounds) unsettled."""
    return [r for r in races if r.state == state and not r.settled]


def _key(changes: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in changes.items()))


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _cuts_bytes_per_sample(r: Result, base: Result) -> bool:
    """``r`` was measured, cuts the plain step's bytes per sample by 5% or more, and does not drift."""
    return (r.status == "measured" and r.bytes_per_sample is not None and r.max_batch_guess is not None
            and r.bytes_per_sample < base.bytes_per_sample * 0.95 and _drift_ok(r))


def _next_size(lo: int, hi: int | None, guess: int, cap: int | None) -> int:
    """The next size a search runs: ``guess`` while no size failed, then bisection; 0 when the boundary is
    known within 5% or ``cap`` was reached."""
    if (hi is not None and hi - lo <= max(1, lo // 20)) or (cap is not None and lo >= cap):
        return 0
    b = guess if hi is None else (lo + hi) // 2 if lo else min(guess, hi - 1)
    return min(b, cap) if cap else b


def _fit_name(names: list[str]) -> str:
    """The name of a configuration tried for fit: its tricks in order, then its micro-batches."""
    return "+".join(sorted(n for n in names if not n.startswith("accumulate="))
                    + [n for n in names if n.startswith("accumulate=")])


def _smaller_peak(res: Result, closest: Result | None) -> Result:
    """Of ``res`` and ``closest`` (None: none yet), the one with the smaller peak (``closest`` on a tie)."""
    return res if closest is None or res.peak_bytes < closest.peak_bytes else closest


def _with_micro_batches(names: list[str], changes: dict[str, Any], batch: int
                        ) -> list[tuple[list[str], dict[str, Any]]]:
    """``changes`` with 2, 4, 8 ... micro-batches (accumulation), up to one sample each."""
    tries = []
    k = 2
    while k <= batch:
        tries.append((names + [f"accumulate={k}"], {**changes, "accumulate": k}))
        k *= 2
    return tries


def _all_ids(rows: list[Result]) -> tuple[str, ...]:
    return tuple(sorted({i for r in rows for i in r.ids}))


def _max_batch(r: Result) -> int:
    """Its largest batch: run where searched, else the straight line (to choose which to search)."""
    return r.max_batch or r.max_batch_guess or 0


def _compatible(rows: list[Result]) -> tuple[list[Result], dict[str, Any]]:
    """Each of ``rows`` in turn that sets no switch an earlier one set, and their changes together."""
    changes: dict[str, Any] = {}
    chosen: list[Result] = []
    for r in rows:
        if not set(r.changes) & set(changes) and _valid_together({**changes, **r.changes}):
            changes.update(r.changes)
            chosen.append(r)
    return chosen, changes


def _valid_together(changes: dict[str, Any]) -> bool:
    """The switches can be on together (``optimizer_in_backward`` with ``accumulate`` cannot, for one)."""
    try:
        TrainConfig().replace(**changes).validate()
    except UserError:
        return False
    return True


def _ratio_or_inf(r: Result) -> float:
    """Its time ratio against plain, for sorting fastest first; inf where it was not timed."""
    return r.ratio if r.ratio is not None and not math.isnan(r.ratio) else math.inf


def _gib(n: float | None) -> str:
    return human_bytes(n) if n is not None else "n/a"


