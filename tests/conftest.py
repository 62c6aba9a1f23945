import gc
import importlib.util
import os

import pytest
import torch

# Intra-op threads: one per xdist worker (scripts/test.sh runs two workers on 2 cores; two threads each
# would make four on two cores, and OpenMP's spinning threads then slow both), else up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# Test modules that share a session fixture (gloo_jobs: one torchrun launch for all three) run on one xdist
# worker: split across two, each worker would pay for the whole launch.
_SHARED_WORKER = {m: "gloo_jobs" for m in ("tests/test_train_distributed.py", "tests/test_train_fit_ddp.py",
                                           "tests/test_train_lm_loss.py")}


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
