"""Reproducible runs: one call seeds everything and, if asked, makes the kernels deterministic (catalogue T17, D11).

Seeds alone do not make a CUDA run repeatable: cuDNN picks convolution algorithms by
timing them (``cudnn.benchmark``) and some of them, like atomic-add reductions (scatter,
index_add, the backward of many ops), sum in a different order on every run. And cuBLAS
needs a fixed workspace layout (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` or ``:16:8``) that
PyTorch reads when it creates its cuBLAS workspaces, so it must be in the environment
before CUDA starts; :func:`seed_everything` sets it then, and says so when it is too late.

DataLoader workers (D11): since PyTorch 1.9 each worker seeds ``random``, ``torch`` and
``numpy`` from ``base_seed + worker_id``, where ``base_seed`` is drawn from the loader's
``generator`` each epoch; that is distinct per worker and reproducible when the generator
is seeded (:func:`seeded_generator`). :func:`worker_init_fn` states this explicitly, derives
numpy's state through ``SeedSequence`` (so nearby worker seeds give unrelated streams),
and also seeds OpenCV's RNG when OpenCV is in use, which nothing else does.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import torch

from torch_tricks._optional import available
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = [
    "seed_everything",
    "restore_determinism",
    "worker_init_fn",
    "seeded_generator",
    "CUBLAS_DETERMINISTIC_CONFIGS",
]

CUBLAS_DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")  # the values PyTorch accepts as deterministic
_MAX_SEED = 2**32 - 1  # numpy's legacy seed range


@register_trick(
    "deterministic",
    ids=("T17",),
    kind="train",
    trades="speed (no cuDNN autotuning, slower deterministic kernels, errors on ops with none) for repeatable runs",
    needs="call before the model or any tensor touches CUDA",
    config_key="deterministic",
)
def seed_everything(seed: int, *, deterministic: bool = False, warn_only: bool = False,
                    device: str | torch.device | None = None) -> dict[str, Any]:
    """Seed ``random``, numpy, torch (CPU and every CUDA device); optionally make kernels deterministic.

    ``PYTHONHASHSEED`` is set for child processes (this interpreter's string hashing was
    fixed when it started). With ``deterministic=True``: ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
    (unless already one of :data:`CUBLAS_DETERMINISTIC_CONFIGS`),
    ``torch.use_deterministic_algorithms(True, warn_only=warn_only)``,
    ``cudnn.deterministic=True``, ``cudnn.benchmark=False``. If CUDA has already started
    without the cuBLAS setting, that cannot be fixed in this process: a :class:`UserError`
    is raised before anything is changed, or with ``warn_only=True`` the reason is listed
    under ``"problems"`` and the rest is done; that check is left out when ``device`` says
    the run computes on the CPU (no cuBLAS call of it can be nondeterministic).
    ``deterministic=False`` leaves the determinism switches as they are.

    Returns what was done: ``seed``, ``seeded`` (the generators), ``env`` (variables
    set), ``deterministic``, ``problems``, and ``previous`` (the prior switches, for
    :func:`restore_determinism`).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise UserError(f"seed must be an integer in [0, 2**32 - 1], got {seed!r}")
    problems: list[str] = []
    env: dict[str, str] = {"PYTHONHASHSEED": str(seed)}
    if deterministic:
        cublas_env, problems = _cublas_env(device, warn_only)
        env.update(cublas_env)

    previous = _determinism_state()
    previous["env"] = {k: os.environ.get(k) for k in env}

    seeded = _seed_generators(seed)
    os.environ.update(env)

    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return {
        "seed": seed,
        "seeded": seeded,
        "env": env,
        "deterministic": bool(deterministic),
        "warn_only": bool(warn_only),
        "problems": problems,
        "previous": previous,
    }


def restore_determinism(previous: dict[str, Any]) -> None:
    """Put back the switches and environment variables recorded in ``seed_everything(...)["previous"]``.

    Accepts the whole result of :func:`seed_everything` too. Seeds are not restored
    (generator states are not saved; use ``torch.get_rng_state`` for that).
    """
    if isinstance(previous, dict) and "previous" in previous:
        previous = previous["previous"]
    try:
        mode, warn_only = bool(previous["deterministic_algorithms"]), bool(previous["warn_only"])
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            mode,
            warn_only,
        ):  # only when needed: torch's setter imports inductor (seconds) the first time
            torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        torch.backends.cudnn.deterministic = bool(previous["cudnn_deterministic"])
        torch.backends.cudnn.benchmark = bool(previous["cudnn_benchmark"])
        env = dict(previous.get("env", {}))
    except (KeyError, TypeError):
        raise UserError("restore_determinism needs the dict seed_everything returned (or its 'previous' entry)") from None
    _restore_env(env)


def worker_init_fn(worker_id: int) -> None:
    """``DataLoader(worker_init_fn=...)``: seed ``random``, numpy (and OpenCV if imported) in a worker.

    The seed is ``torch.initial_seed()``, which PyTorch sets in each worker to
    ``base_seed + worker_id`` (distinct per worker, reproducible from the loader's
    ``generator``). numpy gets ``SeedSequence(seed)``'s state rather than the raw seed,
    so consecutive worker seeds do not start correlated Mersenne-Twister streams.
    """
    seed = torch.initial_seed()
    random.seed(seed)
    if available("numpy"):
        import numpy as np

        np.random.seed(np.random.SeedSequence(seed).generate_state(4))
    cv2 = sys.modules.get("cv2")  # only if the dataset already uses OpenCV; never import it
    if cv2 is not None and hasattr(cv2, "setRNGSeed"):
        cv2.setRNGSeed(seed % 2**31)


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``, for ``DataLoader(generator=...)``.

    It drives the shuffling order and the workers' ``base_seed``, so both repeat from run
    to run, independently of how much the global RNG was used before (model init,
    augmentations in the main process).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"seed must be an integer >= 0, got {seed!r}")
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# --- helpers ---------------------------------------------------------------------------


def _cublas_env(device: str | torch.device | None, warn_only: bool) -> tuple[dict[str, str], list[str]]:
    """The cuBLAS variable deterministic mode needs, unless already set, and the problems found: CUDA
    started without it is a UserError, or with ``warn_only`` a problem (and no variable)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") in CUBLAS_DETERMINISTIC_CONFIGS:
        return {}, []
    on_cpu = device is not None and torch.device(device).type == "cpu"
    if not _cuda_initialized() or on_cpu:
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, []
    problem = (
        "deterministic mode: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set, so cuBLAS may stay "
        "nondeterministic; call seed_everything(deterministic=True) before any CUDA work, or export "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 before starting Python"
    )
    if not warn_only:
        raise UserError(problem)
    return {}, [problem]


def _seed_generators(seed: int) -> list[str]:
    """Seed every generator there is; returns their names."""
    seeded = ["random"]
    random.seed(seed)
    if available("numpy"):  # numpy is optional for seeding
        import numpy as np

        np.random.seed(seed)
        seeded.append("numpy")
    torch.manual_seed(seed)  # seeds the CPU generator and, lazily, every CUDA device's
    seeded.append("torch")
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # explicit for readers; torch.manual_seed already queued it
        seeded.append(f"cuda x{torch.cuda.device_count()}")
    return seeded


def _restore_env(env: dict[str, str | None]) -> None:
    """Set each variable back; None: it was unset."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())


def _determinism_state() -> dict[str, Any]:
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }
