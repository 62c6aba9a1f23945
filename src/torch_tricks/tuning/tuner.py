"""``tune``: measure every applicable trick on the user's model and hardware, then recommend.

The plan, inside ``budget_s``:

1. the plain fp32 baseline (a model that cannot run the input stops here, with one
   line; on a CPU its step timed at one thread and at the process's count, the faster
   count every lane's), and a second, identical baseline: the A/A pair whose
   disagreement is the stated noise;
2. contenders first (:mod:`torch_tricks.tuning.contenders`): where the question is speed
   (the plain step fits, no memory limit given, no ``--fit``) only the speed tricks are set
   up now: drift against fp32 from the same seed, and memory. Where memory is asked for,
   every candidate is;
3. the race (:mod:`torch_tricks.tuning.race`): all of them and both baselines timed
   round-robin, a new random order every round. A candidate leaves once its question is
   answered (it cannot be ``MIN_EFFECT`` faster than plain; it is faster and slower than the
   best beyond their interval; a memory or cost trick, timed for its cost only, after the
   least rounds); the contenders and both baselines get the rounds, so the intervals and
   the noise narrow. The race stops when settled, or at its share of the budget (what the
   combinations and compile need is kept back);
4. the combinations for throughput (:mod:`torch_tricks.tuning.combine`): the speed tricks
   faster than plain and every compatible combination of them, built as the time allows
   (the fastest predicted first), raced jointly; the pick is the fastest beyond the margin,
   made simpler while a measured part of it is as fast. If the plain step does not fit the
   memory limit: first the single tricks that fit, else the memory tricks together, then
   with micro-batches (accumulation), until one fits, and the next trick on top while the
   pair wins;
5. ``compile`` on top of the best configuration (one compilation), raced against it,
   if the budget has room for it (also when it was not planned at the start, if the
   races settled early and saved the time);
6. the memory and cost tricks, where the question was speed: set up and timed for their
   cost in a short race of their own, as the time left holds them (else named, with the
   budget that would measure them);
7. the largest batch: all memory tricks that cut bytes per sample, together; its largest batch
   under the limit (and plain's) then *run*: a search on tiled batches, each a build and two
   steps with the peak measured (a straight line through two batch sizes only says where to
   start: attention and logits grow faster than linearly in a sequence);
8. what is left of the training budget goes to the races still open (more rounds), and
   every decision is taken again with the final rounds; ``report.stop_reason`` says
   whether the tune stopped settled or for the budget, and what was still open;
9. with ``data``, the loader; with ``deploy``, the inference chain (fixed shares).

A trick that fails (while checking, building, or in the middle of timing) is recorded
as failed with its reason, and the tune goes on. Nothing is printed; the progress bar
goes to stderr.

This module holds ``tune`` and the state one tune's parts share (:class:`_Tune`); each part is a
module of its own: the arguments (:mod:`.inputs`), the budget and its pacing (:mod:`.clock`), the
baselines, each candidate's set-up and the memory runs (:mod:`.builds`), the races (:mod:`.racing`),
what is faster and what to combine (:mod:`.decide`), what fits when plain does not
(:mod:`.under_limit`), the largest batch and the longest sequence (:mod:`.search_memory`), compile
(:mod:`.compiling`), and MFU, the distributed rows, data and deploy (:mod:`.other_phases`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from torch_tricks import batches as B
from torch_tricks._gc import new_objects_only
from torch_tricks.batches import example_batch  # the CLI's way in, re-exported
from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError
from torch_tricks.machine import LoadMonitor, available_cores, check_threads, gpu_processes
from torch_tricks.outputs import get_loss
from torch_tricks.seed import seed_everything
from torch_tricks.train.distributed import cleanup, init_distributed
from torch_tricks.tuning import distributed as D
from torch_tricks.tuning import fit as fit_mod
from torch_tricks.tuning.builds import Builds
from torch_tricks.tuning.candidates import Candidate, training_candidates
from torch_tricks.tuning.clock import Clock
from torch_tricks.tuning.combine import Combining
from torch_tricks.tuning.contenders import Contenders
from torch_tricks.tuning.compiling import Compiling
from torch_tricks.tuning.decide import DRIFT_TOLERANCE, MIN_EFFECT, Decisions
from torch_tricks.tuning.decide import _compatible, _valid_together  # noqa: F401  (re-exported: tests import them here)
from torch_tricks.tuning.inputs import (
    _build_model,
    _check_budget_and_steps,
    _check_skip_and_data,
    token_rows_of,
    _input_shapes,
    _memory_limit,
    _parameter_counts,
    _worlds,
    parse_size,
)
from torch_tricks.tuning.other_phases import OtherPhases
from torch_tricks.tuning.racing import Races
from torch_tricks.tuning.report import TUNED_KEYS, TuneReport
from torch_tricks.tuning.result import Result
from torch_tricks.tuning.search_memory import MemorySearch
from torch_tricks.tuning.throughput_batch import ThroughputBatch
from torch_tricks.tuning.under_limit import UnderLimit

if TYPE_CHECKING:
    from torch_tricks.tuning.race import Race

__all__ = ["tune", "example_batch", "parse_size", "TUNED_KEYS", "DRIFT_TOLERANCE", "MIN_EFFECT", "ASSUMED_RUN_STEPS"]

# The share of the budget the training phases leave unplanned at their end (see _Tune.train_end).
WALL_SLACK = 0.04
# With several processes (--processes N, or under torchrun) the distributed rows get this share of the budget.
DIST_SHARE = 0.4
# The run a one-off cost must pay back within, when the caller does not say (tune(steps=N)): compile is
# recommended only if its first call's extra seconds over what it extends, divided by the seconds it saves
# a step, is at most this (the break-even step count, stated in the report either way).
ASSUMED_RUN_STEPS = 10_000


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
    data: Any = None,
    deploy: bool = False,
    seed: int = 0,
    progress: bool = True,
    name: str = "",
    skip: Sequence[str] = (),
    processes: int | None = None,
    steps: int | None = None,
    fit: str | None = None,
    threads: int | None = None,
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
    dataset path for the loader measurement, or token rows of different lengths (a data set with
    ``lengths``, or a list of ``{"input_ids": ...}``): the ways to batch them (T39-T41) measured in
    real tokens a second (:mod:`~torch_tricks.tuning.token_phase`); ``deploy``: also measure the inference
    chain. ``skip``: trick names to leave out. Returns a :class:`TuneReport`; nothing
    is printed (the progress bar goes to stderr; ``progress=False`` hides it).

    ``processes=N`` (N >= 2) also measures ``ddp``, ``zero1`` and ``fsdp`` on N ranks that
    the tune launches itself (torchrun's engine, on this machine), with ``example_batch``
    as the global batch (N must divide it): see :mod:`torch_tricks.tuning.distributed`.
    Called on every rank under ``torchrun``, the tune does the same on the ranks it was
    given: rank 0 measures the single-process tricks while the others wait, then every
    rank times the modes; every rank returns the same report. The model and functions
    must pickle for ``processes`` (spawned ranks); under torchrun rank 0's are sent.

    ``threads``: the intra-op threads to tune at (and to write into tricks.toml); by default a CPU tune
    runs at the process's count and races one thread against it (``threads:1``): on a busy or small
    machine, OpenMP threads waiting for a core make every step slower.

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
    data = token_rows_of(data) if token_rows_of(data) is not None else data
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
                "batch_size": batch, "threads": _base_threads(threads, dev)}
    own_opt = optimizer_fn is not None
    report = TuneReport(model=name or type(model).__name__, batch=batch, device=str(dev),
                        optimizer="your optimizer_fn" if own_opt else optimizer, own_optimizer=own_opt,
                        memory_limit=limit, memory_limit_source=limit_source, budget_s=float(budget_s),
                        drift_tolerance=dict(DRIFT_TOLERANCE), min_effect=MIN_EFFECT,
                        inputs=_input_shapes(inputs_t), parameters=_parameter_counts(model),
                        run_steps=steps or ASSUMED_RUN_STEPS, run_steps_source="given" if steps else "assumed")
    batches = [B.to_device(example_batch, dev)]
    kw = {"loss_fn": loss_fn, "optimizer_fn": optimizer_fn}
    labels_in = B.labels_go_in(model, example_batch, loss_fn or get_loss("auto"))  # as TrainStep's default loss
    cands, skipped = training_candidates(model, inputs_t, dev, batch=batch, own_optimizer=optimizer_fn is not None,
                                         skip=skip, labels_in_forward=labels_in, optimizer=optimizer)
    report.skipped = skipped
    cands += _threads_candidate(base_cfg["threads"], threads, dev, skip)
    report.threads = {"threads": base_cfg["threads"], "given": threads is not None}

    from tqdm.auto import tqdm

    total = 4 + len(cands) + (data is not None) + bool(deploy) + bool(dist_world)
    bar = tqdm(total=total, desc="tune", unit="phase", disable=not progress, leave=False)
    monitor = LoadMonitor().start()  # other processes' CPU use during the tune: said in the report's first line
    with new_objects_only(), _threads_kept():  # the collections around every memory measurement skip the caller's
        _run_job(_Tune(model, batches, base_cfg, kw, limit, report, bar, t_start, float(budget_s), data is not None,
                       bool(deploy), dist_world=dist_world, channel=_channel, fit=fit_t, monitor=monitor), cands, data)
    report.machine = _machine_record(monitor, dev)
    report.elapsed_s = time.perf_counter() - t_start
    report.explain()  # every row's reason (the views take it again from the figures)
    return report


def _base_threads(threads: int | None, dev: torch.device) -> int:
    """The intra-op threads every lane runs at unless it changes them: ``threads`` (checked against this
    machine's cores), else the process's count (at most the cores it may use); 0 on a GPU (not a knob there)."""
    if threads is not None:
        return check_threads(threads, what="threads")
    if dev.type != "cpu":
        return 0
    return min(torch.get_num_threads(), available_cores())


def _threads_candidate(base: int, given: int | None, dev: torch.device, skip: Sequence[str]) -> list[Candidate]:
    """``threads:1`` (one intra-op thread against ``base``), raced like a speed trick, on a CPU where the
    caller did not fix the threads and the tune runs on more than one."""
    if given is not None or dev.type != "cpu" or base <= 1 or any(s.split(":")[0] == "threads" for s in skip):
        return []
    return [Candidate("threads:1", {"threads": 1}, "speed", tricks=("threads",),
                      note=f"one intra-op thread instead of {base}: where other processes hold cores, or a step "
                           "is too small to split, waiting threads make every step slower")]


@contextlib.contextmanager
def _threads_kept() -> Iterator[None]:
    """The process's intra-op thread count as it was before the tune, after it."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _machine_record(monitor: LoadMonitor, dev: torch.device) -> dict[str, Any]:
    """Other processes' CPU use during the tune (and, on CUDA, the other processes on the device)."""
    load = monitor.stop(hold=False)
    out = {"cores": load.cores, "foreign_cores": load.foreign_cores, "shared": load.shared(),
           "text": load.describe("during the tune")}
    if dev.type == "cuda":
        gpu = gpu_processes(dev)
        out["gpu"] = gpu.describe()
        out["shared"] = out["shared"] or gpu.shared()
    return out


def _run_job(job: _Tune, cands: list[Candidate], data: Any) -> None:
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



class _Tune(Clock, Builds, Contenders, Races, Decisions, Combining, UnderLimit, MemorySearch, Compiling, ThroughputBatch,
            OtherPhases):
    """One tune's state: the runners, the deadlines of its phases, the report it fills.

    Its parts, each in its module, work on this state: :class:`~.clock.Clock` (the budget and its pacing),
    :class:`~.builds.Builds` (the baselines, each candidate's set-up, the memory runs), :class:`~.racing.Races`,
    :class:`~.decide.Decisions` (what is faster, what to combine), :class:`~.under_limit.UnderLimit` (what fits
    when plain does not), :class:`~.search_memory.MemorySearch` (the largest batch, the longest sequence),
    :class:`~.compiling.Compiling` and :class:`~.other_phases.OtherPhases` (MFU, distributed, data, deploy).
    """

    def __init__(self, model, batches, base_cfg, kw, limit, report: TuneReport, bar, t0: float, budget: float,
                 data: bool, deploy: bool, dist_world: int = 0, channel: Any = None,
                 fit: fit_mod.FitTarget | None = None, monitor: LoadMonitor | None = None) -> None:
        self.model, self.batches, self.base_cfg, self.kw = model, batches, base_cfg, kw
        self.monitor = monitor  # other processes' CPU use so far (the compile estimate scales with it)
        self.fit = fit
        self.limit, self.report, self.bar = limit, report, bar
        self.deadline = t0 + budget
        # the distributed rows, data and deploy get fixed shares of the budget; training gets the rest
        self.dist_world, self.channel = dist_world, channel
        self.dist_share = DIST_SHARE * budget if dist_world else 0.0
        self.data_share = 0.15 * budget if data else 0.0
        # the training phases end a little before their share: what overruns an estimate (a step slower under
        # another job's load, a set-up, the report) is absorbed there, not past the budget
        self.train_end = (self.deadline - self.dist_share - self.data_share - (0.25 * budget if deploy else 0.0)
                          - WALL_SLACK * budget)
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
        self.compile_modes: list[tuple[Result, Result]] = []  # (a compile mode's row, what it was measured as)
        self.later_need = 0.0  # the memory and cost tricks' least set-up, after compile
        self.compile_skip_reason = ""
        self.memory_s = 0.0  # what plain's memory run at the example batch took (the largest-batch search's unit)
        self.memory_reserve = 0.0  # kept back from the race and the combinations for the memory tricks together
        self.efficiency_reserve = 0.0  # kept back for the MFU figures (0: not measured, the report says why)
        self.joint: Race | None = None  # the joint race of the faster tricks' combinations (tuning.combine)
        self.joint_rows: list[Result] = []
        self.joint_not_built: list[str] = []
        self.memory_later = False  # the speed tricks' memory runs wait until after compile (tuning.contenders)
        self.later: Race | None = None  # the memory and cost tricks' race, after the speed question
        self.later_res: list[Result] = []

    def run(self, cands: list[Candidate], data: Any) -> None:
        """The plan (see the module's docstring): the baselines, each candidate's drift and memory, the race,
        the combinations and the largest batch, compile, more rounds, then the distributed rows, data and deploy."""
        if not self._baselines(cands):
            return
        self._reserve_efficiency()
        compile_rows, others = self._plan_compile(cands)
        first, later = self._contenders_first(others)
        self.later_need = sum(self._setup_need(c) for c in later)
        results = self._set_up_candidates(first)
        later_res = [Result(c.name, c.goal, c.changes, c.ids, note=c.note) for c in later]
        self.report.results = results + later_res + compile_rows
        self._race_singles(results)
        self._combinations()
        if compile_rows:
            self._compile_phase(compile_rows)
        self._later_phase(later, later_res)
        self._largest_batch_phase()
        self._throughput_batch_phase()
        self._more_rounds_phase()
        results = self.report.results
        self._close_training(results)
        self._efficiency_phase()
        self._other_phases(data)
        self.report.phase_s = {k: round(v, 2) for k, v in self.phase_s.items()}

    def _combinations(self) -> None:
        """4. combinations for throughput (under the memory limit)."""
        t_combo = time.perf_counter()
        self.phase("combinations")
        self._best_throughput()
        self.phase_s["combinations"] = time.perf_counter() - t_combo
        self.bar.update(1)

    def _largest_batch_phase(self) -> None:
        """5. the largest batch (and with ``--fit seq`` the longest sequence), with the memory tricks measured."""
        t = time.perf_counter()
        self.phase("largest batch")
        self._largest_batch()
        if self.fit is not None and self.fit.search_seq:
            self.phase("longest sequence")
            self._longest_seq()
        self.phase_s["largest batch"] = time.perf_counter() - t
        self.bar.update(1)

    def _close_training(self, results: list[Result]) -> None:
        """The notes and the stop reason of the training part; the model copies are freed."""
        report = self.report
        report.notes += self.choice_notes
        report.stop_reason = self._stop_reason()
        for res in results + report.combos:
            res.runner = None  # free the model copies
        self.base = self.twin = None
        self.side.clear()

