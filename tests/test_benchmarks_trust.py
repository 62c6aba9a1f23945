"""benchmarks/_trust.py, the checks every benchmark runs on its own baselines (issue 16), with synthetic
timings: no benchmark runs here. A slower multi-thread baseline, an A/A pair outside the noise and
foreign load each make a row UNRELIABLE; with every check clean the ratio's own PASS/FAIL stands."""

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import _trust as trust  # noqa: E402
from _trust import UNRELIABLE, CpuSnapshot, ForeignLoad, Ledger, LoadMonitor  # noqa: E402


def _clean_checks():
    return [trust.thread_check(0.045, 0.026, 2, what="eager fp32"),
            trust.aa_check(0.045, 0.046, what="eager fp32"),
            trust.load_check(ForeignLoad(wall_s=2.0, own_s=1.0, foreign_s=0.02, source="/proc/stat"),
                             what="resnet18 batch 1")]


def test_slower_multi_thread_baseline_is_unreliable():
    # the numbers: eager fp32 at 2 threads 73 ms, at 1 thread 45 ms, int8 then "11.39x"
    c = trust.thread_check(0.045, 0.073, 2, what="eager fp32 ResNet-18 batch 1")
    assert not c.ok and c.kind == "threads"
    assert "73.00 ms" in c.detail and "45.00 ms" in c.detail and "1.62x" in c.detail
    assert trust.verdict(True, [c]) == UNRELIABLE  # a PASS ratio against it is not a PASS
    assert trust.verdict(False, [c]) == UNRELIABLE
    assert "threads: " in trust.why([c])


def test_multi_thread_within_slack_or_faster_holds():
    assert trust.thread_check(0.045, 0.026, 2, what="x").ok
    assert trust.thread_check(0.045, 0.045 * (1 + trust.THREAD_SLACK) * 0.999, 2, what="x").ok
    assert not trust.thread_check(0.045, 0.045 * (1 + trust.THREAD_SLACK) * 1.01, 2, what="x").ok
    assert not trust.thread_check(0.0, 0.01, 2, what="x").ok  # a zero baseline is no baseline


def test_aa_pair_outside_noise_is_unreliable():
    c = trust.aa_check(0.045, 0.056, what="eager fp32")  # 24% apart, noise stated 10%
    assert not c.ok and c.kind == "A/A" and "10%" in c.detail
    assert trust.verdict(True, [c]) == UNRELIABLE
    # symmetric: A' slower or faster than A alike
    assert not trust.aa_check(0.056, 0.045, what="x").ok
    assert trust.aa_check(0.045, 0.048, what="x").ok
    # a benchmark's own stated noise, and a ratio computed its own way (median of per-round ratios)
    assert not trust.aa_check(100.0, 100.0, what="x", tolerance=0.05, ratio=1.07).ok
    assert trust.aa_check(100.0, 100.0, what="x", tolerance=0.05, ratio=0.97).ok


def _snap(wall, busy, own):
    return CpuSnapshot(wall_s=wall, busy_s=busy, own_s=own, loadavg=1.0, ncpu=2)


def test_foreign_load_is_unreliable():
    # 10 s window: the machine was busy 19 CPU s, this benchmark used 9.5: a busy loop on the other core
    load = ForeignLoad.between(_snap(0.0, 100.0, 5.0), _snap(10.0, 119.0, 14.5))
    assert load.source == "/proc/stat"
    assert load.foreign_s == pytest.approx(9.5) and load.foreign_cores == pytest.approx(0.95)
    assert load.own_cores == pytest.approx(0.95)
    assert load.excessive()
    c = trust.load_check(load, what="resnet18 batch 1")
    assert not c.ok and c.kind == "foreign load" and "0.95 cores" in c.detail
    assert trust.verdict(True, [c]) == UNRELIABLE


def test_foreign_load_threshold_and_worst_window():
    quiet = ForeignLoad(wall_s=1.0, own_s=1.0, foreign_s=0.02, source="/proc/stat")
    edge = ForeignLoad(wall_s=1.0, own_s=1.0,
                       foreign_s=trust.FOREIGN_MAX_CORES + trust.FOREIGN_SLACK_S - 0.001, source="/proc/stat")
    busy = ForeignLoad(wall_s=1.0, own_s=1.0, foreign_s=0.9, source="/proc/stat")
    assert not quiet.excessive() and not edge.excessive() and busy.excessive()
    assert trust.load_check([quiet, edge], what="x").ok
    c = trust.load_check([quiet, busy, quiet], what="x")  # one loaded window of three taints the row
    assert not c.ok and "1 of 3 windows" in c.detail and "0.90 cores" in c.detail
    # the machine counts in 10-ms ticks: a short window is not flagged for a tick or two
    assert not ForeignLoad(wall_s=0.05, own_s=0.05, foreign_s=0.02, source="/proc/stat").excessive()


def test_foreign_load_unmeasurable_passes_and_says_so():
    load = ForeignLoad.between(CpuSnapshot(0.0, None, 0.0, None, 2), CpuSnapshot(1.0, None, 0.5, None, 2))
    assert load.foreign_s is None and load.source == "unavailable"
    c = trust.load_check(load, what="x")
    assert c.ok and "not measurable" in c.detail
    # without /proc/stat the load average stands in: 2.0 running, this tree 0.5 cores -> 1.5 foreign
    coarse = ForeignLoad.between(CpuSnapshot(0.0, None, 0.0, 2.0, 2), CpuSnapshot(2.0, None, 1.0, 2.0, 2))
    assert coarse.source == "load average" and coarse.foreign_cores == pytest.approx(1.5) and coarse.excessive()


def test_clean_checks_leave_the_ratio_verdict_standing():
    checks = _clean_checks()
    assert all(c.ok for c in checks) and trust.why(checks) == ""
    assert trust.verdict(True, checks) == "PASS"
    assert trust.verdict(False, checks) == "FAIL"
    assert trust.verdict(None, checks) == "SKIP"
    assert trust.verdict(True) == "PASS"


def test_fail_regardless_stays_fail_and_names_checks():
    bad = trust.aa_check(1.0, 2.0, what="x")
    assert trust.verdict(True, [bad], fail_regardless=True) == "FAIL"
    assert "A/A" in trust.why([bad, bad])
    assert trust.failed([bad, bad]) == [bad]


def test_ledger_collects_checks_per_window():
    led = Ledger()
    ok = led.add(("resnet18", 1, 1), trust.aa_check(1.0, 1.01, what="a"))
    bad = led.add(("resnet18", 2, 1), trust.thread_check(0.045, 0.073, 2, what="b"))
    assert led.for_(("resnet18", 1, 1)) == [ok]
    assert led.for_(("resnet18", 1, 1), ("resnet18", 2, 1), ("missing",)) == [ok, bad]
    assert trust.verdict(True, led.for_(("resnet18", 2, 1))) == UNRELIABLE
    lines = led.lines()
    assert lines[0].startswith("ok") and lines[1].startswith("FAIL")
    assert [d["ok"] for d in led.to_dict()] == [True, False]
    assert "UNRELIABLE" in trust.rules_text()


def test_monitor_counts_this_process_as_its_own():
    """A window of this process's own busy work is not foreign load (its CPU is subtracted); a real
    snapshot has the machine counters where /proc/stat exists."""
    with LoadMonitor() as m:
        t0 = time.process_time()
        while time.process_time() - t0 < 0.2:
            pass
    load = m.load
    assert load.own_s >= 0.15 and load.wall_s >= 0.15
    if os.path.exists("/proc/stat"):
        assert load.source == "/proc/stat" and load.foreign_s is not None and load.foreign_s >= 0
    c = m.check("self")
    assert c.kind == "foreign load"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc")
def test_children_cpu_is_own_not_foreign():
    """CPU time of a child process (a loader worker, a torchrun rank) counts as this benchmark's."""
    import subprocess

    code = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass"
    a = trust.cpu_snapshot()
    subprocess.run([sys.executable, "-c", code], check=True)
    b = trust.cpu_snapshot()
    assert b.own_s - a.own_s >= 0.25


def test_short_window_is_held_open_to_be_measurable():
    t0 = time.perf_counter()
    with LoadMonitor(min_wall_s=0.2) as m:
        pass
    assert time.perf_counter() - t0 >= 0.2 and m.load.wall_s >= 0.2


@pytest.mark.parametrize("script", ["deploy.py", "data_loading.py", "train_tricks.py", "tricks_in_your_loop.py",
                                    "distributed.py", "inspect_vs_peers.py"])
def test_every_judging_benchmark_uses_the_shared_checks(script):
    """The checks exist once: each benchmark that prints PASS/FAIL takes them from _trust, none reads /proc/stat itself."""
    text = (Path(__file__).parent.parent / "benchmarks" / script).read_text()
    assert "from _trust import" in text and "LoadMonitor" in text
    assert "/proc/stat\"" not in text and "'/proc/stat'" not in text


def test_aa_from_a_ratio_alone():
    """A tune reports its A/A noise as a ratio, not two times."""
    c = trust.aa_check(None, None, ratio=1.14, what="the tune's plain step")
    assert not c.ok and "1.140x" in c.detail and " vs " not in c.detail
    assert trust.aa_check(None, None, ratio=1.04, what="x").ok
    assert not trust.aa_check(None, None, what="x").ok  # nothing measured: no A/A to stand on


def test_the_foreign_load_check_is_the_products():
    """The benchmarks and the tune measure foreign load one way: _trust takes it from torch_tricks.machine, with the
    same thresholds, and words a window as a benchmark's check (both sides' cores, the window, the source)."""
    from torch_tricks import machine

    assert ForeignLoad is machine.ForeignLoad and CpuSnapshot is machine.CpuSnapshot
    assert issubclass(LoadMonitor, machine.LoadMonitor) and trust.cpu_snapshot is machine.cpu_snapshot
    assert (trust.FOREIGN_MAX_CORES, trust.FOREIGN_SLACK_S, trust.MIN_WINDOW_S) == \
        (machine.FOREIGN_MAX_CORES, machine.FOREIGN_SLACK_S, machine.MIN_WINDOW_S)
    c = trust.load_check(ForeignLoad(wall_s=2.0, own_s=1.0, foreign_s=1.8, source="/proc/stat", loadavg=2.5),
                         what="w")
    assert c.detail == ("w: other processes used 0.90 cores, this benchmark 0.50, over 2.00 s (/proc/stat, "
                        "load average 2.50); at most 0.25 cores allowed")
