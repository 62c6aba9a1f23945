"""The machine as it is: the cores this process may use, its intra-op threads, and what other processes use.

A measurement on a shared machine races against load it cannot see: another process busy on one
of two cores halves a parallel step's speed-up and widens its noise, and a tune then reads "keep
plain" where the machine, not the trick, was slow (issue 35). So whatever times a step can ask:

* :func:`available_cores`: the CPUs this process may run on (its affinity mask, a container's
  cpuset; else every CPU), the upper bound of :func:`set_threads`;
* :func:`set_threads`: torch's intra-op thread count, checked against those cores (one line for
  0 or more than there are). Only intra-op: torch fixes its inter-op pool at its first parallel
  call, after which it cannot be changed;
* :class:`LoadMonitor`: the CPU time other processes used during a window (``start`` / ``stop``
  or ``with``): ``foreign_cores``, ``shared(threshold)``, ``describe()`` in one line;
* :func:`gpu_processes`: the other processes holding memory on a CUDA device, as its driver
  lists them (needs ``pynvml``, the ``nvidia-ml-py`` package; said so where it is missing).

Foreign CPU load is the busy time of this process's CPUs from ``/proc/stat`` (user, nice, system,
irq, softirq, steal; only the CPUs in the affinity mask when it is a subset, since a process pinned
to 2 of 64 CPUs does not compete with the other 62) less this process tree's CPU time: its own
(:func:`time.process_time`, all threads), that of the children it reaped (:func:`os.times`) and
that of its live descendants (``/proc/PID/stat``, their reaped children included), so a loader
worker or a launched rank counts as this process's. Where ``/proc/stat`` is missing (not Linux)
the 1-minute load average less this tree's cores stands in (coarse; said so). The kernel counts
CPU time in ticks of 10 ms: a window shorter than :data:`MIN_WINDOW_S` is held open, idle, until
it lasts that long, and :data:`FOREIGN_SLACK_S` CPU seconds are tolerated on top of a threshold.

``benchmarks/_trust.py`` takes its foreign-load check from here, so the benchmarks and the
product measure the same thing the same way.
"""

from __future__ import annotations

import operator
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from torch_tricks.errors import UserError, one_line

__all__ = [
    "FOREIGN_MAX_CORES", "FOREIGN_SLACK_S", "MIN_WINDOW_S",
    "available_cores", "check_threads", "set_threads",
    "CpuSnapshot", "ForeignLoad", "LoadMonitor", "cpu_snapshot",
    "GpuProcesses", "gpu_processes",
]

#: foreign load: other processes' average cores above which a window counts as shared
FOREIGN_MAX_CORES = 0.25
#: foreign load: CPU seconds tolerated on top (the kernel counts CPU time in 10-ms ticks)
FOREIGN_SLACK_S = 0.05
#: foreign load: a window shorter than this is held open (idle) until it lasts this long, since
#: 10-ms ticks cannot resolve a quarter of a core over a few tens of milliseconds
MIN_WINDOW_S = 0.5

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --------------------------------------------------------------------------- cores and threads


def available_cores() -> int:
    """The CPUs this process may run on: its affinity mask (taskset, a container's cpuset), else every CPU."""
    cpus = _affinity()
    return len(cpus) if cpus else (os.cpu_count() or 1)


def check_threads(n: Any, *, what: str = "threads") -> int:
    """``n`` as an intra-op thread count this process can use (1 to :func:`available_cores`), else one line.

    ``what`` names the setting in that line: a flag (``"--threads"``) reads ``--threads 0: ...``, a
    configuration key (``"threads"``) reads ``threads = 0: ...`` and adds that 0 keeps the process's own.
    """
    cores = available_cores()
    count = _as_count(n)
    if count is None or not 1 <= count <= cores:
        said = f"{what} {n}" if what.startswith("-") else f"{what} = {n}"
        keep = "" if what.startswith("-") else ", or 0 to keep the process's own"
        span = "1" if cores == 1 else f"1 to {cores}"
        raise UserError(f"{said}: give {span}, the cores this process may use{keep}")
    return count


def set_threads(n: int, *, what: str = "threads") -> int:
    """Set torch's intra-op threads to ``n`` (checked by :func:`check_threads`); returns the count before.

    Process-wide, like ``torch.set_num_threads`` itself; a caller that scopes it restores the count returned.
    """
    import torch

    n = check_threads(n, what=what)
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def _as_count(n: Any) -> int | None:
    """``n`` as a whole number (an int, a numpy integer), or None (a bool, a float, a string)."""
    if isinstance(n, bool):
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None


def _affinity() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


# --------------------------------------------------------------------------- foreign CPU load


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU time counters at one instant: the busy time of this process's CPUs and this process tree's CPU time."""

    wall_s: float  # time.perf_counter()
    busy_s: float | None  # the CPUs counted (from /proc/stat); None where there is none
    own_s: float  # this process (all threads), its reaped children and its live descendants
    loadavg: float | None  # the 1-minute load average (os.getloadavg), for the record
    ncpu: int  # the CPUs busy_s counts


def cpu_snapshot() -> CpuSnapshot:
    """The counters now (see :class:`CpuSnapshot`)."""
    t = os.times()
    own = time.process_time() + t.children_user + t.children_system + _descendants_s(os.getpid())
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    cpus = _affinity()
    return CpuSnapshot(wall_s=time.perf_counter(), busy_s=_machine_busy_s(cpus), own_s=own, loadavg=load,
                       ncpu=len(cpus) if cpus else (os.cpu_count() or 1))


@dataclass(frozen=True)
class ForeignLoad:
    """What other processes used during one window, on the ``cores`` this process may use."""

    wall_s: float
    own_s: float  # CPU seconds of this process tree in the window
    foreign_s: float | None  # CPU seconds of everything else (None: not measurable here)
    source: str  # "/proc/stat", "load average" or "unavailable"
    loadavg: float | None = None
    cores: int = 0  # the CPUs counted (0: not recorded)

    @property
    def own_cores(self) -> float:
        return self.own_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def foreign_cores(self) -> float | None:
        """Other processes' cores busy on average over the window; None where not measurable."""
        if self.foreign_s is None:
            return None
        return self.foreign_s / self.wall_s if self.wall_s > 0 else 0.0

    def excessive(self, max_cores: float = FOREIGN_MAX_CORES, slack_s: float = FOREIGN_SLACK_S) -> bool:
        """Other processes used more than ``max_cores`` cores on average (plus ``slack_s`` CPU seconds)."""
        return self.foreign_s is not None and self.foreign_s > max_cores * self.wall_s + slack_s

    def shared(self, threshold: float = FOREIGN_MAX_CORES) -> bool:
        """Whether other processes used more than ``threshold`` cores on average (False where not measurable)."""
        return self.excessive(threshold)

    def describe(self, during: str = "") -> str:
        """One line: ``other processes used 1.30 of 2 cores during the race`` (``during``: "during the race")."""
        when = f" {during}" if during else ""
        if self.foreign_cores is None:
            return f"other processes' CPU use{when} is not measurable here (no /proc/stat, no load average)"
        of = f" of {self.cores}" if self.cores else ""
        coarse = " (from the load average: coarse)" if self.source == "load average" else ""
        return f"other processes used {self.foreign_cores:.2f}{of} cores{when}{coarse}"

    @classmethod
    def between(cls, a: CpuSnapshot, b: CpuSnapshot) -> ForeignLoad:
        wall, own = max(b.wall_s - a.wall_s, 0.0), max(b.own_s - a.own_s, 0.0)
        if a.busy_s is not None and b.busy_s is not None:
            return cls(wall, own, max(b.busy_s - a.busy_s - own, 0.0), "/proc/stat", b.loadavg, b.ncpu)
        if b.loadavg is not None and wall > 0:  # coarse: a 1-minute average against this window's cores
            return cls(wall, own, max(b.loadavg - own / wall, 0.0) * wall, "load average", b.loadavg, b.ncpu)
        return cls(wall, own, None, "unavailable", None, b.ncpu)


class LoadMonitor:
    """Other processes' CPU use over a window: ``m = LoadMonitor().start(); ...; m.stop()``, or ``with``.

    Then ``m.load`` (a :class:`ForeignLoad`), ``m.foreign_cores``, ``m.cores``, ``m.shared()``,
    ``m.describe("during the race")``; read before ``stop`` they cover the window so far. A window
    shorter than ``min_wall_s`` is held open, idle, at ``stop`` until it lasts that long (a busy
    process elsewhere is still busy then; a window of a few ticks would see nothing); 0 never waits.
    """

    def __init__(self, min_wall_s: float = MIN_WINDOW_S) -> None:
        self.min_wall_s = min_wall_s
        self.first: CpuSnapshot | None = None
        self.last: CpuSnapshot | None = None

    def start(self) -> LoadMonitor:
        self.first, self.last = cpu_snapshot(), None
        return self

    def stop(self, *, hold: bool = True) -> ForeignLoad:
        """End the window (held open to ``min_wall_s`` unless ``hold`` is false) and return its load."""
        first = self._first()
        left = self.min_wall_s - (time.perf_counter() - first.wall_s)
        if hold and left > 0:
            time.sleep(left)
        self.last = cpu_snapshot()
        return self.load

    def __enter__(self) -> LoadMonitor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(hold=exc[0] is None)

    @property
    def load(self) -> ForeignLoad:
        return ForeignLoad.between(self._first(), self.last or cpu_snapshot())

    @property
    def foreign_cores(self) -> float | None:
        return self.load.foreign_cores

    @property
    def cores(self) -> int:
        """The cores this process may use (:func:`available_cores`)."""
        return available_cores()

    def shared(self, threshold: float = FOREIGN_MAX_CORES) -> bool:
        return self.load.shared(threshold)

    def describe(self, during: str = "") -> str:
        return self.load.describe(during)

    def _first(self) -> CpuSnapshot:
        if self.first is None:
            raise UserError("LoadMonitor read before its window began: call start() (or use it in a with block)")
        return self.first


def _machine_busy_s(cpus: frozenset[int] | None = None) -> float | None:
    """Busy CPU seconds of ``cpus`` (all CPUs when None or all of them) since boot, from /proc/stat; None without."""
    try:
        with open("/proc/stat") as f:
            return _busy_s(f.read(), cpus)
    except OSError:
        return None


def _busy_s(stat: str, cpus: frozenset[int] | None) -> float | None:
    """:func:`_machine_busy_s` of the text of /proc/stat: its ``cpu`` line, or the sum of the ``cpuN`` lines of
    ``cpus`` where they are a subset of the CPUs listed."""
    lines = stat.splitlines()
    per_cpu = {int(ln.split()[0][3:]): ln for ln in lines if re.match(r"cpu\d+ ", ln)}
    if cpus is None or not per_cpu or set(per_cpu) <= cpus:
        total = next((ln for ln in lines if ln.startswith("cpu ")), None)
        return _busy(total) if total is not None else None
    return sum(_busy(ln) for c, ln in per_cpu.items() if c in cpus)


def _busy(line: str) -> float:
    v = [int(x) for x in line.split()[1:]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]  # guest time is inside user already
    return (user + nice + system + irq + softirq + steal) / _TICK


def _proc_times(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime + cutime + cstime in seconds) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def _descendants(root: int) -> dict[int, float]:
    """``root``'s live descendants: pid -> CPU seconds (each with the children it reaped)."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    children: dict[int, list[tuple[int, float]]] = {}
    for pid in pids:
        t = _proc_times(pid) if pid != root else None
        if t is not None:
            children.setdefault(t[0], []).append((pid, t[1]))
    out: dict[int, float] = {}
    todo = [root]
    while todo:
        for pid, s in children.get(todo.pop(), ()):
            out[pid] = s
            todo.append(pid)
    return out


def _descendants_s(root: int) -> float:
    """CPU seconds of ``root``'s live descendants (each with the children it reaped)."""
    return sum(_descendants(root).values())


# --------------------------------------------------------------------------- other processes on a GPU


@dataclass(frozen=True)
class GpuProcesses:
    """The processes holding memory on one CUDA device, as its driver lists them, and which are this process's."""

    device: str
    measurable: bool
    source: str  # "nvml", or why the list could not be read
    listed: tuple[tuple[int, float], ...] = ()  # (pid, MiB) of every process the driver lists
    ours: tuple[int, ...] = ()  # the listed pids of this process and its descendants
    namespaced: bool = False  # this process holds the device, yet its pid is not listed: another PID namespace

    @property
    def others(self) -> int:
        """Processes on the device that are not this process tree's (in another PID namespace: all but one)."""
        return max(len(self.listed) - len(self.ours) - int(self.namespaced), 0)

    @property
    def others_mib(self) -> float:
        """Device memory the other processes hold (MiB); the largest entry is taken for ours when namespaced."""
        theirs = sorted(mib for pid, mib in self.listed if pid not in self.ours)
        return sum(theirs[:-1] if self.namespaced and theirs else theirs)

    def shared(self) -> bool:
        return self.others > 0

    def describe(self) -> str:
        """One line: how many other processes are on the device and what they hold, or why that is not known."""
        if not self.measurable:
            return f"other processes on {self.device}: not measurable here ({self.source})"
        if not self.others:
            return f"no other process on {self.device}"
        ns = " (their pids are of another PID namespace: this process is taken as one of them)" \
            if self.namespaced else ""
        return f"{self.others} other process(es) on {self.device} hold {self.others_mib:.0f} MiB{ns}"


def gpu_processes(device: Any = None) -> GpuProcesses:
    """The processes on CUDA ``device`` (``None``: the current one) as its driver lists them (see
    :class:`GpuProcesses`). Not measurable, said why, where the device is no CUDA device or the list
    cannot be read (``pynvml`` missing, a driver that will not list them, MIG); CUDA this machine
    cannot serve is one line, as for every device a user names (:func:`torch_tricks.device.resolve`)."""
    import torch

    from torch_tricks.device import resolve

    dev = resolve("cuda" if device is None else device)
    if dev.type != "cuda":
        return GpuProcesses(str(dev), False, "not a CUDA device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    name = f"cuda:{index}"
    try:
        text = torch.cuda.list_gpu_processes(index)
    except Exception as exc:  # noqa: BLE001 - NVML's errors are its own types; the reason is what matters here
        return GpuProcesses(name, False, one_line(exc, with_type=True))
    if not text.startswith("GPU:"):
        return GpuProcesses(name, False, one_line(Exception(text)))
    listed = tuple((int(pid), float(mib)) for pid, mib in _GPU_LINE.findall(text))
    tree = {os.getpid(), *_descendants(os.getpid())}
    ours = tuple(pid for pid, _ in listed if pid in tree)
    namespaced = bool(listed) and not ours and _holds_context(torch, index)
    return GpuProcesses(name, True, "nvml", listed, ours, namespaced)


_GPU_LINE = re.compile(r"process\s+(\d+)\s+uses\s+([\d.]+)\s+MB")


def _holds_context(torch: Any, index: int) -> bool:
    """Whether this process has a CUDA context on device ``index`` (one the driver would list)."""
    if not torch.cuda.is_initialized():
        return False
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return bool(has(index)) if has is not None else True
