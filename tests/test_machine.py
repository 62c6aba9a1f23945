"""torch_tricks.machine, the machine as it is (issue 35): the cores this process may use, its intra-op threads (a
bad count is one line), and other processes' load: a busy process that is not ours is seen as about one core of
foreign load, this process's own work and its children's is not, and the GPU's other processes are listed.

Other sessions' tests run on this machine at the same time: the load bounds are generous (a busy loop elsewhere
is at least half a core; a quiet window only a finite number >= 0)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from torch_tricks import machine
from torch_tricks.errors import UserError
from torch_tricks.machine import CpuSnapshot, ForeignLoad, GpuProcesses, LoadMonitor

HAS_PROC = os.path.exists("/proc/stat")

# A process that is not this one's descendant: the intermediate starts it and exits at once (the busy loop is
# re-parented to init), printing its pid so the test can end it.
_BUSY = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < {s}: pass"
_ORPHAN = ("import subprocess, sys\n"
           "p = subprocess.Popen([sys.executable, '-c', {code!r}], stdin=subprocess.DEVNULL, "
           "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\nprint(p.pid)")


def _start_foreign_busy_loop(seconds: float) -> int:
    code = _ORPHAN.format(code=_BUSY.format(s=seconds))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


def _end(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


# -- cores and threads ---------------------------------------------------------------------------------------

def test_available_cores_are_the_affinity_mask():
    n = machine.available_cores()
    assert 1 <= n <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


def test_available_cores_follow_a_narrower_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert machine.available_cores() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: (_ for _ in ()).throw(OSError()), raising=False)
    assert machine.available_cores() == (os.cpu_count() or 1)  # no mask readable: every CPU


def test_set_threads_sets_and_returns_the_count_before():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # not 1 already (one thread per xdist worker)
        assert machine.set_threads(1) == 2
        assert torch.get_num_threads() == 1
        top = machine.available_cores()
        assert machine.set_threads(top) == 1 and torch.get_num_threads() == top
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -1, 10_000, True, 1.5, "2", None])
def test_a_thread_count_outside_the_cores_is_one_line(bad):
    before = torch.get_num_threads()
    cores = machine.available_cores()
    span = "1" if cores == 1 else f"1 to {cores}"
    with pytest.raises(UserError) as e:
        machine.set_threads(bad, what="--threads")
    assert str(e.value) == f"--threads {bad}: give {span}, the cores this process may use"
    assert torch.get_num_threads() == before  # nothing changed
    with pytest.raises(UserError, match=rf"^threads = {bad}: give {span}, the cores this process may use, or 0 to "
                                        r"keep the process's own$"):
        machine.check_threads(bad)


def test_a_numpy_integer_is_a_count():
    np = pytest.importorskip("numpy")
    assert machine.check_threads(np.int64(1)) == 1


# -- foreign CPU load --------------------------------------------------------------------------------------

@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_a_busy_process_elsewhere_is_about_one_core_of_foreign_load():
    pid = _start_foreign_busy_loop(3.0)
    try:
        time.sleep(0.3)  # its interpreter started
        with LoadMonitor() as m:
            time.sleep(1.5)
        load = m.load
    finally:
        _end(pid)
    assert load.source == "/proc/stat" and load.wall_s >= 1.5
    assert load.foreign_cores is not None and load.foreign_cores >= 0.5, load
    assert load.own_cores < 0.5  # this process slept
    assert m.shared() and load.shared(0.25)
    assert m.describe("during the race").startswith("other processes used ")
    assert f"of {machine.available_cores()} cores during the race" in m.describe("during the race")


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_a_quiet_window_is_a_finite_number():
    m = LoadMonitor(min_wall_s=0.2).start()
    load = m.stop()
    assert load.wall_s >= 0.2 and load is not None
    assert math.isfinite(m.foreign_cores) and m.foreign_cores >= 0
    assert m.cores == machine.available_cores() == load.cores


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_this_process_and_its_children_are_not_foreign():
    # 0.4 s of the child's own CPU (not of wall time, which a loaded machine would hand it only in part)
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    with LoadMonitor(min_wall_s=0) as m:
        subprocess.run([sys.executable, "-c", code], check=True)  # a child: its CPU is this process's
    assert m.load.own_s >= 0.3


def test_a_monitor_read_before_its_window_is_one_line():
    with pytest.raises(UserError, match="call start"):
        LoadMonitor().load


def test_stop_without_hold_does_not_wait():
    t0 = time.perf_counter()
    LoadMonitor(min_wall_s=5.0).start().stop(hold=False)
    assert time.perf_counter() - t0 < 4.0


def test_a_window_that_raised_is_not_held_open():
    t0 = time.perf_counter()
    with pytest.raises(KeyError):
        with LoadMonitor(min_wall_s=5.0):
            raise KeyError("x")
    assert time.perf_counter() - t0 < 4.0


def test_describe_says_cores_of_cores_and_when():
    load = ForeignLoad(wall_s=2.0, own_s=1.0, foreign_s=2.6, source="/proc/stat", cores=2)
    assert load.describe("during the race") == "other processes used 1.30 of 2 cores during the race"
    assert load.shared() and load.shared(1.2) and not load.shared(1.4)
    quiet = ForeignLoad(wall_s=2.0, own_s=1.0, foreign_s=0.1, source="/proc/stat", cores=2)
    assert not quiet.shared() and quiet.describe() == "other processes used 0.05 of 2 cores"
    coarse = ForeignLoad.between(CpuSnapshot(0.0, None, 0.0, 2.0, 4), CpuSnapshot(2.0, None, 1.0, 2.0, 4))
    assert coarse.describe() == "other processes used 1.50 of 4 cores (from the load average: coarse)"
    none = ForeignLoad.between(CpuSnapshot(0.0, None, 0.0, None, 2), CpuSnapshot(1.0, None, 0.5, None, 2))
    assert none.foreign_cores is None and not none.shared()
    assert "not measurable here" in none.describe("during the race")


def test_foreign_time_is_the_busy_time_less_this_tree():
    load = ForeignLoad.between(CpuSnapshot(0.0, 100.0, 5.0, 1.0, 2), CpuSnapshot(10.0, 119.0, 14.5, 1.0, 2))
    assert load.foreign_s == pytest.approx(9.5) and load.foreign_cores == pytest.approx(0.95) and load.cores == 2
    # this tree's CPU counted by the kernel a tick later than the machine's: never below zero
    assert ForeignLoad.between(CpuSnapshot(0.0, 100.0, 5.0, None, 2),
                               CpuSnapshot(1.0, 100.5, 5.6, None, 2)).foreign_s == 0.0


_STAT = """cpu  1000 0 500 9000 0 0 0 0 0 0
cpu0 100 0 50 4000 0 0 0 0 0 0
cpu1 200 0 100 3000 0 0 0 0 0 0
cpu2 300 0 150 1000 0 0 0 0 0 0
cpu3 400 0 200 1000 0 0 0 0 0 0
intr 1 2 3
"""


def test_the_busy_time_counts_only_the_cpus_this_process_may_use():
    tick = machine._TICK
    assert machine._busy_s(_STAT, None) == pytest.approx(1500 / tick)
    assert machine._busy_s(_STAT, frozenset({0, 1, 2, 3})) == pytest.approx(1500 / tick)  # all: the total line
    assert machine._busy_s(_STAT, frozenset({1, 3})) == pytest.approx((300 + 600) / tick)  # a cpuset of two
    assert machine._busy_s("intr 1 2\n", None) is None


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc (Linux)")
def test_a_snapshot_counts_the_cores_this_process_may_use():
    snap = machine.cpu_snapshot()
    assert snap.ncpu == machine.available_cores() and snap.busy_s is not None and snap.busy_s > 0


# -- other processes on a GPU ------------------------------------------------------------------------------

def _listing(text, monkeypatch, *, initialized=False):
    """gpu_processes over the driver's listing ``text`` (torch.cuda.list_gpu_processes' format) on cuda:0."""
    import torch_tricks.device as device_mod

    monkeypatch.setattr(device_mod, "resolve", lambda d, **kw: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "list_gpu_processes", lambda d=None: text)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: initialized, raising=False)
    return machine.gpu_processes("cuda:0")


def test_the_drivers_listing_is_read_and_this_process_is_ours(monkeypatch):
    me = os.getpid()
    text = (f"GPU:0\nprocess {me:>10d} uses     1024.000 MB GPU memory\n"
            "process          7 uses     2048.500 MB GPU memory")
    got = _listing(text, monkeypatch)
    assert got.measurable and got.source == "nvml" and got.device == "cuda:0"
    assert got.listed == ((me, 1024.0), (7, 2048.5)) and got.ours == (me,)
    assert got.others == 1 and got.others_mib == pytest.approx(2048.5) and got.shared()
    assert got.describe() == "1 other process(es) on cuda:0 hold 2048 MiB"
    alone = _listing("GPU:0\nno processes are running", monkeypatch)
    assert alone.measurable and not alone.shared() and alone.describe() == "no other process on cuda:0"


def test_pids_of_another_namespace_leave_one_for_this_process(monkeypatch):
    """In a container the driver lists the host's pids: this process, holding the device, is not found by pid and
    is taken as one of them (the largest), not counted as another process."""
    text = "GPU:0\nprocess     901 uses 3000.000 MB GPU memory\nprocess     902 uses 500.000 MB GPU memory"
    got = _listing(text, monkeypatch, initialized=True)
    assert got.namespaced and got.others == 1 and got.others_mib == pytest.approx(500.0)
    assert "another PID namespace" in got.describe()
    # not holding the device: both are others
    assert _listing(text, monkeypatch, initialized=False).others == 2


def test_an_unreadable_listing_is_not_measurable_and_says_why(monkeypatch):
    got = _listing("pynvml module not found, please install nvidia-ml-py", monkeypatch)
    assert not got.measurable and not got.shared()
    assert got.describe() == ("other processes on cuda:0: not measurable here (pynvml module not found, please "
                              "install nvidia-ml-py)")


def test_a_cpu_device_has_no_gpu_processes():
    got = machine.gpu_processes("cpu")
    assert not got.measurable and got.source == "not a CUDA device" and not got.shared()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_this_process_on_a_real_gpu_is_not_another():
    x = torch.ones(1 << 20, device="cuda")  # a context and memory on the device
    got = machine.gpu_processes()
    assert got.device == f"cuda:{torch.cuda.current_device()}"
    if got.measurable:  # pynvml installed
        assert os.getpid() in got.ours or got.namespaced
        assert got.others == len(got.listed) - len(got.ours) - int(got.namespaced)
    else:
        assert got.source  # why not, in words
    assert "\n" not in got.describe()
    del x


def test_another_process_alone_is_counted_with_its_memory():
    got = GpuProcesses("cuda:1", True, "nvml", ((5, 10.0),), (), False)
    assert got.others == 1 and got.describe() == "1 other process(es) on cuda:1 hold 10 MiB"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_one_line():
    with pytest.raises(UserError, match="no CUDA device"):
        machine.gpu_processes("cuda")
