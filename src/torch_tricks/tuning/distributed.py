"""The tune's distributed rows: ``ddp``, ``zero1`` and ``fsdp`` on N ranks, against one process (T18-T20).

``tune(..., processes=N)`` (CLI ``--processes N``) launches N ranks itself with torchrun's
own engine (:func:`torch.distributed.launcher.api.elastic_launch`: a c10d rendezvous on
localhost, the ranks as spawned processes); a tune started under ``torchrun`` uses the
ranks it was given. Either way every rank runs :func:`measure_modes` on the same
:class:`DistJob` (the model, the tune's global batch, the recommended configuration):

* the global batch is split across the ranks (the world size must divide it), so every
  mode trains on the very samples the one-process tune measured;
* **lanes**: each mode's step on every rank (``TrainStep`` under ``distributed = MODE``:
  the step ``fit`` and ``Tricks`` run), and two references on rank 0 alone while the
  others wait: *one process* (the global batch, the threads one process gets: what the
  user would run without torchrun) and *one rank* (a rank's share of the batch on a rank's
  threads: the denominator of the scaling efficiency);
* **memory** per rank: the peak of live tensor bytes from building the lane through its
  first steps (CUDA's counter, else :class:`~torch_tricks.inspect.memory.LiveTensors`,
  which follows DTensor shards and FSDP2's storage resizes), and the parameters,
  gradients and optimizer state this rank holds (local shards), the largest rank's;
* **drift**: the global loss of the first steps (the mean over ranks) against one
  process on the same batch: a mode that trains something else is caught here;
* **time**: round-robin rounds, a new order every round, the same order on every rank
  (seeded), each step between two barriers; rank 0 decides when to stop: when the answer is
  settled (:func:`_settled`: one process fits, and every mode either cannot beat it beyond
  the margin or is known to within half of it; checked from ``_SETTLE_ROUNDS`` rounds on,
  whenever the rounds have grown by a fifth), else at its deadline or ``_MAX_ROUNDS``.

:func:`recommend` (:mod:`torch_tricks.tuning.distributed_recommend`, re-exported here) picks,
among the configurations that fit the per-rank memory limit and do not drift, the fastest; a
mode only where it beats one process beyond the margin, and of modes within the margin of the
fastest, the one with the smallest per-rank peak.

Written here rather than taken from a library: the measurement is the tuner's own
(the same step, memory tracker and paired ratios as its single-process race).
"""

from __future__ import annotations

import copy
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from torch_tricks import batches as B
from torch_tricks.data.prefetch import batch_nbytes
from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError, one_line
from torch_tricks.train.distributed import any_rank, barrier, cleanup, init_distributed, is_dist, reduce_mean
from torch_tricks.train.loop import TrainStep
from torch_tricks.tuning.distributed_recommend import MODES, ONE_PROCESS, ONE_RANK, recommend  # re-exported
from torch_tricks.tuning.measure import _Peak, paired_ratio

__all__ = ["MODES", "DistJob", "launched_world", "check_world", "launch", "unsendable", "measure_modes", "recommend",
           "usable_cores", "local_bytes", "optimizer_state_bytes"]

_MIN_ROUNDS, _SETTLE_ROUNDS, _MAX_ROUNDS = 5, 20, 60


@dataclass
class DistJob:
    """What every rank needs to measure the distributed rows (picklable: it crosses to spawned ranks)."""

    model: nn.Module  # on the CPU; each rank moves its copies to its device
    batch: Any  # the tune's global batch, on the CPU
    loss_fn: Callable[..., torch.Tensor] | None
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None
    config: dict[str, Any]  # TrainConfig keys: the tune's base and the recommended changes
    changes: dict[str, Any]  # the recommended changes (reported)
    limit: int  # memory limit of one process (the device's, or the host's RAM)
    budget_s: float  # seconds for the whole phase (bounds the collectives' timeout)
    deadline: float = 0.0  # when the phase must end: time.time() on rank 0's host (spawning the ranks counts)
    seed: int = 0
    modes: tuple[str, ...] = MODES
    min_effect: float = 0.02  # the smallest speed-up worth a mode (the tuner's MIN_EFFECT): when the rounds may stop
    threads: int | None = None  # intra-op threads per rank (CPU); None leaves them
    one_process_threads: int | None = None  # threads of the one-process lane (CPU)
    notes: list[str] = field(default_factory=list)


# -- who runs where -------------------------------------------------------------------------------

def launched_world() -> int:
    """The world size torchrun gave this process (1 outside torchrun)."""
    if "RANK" not in os.environ:
        return 1
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_world(world: int, batch: int, device: torch.device) -> None:
    """One line for a world size the tune cannot split the batch over (or has no devices for)."""
    if world < 2:
        raise UserError(f"--processes {world}: give 2 or more (one process is the plain tune)")
    if batch % world:
        raise UserError(f"the batch {batch} is the global batch, split across {world} processes, and {world} does "
                        f"not divide it: give --batch a multiple of {world} (e.g. {_multiples_near(batch, world)})")
    if device.type == "cuda" and "RANK" not in os.environ and world > torch.cuda.device_count():
        raise UserError(f"--processes {world} on cuda, but this machine has {torch.cuda.device_count()} CUDA "
                        "device(s): one process per device at most")


def _multiples_near(batch: int, world: int) -> str:
    """The multiples of ``world`` either side of ``batch`` (the one above alone where the one below is 0)."""
    lo, hi = (batch // world) * world, (batch // world + 1) * world
    return f"{lo} or {hi}" if lo else f"{hi}"


def launch(job: DistJob, processes: int) -> dict[str, Any]:
    """Run :func:`measure_modes` on ``processes`` spawned ranks (torchrun's engine); rank 0's result.

    A rank that fails returns its error line (the result then says ``failed``); a rank
    that dies (killed, out of memory) fails the launch, which is reported the same way.
    """
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    why = unsendable(job)
    if why:
        return _failed(why)
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=f"tune-{uuid.uuid4().hex[:8]}",
                       rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2,
                       start_method="spawn")
    try:
        out = elastic_launch(cfg, _rank_entry)(job)
    except Exception as exc:  # a rank died: ChildFailedError names it
        first = str(exc).strip().splitlines()
        return _failed(f"the {processes} ranks did not finish: {type(exc).__name__}"
                       + (f": {first[0]}" if first else ""))
    result = out.get(0) if isinstance(out, dict) else None
    if not isinstance(result, dict):
        return _failed("rank 0 returned no result")
    return result


def unsendable(job: DistJob) -> str:
    """Why ``job`` cannot be sent to spawned ranks ('' if it can): everything in it must pickle."""
    import pickle

    try:
        pickle.dumps(job)
    except Exception as exc:
        return (f"the model, batch or loss/optimizer functions cannot be sent to the ranks (they must pickle: define "
                f"them at module level, or run the tune under torchrun yourself): {one_line(exc, with_type=True)}")
    return ""


def _rank_entry(job: DistJob) -> dict[str, Any]:
    """One spawned rank: join the group, measure, leave; errors come back as a result, not a traceback."""
    import warnings

    warnings.simplefilter("ignore")
    try:
        if job.threads:
            torch.set_num_threads(job.threads)
        init_distributed(timeout=max(job.budget_s * 2, 60.0) + 120.0, device=job.config.get("device", "auto"))
        result = measure_modes(job)
    except Exception as exc:
        # no farewell barrier: the others may be inside a collective this rank left; its exit ends theirs
        if dist.is_available() and dist.is_initialized():
            import gc

            gc.collect()  # what holds the group goes first (see train.distributed.cleanup)
            dist.destroy_process_group()
        return _failed(one_line(exc, with_type=True))
    cleanup()
    return result


def _failed(reason: str) -> dict[str, Any]:
    return {"status": "failed", "reason": reason, "rows": []}


# -- on every rank ----------------------------------------------------------------------------------

class _Lane:
    """One configuration timed in the rounds: a mode on every rank, or a reference on rank 0 alone."""

    def __init__(self, name: str, mode: str, everyone: bool, batch: Any, threads: int | None) -> None:
        self.name, self.mode, self.everyone, self.batch, self.threads = name, mode, everyone, batch, threads
        self.step: Any = None
        self.row: dict[str, Any] = {"name": name, "status": "pending", "reason": ""}
        self.times: list[float] = []

    def runs_here(self, rank: int) -> bool:
        return self.everyone or rank == 0

    def __call__(self) -> torch.Tensor:
        with _threads(self.threads):
            return self.step(self.batch)


def measure_modes(job: DistJob) -> dict[str, Any]:
    """Every lane's memory, drift and time, on every rank of the process group; the result (all ranks)."""
    t_start = time.perf_counter()
    info = init_distributed(device=job.config.get("device", "auto"))
    if not info.initialized:
        raise UserError("the distributed rows need a process group: run under torchrun or with --processes N")
    rank, world = info.rank, info.world_size
    dev = info.device
    total = B.batch_size(job.batch)
    check_world(world, total, torch.device("cpu"))
    per = total // world
    local = _shard(job.batch, rank, per)
    cfg = _lane_config(job, dev)
    lanes = _lanes(job, local)
    left = (job.deadline - time.time()) if job.deadline else job.budget_s  # rank 0's clock decides
    deadline = t_start + left
    build_end = t_start + 0.6 * left

    # 1. build each lane: memory (peak, what the rank holds) and the losses of its first steps
    for lane in lanes:
        _build_on_every_rank(lane, job, cfg, rank, world, build_end)
    # 2. the rounds: every live lane once per round, a new order each (the same on every rank)
    live = [lane for lane in lanes if lane.row["status"] == "measured"]
    rounds, settled = _rounds(live, job.seed, rank, dev, deadline, lambda: _settled(lanes, job.limit, job.min_effect))

    # 3. rank 0's clock is the one that counts; the figures against the references
    result = {"status": "measured", "reason": "", "processes": world, "backend": dist.get_backend(),
              "device": dev.type, "global_batch": total, "per_rank_batch": per, "rounds": rounds,
              "settled": settled,
              "threads_per_rank": job.threads or torch.get_num_threads(),
              "one_process_threads": job.one_process_threads or torch.get_num_threads(),
              "changes": dict(job.changes), "config": {k: v for k, v in cfg.items() if k != "device"},
              "notes": list(job.notes), "seconds": 0.0}
    rows = [_figures(lane, lanes, per, total, world) for lane in lanes]
    result["rows"] = rows
    result["seconds"] = time.perf_counter() - t_start
    for lane in lanes:
        lane.step = None  # free the model copies
    return result


def _lane_config(job: DistJob, dev: torch.device) -> dict[str, Any]:
    """The lanes' TrainConfig keys: the job's, on this rank's device, without compile (one compilation per
    lane and rank would eat the phase: measured eagerly)."""
    cfg = {**job.config, "device": str(dev), "seed": job.seed}
    cfg.pop("compile", None)
    return cfg


def _shard(batch: Any, rank: int, per: int) -> Any:
    """This rank's ``per`` samples of the global batch (tensors without a batch dimension as they are)."""
    return B.map_tensors(batch, lambda t: t[rank * per:(rank + 1) * per] if t.dim() > 0 else t)


def _lanes(job: DistJob, local: Any) -> list[_Lane]:
    """The two references (one process on the global batch, one rank on its share), then each mode."""
    lanes = [_Lane(ONE_PROCESS, "off", False, job.batch, job.one_process_threads),
             _Lane(ONE_RANK, "off", False, local, job.threads)]
    return lanes + [_Lane(m, m, True, local, job.threads) for m in job.modes]


def _build_on_every_rank(lane: _Lane, job: DistJob, cfg: dict[str, Any], rank: int, world: int,
                         build_end: float) -> None:
    """Build ``lane`` where it runs (skipped past ``build_end``, but never a reference); every rank then
    agrees on whether it failed (:func:`_agree_on_build`), and waits for the others."""
    if _decide(time.perf_counter() > build_end and lane.name not in (ONE_PROCESS, ONE_RANK)):
        lane.row.update(status="skipped", reason="over the budget of the distributed phase: raise "
                                                 "--budget-seconds")
        return
    error = ""
    if lane.runs_here(rank):
        try:
            with _threads(lane.threads):
                _build(lane, job, {**cfg, "distributed": lane.mode, "batch_size": B.batch_size(lane.batch)})
        except Exception as exc:
            error = one_line(exc, with_type=True)
    _agree_on_build(lane, error, world)
    barrier()


def _agree_on_build(lane: _Lane, error: str, world: int) -> None:
    """A mode: every rank knows whether any failed (then every rank drops it), and the row takes the
    largest rank's state and peak; a reference (rank 0 alone): rank 0's error, sent to the others."""
    if lane.everyone:
        _agree_on_mode(lane, error, world)
        return
    got: list[Any] = [error]
    dist.broadcast_object_list(got, src=0)
    if got[0]:
        _fail(lane, got[0])
    else:
        lane.row["status"] = "measured"


def _agree_on_mode(lane: _Lane, error: str, world: int) -> None:
    """Every rank's error and figures to every rank: the first error fails the mode everywhere, else the
    row takes the largest rank's state and peak."""
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, (error, lane.row.get("state"), lane.row.get("peak_bytes"),
                                    lane.row.get("losses")))
    bad = [f"rank {r}: {e[0]}" for r, e in enumerate(errors) if e[0]]
    if bad:
        _fail(lane, bad[0])
        return
    _take_the_largest_rank(lane.row, errors)
    lane.row["status"] = "measured"


def _take_the_largest_rank(row: dict[str, Any], gathered: list[Any]) -> None:
    """The row's state and peak: the largest rank's (and every rank's, per rank), from the gathered figures."""
    states = [e[1] for e in gathered]
    row["state"] = max(states, key=lambda s: s["total"])
    row["state_per_rank"] = [s["total"] for s in states]
    row["peak_bytes"] = max(e[2] for e in gathered)
    row["peak_per_rank"] = [e[2] for e in gathered]


def _fail(lane: _Lane, reason: str) -> None:
    lane.step = None
    lane.row.update(status="failed", reason=reason)


def _rounds(live: list[_Lane], seed: int, rank: int, dev: torch.device, deadline: float,
            settled: Callable[[], bool]) -> tuple[int, bool]:
    """(rounds, whether they stopped settled): every lane once per round, each step between two barriers,
    a new order each round (the same on every rank), until ``settled()`` (asked from ``_SETTLE_ROUNDS``
    rounds on, whenever the rounds have grown by a fifth: not after every round, so a difference that is
    not there is not found by looking too often), ``deadline`` or ``_MAX_ROUNDS``, on rank 0's clock and
    answers (at least ``_MIN_ROUNDS``)."""
    rng = random.Random(seed)
    rounds = 0
    last_round = 0.0
    asked_at = 0
    is_settled = False
    while live:
        if rounds >= _SETTLE_ROUNDS and rounds >= asked_at * 1.2:
            asked_at, is_settled = rounds, settled()
        now = time.perf_counter()
        more = rounds < _MIN_ROUNDS or (rounds < _MAX_ROUNDS and now + last_round < deadline and not is_settled)
        if _decide(not more, src_only=True):  # rank 0's clock and answers say stop
            break
        t_round = time.perf_counter()
        order = list(live)
        rng.shuffle(order)
        for lane in order:
            _time_step(lane, rank, dev)
        rounds += 1
        last_round = time.perf_counter() - t_round
    return rounds, bool(_decide(is_settled, src_only=True)) if live else False


def _settled(lanes: list[_Lane], limit: int, min_effect: float) -> bool:
    """More rounds would not change the recommendation: one process was timed and fits ``limit``, and
    every mode still timed either cannot beat it beyond ``min_effect`` (its ratio's optimistic end is at
    or above ``1 - min_effect``) or has a ratio known to within ``min_effect / 2``. Where one process
    does not fit, the pick among the modes is by their time alone: the rounds run on."""
    one = lanes[0]
    peak = one.row.get("peak_bytes")
    if one.row.get("status") != "measured" or not one.times or peak is None or peak > limit:
        return False
    for lane in lanes:
        if lane.everyone and lane.step is not None and lane.times:
            ratio, half = paired_ratio(lane.times, one.times)
            if math.isnan(ratio) or not (ratio - half >= 1 - min_effect or half <= min_effect / 2):
                return False
    return True


def _time_step(lane: _Lane, rank: int, dev: torch.device) -> None:
    """One step of ``lane`` between two barriers (every rank waits for the slowest), timed."""
    barrier()
    t0 = time.perf_counter()
    if lane.runs_here(rank) and lane.step is not None:
        lane()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    barrier()
    lane.times.append(time.perf_counter() - t0)


def _build(lane: _Lane, job: DistJob, cfg: dict[str, Any]) -> None:
    """The lane's TrainStep on a copy of the model, with its memory and first losses measured."""
    dev = resolve_device(cfg.get("device", "cpu"))
    with _Peak(dev) as pk:
        step = TrainStep(copy.deepcopy(job.model), loss_fn=job.loss_fn, optimizer=job.optimizer_fn, config=cfg)
        grads = step.gradients(lane.batch)  # after backward, before a step frees them
        grad_bytes = sum(local_bytes(g) for g in grads)
        del grads
        losses = []
        for _ in range(3):
            loss = step(lane.batch).detach()
            if lane.everyone and is_dist():
                loss = reduce_mean(loss)  # equal shares of the global batch: the mean over ranks is its loss
            losses.append(float(loss))
    params = sum(local_bytes(p) for p in step.model.parameters())
    opt = optimizer_state_bytes(step.optimizer)
    lane.row["state"] = {"params": params, "grads": grad_bytes, "optimizer": opt, "total": params + grad_bytes + opt}
    lane.row["peak_bytes"] = pk.peak + _nbytes(lane.batch)
    lane.row["losses"] = losses
    lane.step = step


def _figures(lane: _Lane, lanes: list[_Lane], per: int, total: int, world: int) -> dict[str, Any]:
    """One row: step time, throughput, against one process and one rank (paired by round), drift."""
    row = dict(lane.row)
    row["ranks"] = world if lane.everyone else 1
    row["batch_per_rank"] = per if lane.name != ONE_PROCESS else total
    if lane.times:
        _timed_figures(row, lane, lanes, total)
    return row


def _timed_figures(row: dict[str, Any], lane: _Lane, lanes: list[_Lane], total: int) -> None:
    """The figures of a lane that was timed: step, throughput, against the references, and drift."""
    one, single = lanes[0], lanes[1]
    step_s = statistics.median(lane.times)
    row["step_s"] = step_s
    row["rounds"] = len(lane.times)
    samples = total if lane.everyone else row["batch_per_rank"]
    row["samples_per_s"] = samples / step_s
    if one.times and lane is not one:
        _against_one_process(row, lane, one, samples / total)
    if single.times and lane.everyone:
        row["scaling_efficiency"] = _scaling_efficiency(lane, single)
    if lane.everyone and _comparable(row.get("losses"), one.row.get("losses")):
        row["loss_drift"] = _loss_drift(row["losses"], one.row["losses"])


def _against_one_process(row: dict[str, Any], lane: _Lane, one: _Lane, share: float) -> None:
    """The step-time ratio (< 1: a step takes less time than one process's on the global batch), and the
    throughput ratio: the ``share`` of the global batch this lane trains per step, over that."""
    ratio, half = paired_ratio(lane.times, one.times)
    row["vs_one_process"], row["vs_one_process_half_ci"] = ratio, half
    if ratio and math.isfinite(ratio):
        row["throughput_vs_one_process"] = share / ratio
        row["throughput_vs_one_process_half_ci"] = share * _inv_half(ratio, half)


def _scaling_efficiency(lane: _Lane, single: _Lane) -> float | None:
    """One rank's step time over the mode's, paired by round (1.0: each rank as fast as one rank alone)."""
    ratio, _ = paired_ratio(lane.times, single.times)
    return 1 / ratio if ratio else None


def _comparable(mine: list[float] | None, base: list[float] | None) -> bool:
    """Both lanes have losses of the same steps."""
    return bool(base and mine and len(base) == len(mine))


def _loss_drift(mine: list[float], base: list[float]) -> float:
    """The largest loss difference from one process's, relative to its first loss (inf if not finite)."""
    if not all(math.isfinite(x) for x in mine):
        return math.inf
    return max(abs(a - b) for a, b in zip(mine, base)) / max(abs(base[0]), 1e-12)


# -- helpers ----------------------------------------------------------------------------------------

class _threads:
    """Intra-op threads inside (CPU), the previous number after; ``None`` leaves them."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.n and self.n != self.before:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)


def _decide(flag: bool, src_only: bool = False) -> bool:
    """One decision for every rank: any rank's flag (or rank 0's, with ``src_only``)."""
    if not is_dist():
        return flag
    if src_only:
        got = [flag]
        dist.broadcast_object_list(got, src=0)
        return bool(got[0])
    return any_rank(flag)


def local_bytes(t: Any) -> int:
    """Bytes this rank holds for ``t``: a DTensor's local shard, else the tensor."""
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state this rank holds (ZeRO: its local optimizer's); step counters left out."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    return sum(local_bytes(v) for per in inner.state.values() for v in per.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _nbytes(batch: Any) -> int:
    return batch_nbytes(batch)


def _inv_half(ratio: float, half: float) -> float:
    """Half-width of ``1 / ratio``'s interval from ``ratio``'s (inf when it reaches 0)."""
    if ratio <= half:
        return math.inf
    return (1 / (ratio - half) - 1 / (ratio + half)) / 2


