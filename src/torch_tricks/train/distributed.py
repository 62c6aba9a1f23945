"""Multi-process data-parallel training with PyTorch's own machinery (catalogue T18, T20).

One process per device, launched by ``torchrun``; :class:`~torch.nn.parallel.DistributedDataParallel`
(DDP), not ``DataParallel`` (one process driving many devices is GIL-bound and copies the
model to every device each step); a :class:`~torch.utils.data.distributed.DistributedSampler`
so each rank reads its own shard. Everything here is a thin layer over ``torch.distributed``
that adds what the plain API leaves to the user:

* :func:`init_distributed` reads torchrun's environment and is a no-op outside it, so the
  same training script runs unchanged as one process or under ``torchrun``.
* :func:`all_agree` / :func:`any_rank` turn a per-rank flag (loss is NaN, out of memory,
  time to stop) into one collective decision. If ranks decide alone, one skips a step the
  others take, and the others wait forever in DDP's gradient all-reduce: a hang, not an error.
* :func:`no_sync_if` skips DDP's gradient all-reduce on gradient-accumulation inner steps.
* :func:`watch_ranks` turns a lost rank (killed, crashed, its machine gone) into one line
  naming it and the step on every rank that is left, instead of a hang, a wall of
  tracebacks or a bare SIGTERM from torchrun's agent.

Every helper works when ``torch.distributed`` is not initialised (one process): it then
does the single-process thing (returns the flag, does not wait, returns the tensor).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from torch_tricks.device import resolve as resolve_device
from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import register_trick
from torch_tricks.train.syncbn import convert_sync_batchnorm

__all__ = [
    "DistInfo",
    "init_distributed",
    "cleanup",
    "is_dist",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "barrier",
    "all_agree",
    "any_rank",
    "reduce_mean",
    "all_reduce_sum",
    "wrap_ddp",
    "unwrap_model",
    "distributed_sampler",
    "no_sync_if",
    "RankLost",
    "watch_ranks",
    "lost_ranks",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: rank, world size, its device, and whether a group exists."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    is_main: bool = True
    initialized: bool = False
    backend: str | None = None


def init_distributed(
    backend: str | None = None,
    *,
    timeout: float | datetime.timedelta | None = None,
    device: str | torch.device | None = "auto",
) -> DistInfo:
    """Join the process group torchrun set up; a single-process :class:`DistInfo` otherwise.

    torchrun exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``; without ``RANK``/``WORLD_SIZE`` this returns ``DistInfo()`` (rank 0 of 1,
    not initialised) and touches nothing, so one script serves both launches. ``device``
    ``"auto"`` trains on CUDA when this torch sees it, with NCCL, else on the CPU with
    gloo; ``"cpu"`` keeps the ranks on the CPU (gloo) on a machine with GPUs too. On CUDA
    the process's device is ``cuda:LOCAL_RANK`` and is made current, so that NCCL and every
    ``.cuda()`` without an index use this process's own device rather than all piling
    onto device 0.
    ``timeout`` (seconds or a timedelta) bounds every collective: a rank that never arrives
    then raises instead of hanging the others forever. Calling it again returns the
    existing group's info.
    """
    if is_dist():
        return _current_info()
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return DistInfo(device=resolve_device(device))
    if not dist.is_available():
        raise UserError("this torch build has no torch.distributed: install a build with distributed support")
    rank = _env_int("RANK")
    world_size = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", default=rank)
    _check_launch(rank, world_size)

    cuda = resolve_device(device).type == "cuda"
    if backend is None:
        backend = _default_backend(cuda)
    device = _own_cuda_device(local_rank) if cuda else torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = _as_timedelta(timeout)
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world_size, **kwargs)
    return DistInfo(rank, world_size, local_rank, device, rank == 0, True, backend)


def _check_launch(rank: int, world_size: int) -> None:
    """What torchrun exports beside RANK and WORLD_SIZE is there, and the rank fits the world size."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UserError(f"{name} is not set: launch with torchrun, or export MASTER_ADDR and MASTER_PORT")
    if not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world_size}: check the launcher's environment")


def _own_cuda_device(local_rank: int) -> torch.device:
    """``cuda:LOCAL_RANK``, made current (so NCCL and ``.cuda()`` use it, not device 0)."""
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise UserError(
            f"LOCAL_RANK={local_rank} but only {n} CUDA device(s): start at most {n} processes per node"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _default_backend(cuda: bool) -> str:
    """NCCL for CUDA ranks where this build has it, else gloo."""
    return "nccl" if cuda and dist.is_nccl_available() else "gloo"


def _as_timedelta(timeout: float | datetime.timedelta) -> datetime.timedelta:
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)


def cleanup() -> None:
    """Leave the process group (a no-op when there is none); call once at the end, on every rank.

    A rank that tears gloo down while its peer is still inside a collective with it (rank 0
    saving a checkpoint, say, or the last message of a barrier still on its way) can make
    the peer's gloo thread abort the process ("terminate called without an active
    exception"). So all ranks first meet at a barrier (every collective is done), then
    once more in the job's store, outside gloo (every rank has left that barrier too);
    only then does any rank close its connections. And what holds the group (a DDP or FSDP
    model, a ZeRO optimizer: FSDP's hooks keep its modules in reference cycles) must go
    before the group does: destroyed after it, at the interpreter's exit, it aborts the
    process the same way (the benchmark's FSDP ResNet-50 ranks: 2 runs in 6, none in 8
    with a collection first). So the garbage is collected first; drop what you still hold
    (a model, a ``Tricks``) before calling this.
    """
    if is_dist():
        import gc

        gc.collect()
        try:
            dist.barrier()
            _store_barrier()
        except Exception:  # a peer already gone: leave anyway
            pass
        dist.destroy_process_group()


_LEFT = [0]  # cleanups so far in this process: every rank counts the same, so the key is the same


def _store_barrier(timeout_s: float = 60.0) -> None:
    """Wait until every rank has posted in the job's store (a meeting point outside gloo's connections)."""
    import time

    store = dist.distributed_c10d._get_default_store()
    _LEFT[0] += 1
    key = f"torch_tricks/left/{_LEFT[0]}"
    world = dist.get_world_size()
    n = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while n < world and time.monotonic() < deadline:
        time.sleep(0.005)
        n = store.add(key, 0)


def is_dist() -> bool:
    """Whether a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank: from the group, else torchrun's ``RANK``, else 0."""
    if is_dist():
        return dist.get_rank()
    return _env_int("RANK", default=0)


def get_world_size() -> int:
    """Number of processes: from the group, else 1."""
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    """Whether this is rank 0, the one that writes files and logs.

    Without a process group it falls back to torchrun's ``RANK``, so a script launched by
    torchrun that never initialised a group still writes from one process only.
    """
    return get_rank() == 0


def barrier() -> None:
    """Wait for every rank; a no-op without a process group."""
    if not is_dist():
        return
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def all_agree(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank (one all-reduce MIN); every rank gets the same answer.

    Use it for decisions every rank must take together, e.g. "continue training".
    """
    return _reduce_flag(flag, "min")


def any_rank(flag: bool) -> bool:
    """True if ``flag`` is true on at least one rank (one all-reduce MAX); every rank gets the same answer.

    Use it for skip / stop / OOM-retry: if one rank hit a NaN loss or ran out of memory,
    all of them skip the step, so none waits in DDP's all-reduce for a rank that left.
    """
    return _reduce_flag(flag, "max")


def reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of ``tensor`` over ranks (a detached copy), for logging a loss every rank agrees on."""
    out = tensor.detach().clone()
    if not is_dist():
        return out
    world = dist.get_world_size()
    if not out.is_floating_point():
        out = out.double()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / world


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over ranks (a detached copy, same dtype), e.g. metric totals and counts."""
    out = tensor.detach().clone()
    if is_dist():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return model


@register_trick(
    "ddp",
    ids=("T18",),
    kind="train",
    trades="one process per device and a gradient all-reduce overlapped with backward, for near-linear scaling",
    needs="launched by torchrun (one process per device); a DistributedSampler for the data",
    config_key="distributed",
    measured_in="benchmarks/distributed.py",
)
def wrap_ddp(model: nn.Module, info: DistInfo, *, sync_bn: bool = False, **kw: Any) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in DDP; unchanged when not distributed.

    ``device_ids=[local_rank]`` on CUDA (one device per process), none on CPU, where DDP
    refuses them. ``sync_bn=True`` first converts BatchNorm layers to synchronised ones
    (:func:`torch_tricks.train.syncbn.convert_sync_batchnorm`, which works on gloo/CPU too;
    they behave exactly like BatchNorm in a single process).
    Other keywords go to :class:`~torch.nn.parallel.DistributedDataParallel`.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"wrap_ddp needs an nn.Module, not {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    if isinstance(model, nn.DataParallel):
        raise UserError("the model is wrapped in DataParallel: pass model.module (DDP replaces DataParallel)")
    if sync_bn:
        model = convert_sync_batchnorm(model)
    model = model.to(info.device)
    if not info.initialized:
        return model
    if info.device.type == "cuda":
        kw.setdefault("device_ids", [info.device.index])
        kw.setdefault("output_device", info.device.index)
    return nn.parallel.DistributedDataParallel(model, **kw)


def distributed_sampler(
    dataset: Any,
    info: DistInfo,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> torch.utils.data.distributed.DistributedSampler:
    """A :class:`DistributedSampler` giving this rank its shard (the whole set for one process).

    Rank and world size come from ``info``, so it also works before (or without) a process
    group. Call ``sampler.set_epoch(epoch)`` every epoch, or every epoch reuses one shuffle.
    Without ``drop_last`` the sampler pads with repeated samples so every rank gets the same
    number of batches (an uneven count would leave one rank waiting in all-reduce).
    """
    return torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=info.world_size, rank=info.rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def no_sync_if(model: nn.Module, condition: bool) -> ContextManager[Any]:
    """``model.no_sync()`` when ``condition`` and the model is DDP; a null context otherwise.

    For gradient accumulation: on the inner steps gradients only need to add up locally;
    DDP's all-reduce is then needed once, on the step that calls ``optimizer.step()``.
    """
    if condition and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------- helpers


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise UserError(f"{name} is not set: launch with torchrun")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r} is not an integer: check the launcher's environment") from None


def _current_info() -> DistInfo:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK", default=rank)
    backend = str(dist.get_backend())
    on_cuda = "nccl" in backend and torch.cuda.is_available()  # a gloo group on a GPU machine trains on the CPU
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    return DistInfo(rank, world, local_rank, device, rank == 0, True, backend)


def _comm_device() -> torch.device:
    """The device collective tensors must live on: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce_flag(flag: bool, how: str) -> bool:
    if not is_dist():
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN if how == "min" else dist.ReduceOp.MAX)
    return bool(t.item())


# -- a lost rank ---------------------------------------------------------------------------------

class RankLost(UserError):
    """A rank of the run died or stopped answering; the message names it and the step."""


class _Terminated(BaseException):
    """SIGTERM, as an exception in the main thread (torchrun's agent stops the others this way)."""


@contextlib.contextmanager
def watch_ranks(step: Any, last_good: Any = lambda: "", *, wait_s: float = 3.0) -> Any:
    """Within it, a rank lost mid-run raises :class:`RankLost` naming it, the step and the last checkpoint.

    Why: when one rank is killed, the others either block in a collective until its timeout
    (another machine) or get SIGTERM from torchrun's agent (same machine) and vanish without
    a word; neither says which rank went or when. Here a collective that fails with a
    backend error, or a SIGTERM, makes this rank post "alive" in the job's store and wait
    ``wait_s`` for the others' posts: the ranks that never post are the lost ones
    (:func:`lost_ranks`). ``step`` and ``last_good`` are callables read at that moment.
    A no-op in one process.
    """
    if not is_dist():
        yield
        return
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum: int, frame: Any) -> None:
            raise _Terminated()

        previous = signal.signal(signal.SIGTERM, on_term)

    def hold_sigterm() -> None:  # a second SIGTERM (the agent's, after a backend error) must not cut the wait
        if previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    try:
        yield
    except _Terminated:
        hold_sigterm()
        lost = lost_ranks(wait_s)
        raise RankLost(_lost_message(lost, step(), last_good(), "then SIGTERM stopped this rank")) from None
    except RuntimeError as exc:  # DistBackendError is one: gloo's "connection closed by peer" ...
        hold_sigterm()
        lost = lost_ranks(wait_s)
        if not lost:
            raise
        raise RankLost(_lost_message(lost, step(), last_good(), one_line(exc))) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def lost_ranks(wait_s: float = 3.0) -> list[int] | None:
    """The ranks that do not post "alive" in the job's store within ``wait_s`` (None: no store to ask)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        key = f"torch_tricks/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.set(f"{key}/{rank}", "1")
        return _unposted(store, key, rank, world, wait_s)
    except Exception:  # the store went with the lost rank (it lived in rank 0's process)
        return None


def _unposted(store: Any, key: str, rank: int, world: int, wait_s: float) -> list[int]:
    """The other ranks whose post under ``key`` is still missing once all are in or ``wait_s`` has passed."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r in range(world) if r != rank and not store.check([f"{key}/{r}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.1)


def _lost_message(lost: list[int] | None, step: int, last_good: str, why: str) -> str:
    world = dist.get_world_size() if dist.is_initialized() else "?"
    if lost:
        who = ("rank " if len(lost) == 1 else "ranks ") + ", ".join(map(str, lost))
        what = f"{who} of {world} was lost at step {step}: it died or stopped answering ({why})"
    elif lost is None:
        what = f"the run lost contact with the other ranks at step {step} ({why}); the job's store is gone too"
    else:
        what = f"rank {dist.get_rank()} of {world} stopped at step {step} ({why}); every other rank still answers"
    return f"{what}; last complete checkpoint: {last_good or 'none saved (set checkpoint_dir)'}"
