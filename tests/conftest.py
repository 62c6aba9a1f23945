import gc
import importlib.util
import os

import pytest
import torch

# Intra-op threads: one per xdist worker (scripts/test.sh runs two workers on 2 cores; two threads each
# would make four on two cores, and OpenMP's spinning threads then slow both), else up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# Test modules that share a session fixture (gloo_jobs: one torchrun launch for all three; run_script) run on one
# xdist worker: split across two, each worker would pay for the whole launch.
_SHARED_WORKER = {m: "gloo_jobs" for m in ("tests/test_train_distributed.py", "tests/test_train_fit_ddp.py",
                                           "tests/test_train_lm_loss.py")}
_SHARED_WORKER.update({m: "run_script" for m in ("tests/test_integrations_hf.py", "tests/test_integrations_loop.py",
                                                  "tests/test_integrations_accelerate.py")})


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope`` (scripts/test.sh): a module's tests on one worker, as loadscope does, and the
    modules of :data:`_SHARED_WORKER` together. Other ``--dist`` modes keep xdist's own scheduler."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return _SHARED_WORKER.get(module, module)

    return _ByModule(config, log)


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_lives_on():
    """Before each test module, move every object alive then out of the garbage collector's reach: a full
    collection then scans only what the module makes. What lives on between modules (torch, transformers,
    onnx ..., imported at collection or lazily by a test, and their caches: over a million objects) would
    otherwise be scanned by each of the suite's hundreds of full collections (the automatic ones, the
    tune's and the leak check's around each measurement), about 0.2 s each: measured, 59 s of a 6-minute
    run. ``gc.freeze`` is CPython's tool for this (objects that live on); garbage is collected first."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session", autouse=True)
def _peak_cache(tmp_path_factory):
    """The machine-peak cache (torch-tricks peak, the tune's MFU) in a folder of the session, not the user's cache
    directory: a test never reads a peak another run measured, and leaves none behind."""
    old = os.environ.get("TORCH_TRICKS_CACHE")
    os.environ["TORCH_TRICKS_CACHE"] = str(tmp_path_factory.mktemp("torch-tricks-cache"))
    yield
    if old is None:
        os.environ.pop("TORCH_TRICKS_CACHE", None)
    else:
        os.environ["TORCH_TRICKS_CACHE"] = old


@pytest.fixture
def gc_unfrozen():
    """For the tests of ``gc.freeze`` handling itself: the session's freeze lifted for the test, put back after."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


@pytest.fixture(scope="session")
def gloo_jobs(tmp_path_factory):
    """One torchrun launch (2 gloo ranks) for the scripts that need no launch of their own:
    tests/dist_scripts/dist_checks.py (test_train_distributed), fit_ddp.py (test_train_fit_ddp) and, with
    transformers installed, lm_loss_ddp.py (test_train_lm_loss),
    through run_jobs.py (a launch costs seconds before any work: the launcher and both ranks import
    torch). Their output folders, the launch's log and exit status: each module asserts on what it needs."""
    from types import SimpleNamespace

    import torchrun_launch as T

    T.need_gloo()
    checks, fit, lm = (tmp_path_factory.mktemp(n) for n in ("dist_checks", "fit_ddp", "lm_loss_ddp"))
    jobs = ["dist_checks.py", str(checks), "---", "fit_ddp.py", str(fit)]
    if importlib.util.find_spec("transformers") is not None:
        jobs += ["---", "lm_loss_ddp.py", str(lm)]
    proc = T.start(T.SCRIPTS / "run_jobs.py", *jobs)
    log = T.wait(proc, timeout=240, ok=None)
    return SimpleNamespace(checks=checks, fit=fit, lm=lm, log=log, returncode=proc.returncode)


@pytest.fixture(scope="session")
def run_script(tmp_path_factory):
    """``run_script(script, cwd)``: ``subprocess.run([python, script], cwd=cwd, capture_output=True, text=True)``
    for the scripts the trainer-integration tests paste the printed lines into, each in a process of its own,
    forked from one that imported torch, transformers and accelerate once for the session (tests/_script_runner.py:
    what the child has of its own). Each fresh interpreter spent 6-8 s on those imports on 2 cores; the three
    modules that use it share an xdist worker (:data:`_SHARED_WORKER`), so they pay that once."""
    import json
    import select
    import signal
    import subprocess
    import sys
    from pathlib import Path

    logs = tmp_path_factory.mktemp("run_script")
    state = {"proc": None, "n": 0}

    def start():
        with open(logs / "runner.err", "ab") as log:
            state["proc"] = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_script_runner.py"))],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                             start_new_session=True)
        return state["proc"]

    def run(script, cwd, timeout=300) -> subprocess.CompletedProcess:
        proc = state["proc"] if state["proc"] is not None and state["proc"].poll() is None else start()
        state["n"] += 1
        out, err = logs / f"{state['n']}.out", logs / f"{state['n']}.err"
        proc.stdin.write(json.dumps({"script": str(script), "cwd": str(cwd), "stdout": str(out),
                                     "stderr": str(err)}) + "\n")
        proc.stdin.flush()
        if not select.select([proc.stdout], [], [], timeout)[0]:
            os.killpg(proc.pid, signal.SIGKILL)  # the runner and the script's process
            proc.wait()
            raise subprocess.TimeoutExpired([sys.executable, str(script)], timeout)
        reply = proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the script runner ended: {(logs / 'runner.err').read_text()[-3000:]}")
        return subprocess.CompletedProcess([sys.executable, str(script)], json.loads(reply)["returncode"],
                                           out.read_text(), err.read_text())

    yield run
    if state["proc"] is not None and state["proc"].poll() is None:
        state["proc"].stdin.close()
        state["proc"].wait(timeout=60)
