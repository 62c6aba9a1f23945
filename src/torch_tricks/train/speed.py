"""Speed switches that cost no accuracy: channels_last, torch.compile, cudnn.benchmark, a kept heap.

* ``channels_last`` (NHWC) lets cuDNN use tensor-core convolution kernels without
  transposes, and lets oneDNN on CPU skip its layout reorders; it only changes 4-D
  tensors, so the model's conv weights and the 4-D input batches must both be
  converted (:func:`channels_last`, :func:`to_channels_last`).
* ``torch.compile`` (T24) fuses element-wise ops and removes Python overhead, at the
  price of a first call that compiles for seconds to minutes. That first call must be
  timed apart from the steady step time, or the speed-up is hidden (or, in a short
  benchmark, reversed): :func:`timed_first_call`, :func:`compile_stats`. Inductor
  needs a working C++ compiler on CPU and Triton on CUDA; :func:`compile_available`
  checks that once and says what is missing instead of failing deep inside a step.
* ``cudnn.benchmark`` (T2) times every cuDNN convolution algorithm for each new input
  shape and keeps the fastest: a win when shapes are fixed, a loss when they vary (it
  re-benchmarks every new shape), and meaningless without CUDA
  (:func:`cudnn_benchmark`).
* a kept heap (:func:`keep_heap`): on a CPU, PyTorch allocates tensors with glibc's
  malloc, which by default hands freed memory back to the kernel and maps big blocks
  afresh, so a training step page-faults (the kernel zeroing each 4 KB page) on memory
  it freed a step ago. Keeping freed memory in the process removes that cost, and makes
  a step's time the same in a fresh training script as in the long-lived tune that
  timed it.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_tricks._malloc import raise_malloc_thresholds
from torch_tricks.batches import to_channels_last  # defined there: moving a batch needs it
from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = [
    "channels_last",
    "to_channels_last",
    "compile_model",
    "compile_available",
    "probe_compile",
    "timed_first_call",
    "CompileStats",
    "compile_stats",
    "cudnn_benchmark",
    "cudnn_available",
    "keep_heap",
    "heap_available",
]


# -- channels_last ------------------------------------------------------------------------

@register_trick(
    "channels_last",
    ids=(),
    kind="train",
    trades="faster convolutions (tensor cores, no layout reorders) for a one-off weight conversion",
    needs="a model with 4-D conv weights and 4-D (NCHW) image inputs",
    config_key="channels_last",
    measured_in="benchmarks/train_tricks.py",
)
def channels_last(model: nn.Module) -> nn.Module:
    """Convert ``model``'s 4-D parameters and buffers to ``torch.channels_last`` in place.

    Only 4-D tensors change (conv weights); the rest is untouched. Inputs must follow:
    convert each batch with :func:`to_channels_last`. Warns if nothing was 4-D.
    """
    if not any(p.dim() == 4 for p in model.parameters()):
        warnings.warn("channels_last: the model has no 4-D (conv) weights, so nothing changes", stacklevel=2)
        return model
    return model.to(memory_format=torch.channels_last)


def _is_namedtuple(x: Any) -> bool:
    """A namedtuple, rebuilt from its fields as positional arguments (a plain tuple takes one iterable)."""
    return isinstance(x, tuple) and hasattr(x, "_fields")


# -- torch.compile ----------------------------------------------------------------------

def compile_available(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """(can ``torch.compile``'s default inductor backend run on ``device``, reason if not).

    Cheap checks, cached: dynamo supports this Python; on CPU a C++ compiler is found
    (``$CXX``, ``c++``, ``g++`` or ``clang++``) and builds a shared library against
    ``Python.h`` (the three things inductor's CPU backend needs, tested in a
    subprocess in well under a second); on CUDA, Triton imports. For the full
    end-to-end check (seconds to a minute) use :func:`probe_compile`.
    """
    dev = torch.device(device)
    return _compile_available(dev.type)


def probe_compile(device: torch.device | str = "cpu", timeout: float = 300.0) -> tuple[bool, str]:
    """End-to-end check, once per process and device type: ``torch.compile`` a tiny
    function in a subprocess (a crash or hang there cannot hurt this process) and run
    it. Slow (10-60 s on a small CPU); :func:`compile_available` is the cheap check."""
    dev = torch.device(device)
    ok, why = _compile_available(dev.type)
    if not ok:
        return ok, why
    return _probe_compile(dev.type, float(timeout))


@register_trick(
    "compile",
    ids=("T24",),
    kind="train",
    trades="faster steps (fused kernels, less Python overhead) for a first call that compiles for seconds to minutes",
    needs="torch.compile's inductor: a C++ compiler on CPU, Triton on CUDA",
    config_key="compile",
    available=lambda device: compile_available(device),
    measured_in="benchmarks/train_tricks.py",
)
def compile_model(model: nn.Module, *, check: bool = True, **compile_kwargs: Any) -> nn.Module:
    """``torch.compile`` ``model`` in place (``nn.Module.compile``) and return it.

    In place rather than ``torch.compile(model)``, so ``state_dict`` keys keep their
    names (no ``_orig_mod.`` prefix) and checkpoints stay loadable either way.
    ``compile_kwargs`` go to ``torch.compile`` (``mode``, ``backend``, ``dynamic``...).
    With ``check`` and the default inductor backend, a missing compiler is a
    :class:`UserError` now instead of an error inside the first step. Compilation
    itself happens on the first call: time it apart with :func:`timed_first_call`.
    """
    if check and compile_kwargs.get("backend", "inductor") == "inductor":
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        ok, why = compile_available(dev)
        if not ok:
            raise UserError(f"torch.compile cannot run here: {why}")
    model.compile(**compile_kwargs)
    if type(model).__module__.startswith("torch."):
        # nn.Module.compile compiles ``model._call_impl``, whose frame lies in torch.nn,
        # which dynamo skips: a bare nn.Sequential (or DDP) would silently stay eager
        # (pytorch/pytorch#132923). An entry frame in this file is compiled, and dynamo
        # inlines the torch.nn code from there, as torch.compile(module) does.
        model._compiled_call_impl = torch.compile(_entry_frame(model), **compile_kwargs)
    return model


def _entry_frame(model: nn.Module) -> Callable[..., Any]:
    call = model._call_impl

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    return compiled_call


def timed_first_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), seconds)``, synchronizing CUDA around the call so the time
    is the real one; for a compiled ``fn`` this is the compile time plus one step."""
    _sync(args)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _sync(args, out)
    return out, time.perf_counter() - t0


@dataclass
class CompileStats:
    """First (compiling) call apart from the steady-state calls."""

    first_call_s: float
    steady_call_s: float  # median of the calls after the first
    repeats: int

    @property
    def compile_s(self) -> float:
        """The first call's extra time over a steady call: the compilation (and warm-up)."""
        return max(self.first_call_s - self.steady_call_s, 0.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compile_s"] = self.compile_s
        return d


def compile_stats(fn: Callable[..., Any], *args: Any, repeats: int = 3, **kwargs: Any) -> CompileStats:
    """Time the first call of ``fn`` (e.g. a compiled model, or a training step closure
    over one) and the median of ``repeats`` further calls."""
    if repeats < 1:
        raise UserError("compile_stats needs repeats >= 1 to measure a steady call")
    _, first = timed_first_call(fn, *args, **kwargs)
    times = [timed_first_call(fn, *args, **kwargs)[1] for _ in range(repeats)]
    return CompileStats(first_call_s=first, steady_call_s=statistics.median(times), repeats=repeats)


# -- cudnn.benchmark --------------------------------------------------------------------

def cudnn_available(device: torch.device) -> tuple[bool, str]:
    """``cudnn_benchmark`` matters only on a CUDA device with cuDNN."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False, "cudnn.benchmark only affects CUDA convolutions"
    if not torch.backends.cudnn.is_available():
        return False, "this torch build has no cuDNN"
    return True, ""


@register_trick(
    "cudnn_benchmark",
    ids=("T2",),
    kind="train",
    trades="faster convolutions after a one-off search per input shape; slower if shapes vary",
    needs="CUDA with cuDNN, and fixed input shapes",
    config_key="cudnn_benchmark",
    available=cudnn_available,
)
def cudnn_benchmark(enabled: bool = True, fixed_shapes: bool = True) -> bool:
    """Set ``torch.backends.cudnn.benchmark`` and return its previous value.

    It is switched on only when ``enabled`` and ``fixed_shapes`` (with varying shapes
    it re-benchmarks every new shape, which costs more than it saves) and CUDA is
    present; without CUDA the flag is left as it is, since it affects nothing.
    """
    prev = bool(torch.backends.cudnn.benchmark)
    if torch.cuda.is_available() and torch.backends.cudnn.is_available():
        torch.backends.cudnn.benchmark = bool(enabled and fixed_shapes)
    return prev


# -- a kept heap -------------------------------------------------------------------------

KEEP_HEAP_MMAP = 32 << 20  # glibc's largest mmap threshold on 64-bit
KEEP_HEAP_TRIM = 2**31 - 1  # the largest int mallopt takes: freed heap memory is never trimmed


def heap_available(device: torch.device) -> tuple[bool, str]:
    """``keep_heap`` matters for tensors in glibc-malloc'ed CPU memory."""
    import platform

    if torch.device(device).type != "cpu":
        return False, "the device's own caching allocator keeps its memory already"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False, "needs glibc's malloc (Linux)"
    return True, ""


@register_trick(
    "keep_heap",
    ids=(),
    kind="train",
    trades="no page faults on memory freed a step ago, for RSS that stays at the heap's high-water mark",
    needs="a CPU device and glibc (Linux); process-wide",
    config_key="keep_heap",
    available=heap_available,
)
def keep_heap() -> bool:
    """Keep freed memory in this process (glibc only): blocks up to 32 MiB from the heap, never trimmed.

    Why: glibc's defaults give freed memory at the top of the heap back to the kernel and
    map every big block afresh; a CPU training step (for-loop AdamW makes a temporary per
    parameter, activations come and go) then takes fresh pages every step. ResNet-18 at
    batch 16 in a fresh process: ~20,000 minor page faults per plain step (226 ms, against
    207 ms for the same step in a process whose heap happened to be warm); with the heap
    kept, none. Blocks over 32 MiB (GPT-2's logits) stay mapped, as glibc caps the
    threshold there. The cost: the process's resident memory stays at its heap's
    high-water mark instead of shrinking between steps (CUDA's caching allocator does the
    same with device memory). ``Tricks`` calls this when ``keep_heap`` is on (the default)
    and the device is a CPU, so the tune and your own loop run with the same allocator.
    Process-wide, and only ever raised; returns whether glibc took it (False off glibc).
    """
    return raise_malloc_thresholds(trim=KEEP_HEAP_TRIM, mmap=KEEP_HEAP_MMAP)


# -- internals --------------------------------------------------------------------------

def _sync(*objs: Any) -> None:
    if not torch.cuda.is_available():
        return
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(objs)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            torch.cuda.synchronize(t.device)
            return


def _find_cxx() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    return None


@functools.lru_cache(maxsize=None)
def _compile_available(device_type: str) -> tuple[bool, str]:
    why = _dynamo_problem()
    if why:
        return False, why
    if device_type == "cuda":
        why = _triton_problem()
        return (False, why) if why else (True, "")
    if device_type != "cpu":
        return True, ""  # other backends: let torch.compile decide
    return _cpu_inductor_available()


def _dynamo_problem() -> str:
    """Why torch.compile cannot run in this Python at all; "" if it can."""
    try:
        import torch._dynamo as dynamo

        if not dynamo.is_dynamo_supported():
            py = sys.version.split()[0]
            return f"torch.compile does not support Python {py} with torch {torch.__version__}"
    except Exception as exc:  # a broken install
        return f"torch._dynamo does not import: {type(exc).__name__}: {exc}"
    return ""


def _triton_problem() -> str:
    """Why inductor cannot generate CUDA kernels here (no Triton); "" if it can."""
    try:
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor on CUDA needs Triton: pip install triton (matching your torch)"
    except Exception:
        return "inductor on CUDA needs Triton, which does not import here"
    return ""


def _cpu_inductor_available() -> tuple[bool, str]:
    """Inductor's CPU backend needs a C++ compiler that builds an extension against ``Python.h``."""
    cxx = _find_cxx()
    if cxx is None:
        return False, (
            "no C++ compiler (c++, g++ or clang++) on PATH, which inductor's CPU backend needs: "
            "install one (e.g. build-essential)"
        )
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        return False, (
            f"Python.h not found in {include!r}, which inductor's CPU backend needs: "
            "install the Python headers (python3-dev)"
        )
    return _builds_extension(cxx, include)


def _builds_extension(cxx: str, include: str) -> tuple[bool, str]:
    """Whether ``cxx`` builds a tiny shared library against the ``Python.h`` in ``include``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write('#include <Python.h>\nextern "C" int probe(int x) { return x + 1; }\n')
        cmd = [*cxx.split(), "-shared", "-fPIC", "-O0", f"-I{include}", src, "-o", os.path.join(tmp, "probe.so")]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"the C++ compiler {cxx!r} did not run: {exc}"
        if r.returncode != 0:
            first = (r.stderr.strip().splitlines() or ["no output"])[0]
            return False, f"the C++ compiler {cxx!r} cannot build a Python extension: {first}"
    return True, ""


_PROBE = """
import torch
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
x = torch.randn(16, device={dev!r})
assert torch.allclose(f(x), torch.sin(x) * 2 + 1, atol=1e-5)
"""


@functools.lru_cache(maxsize=None)
def _probe_compile(device_type: str, timeout: float) -> tuple[bool, str]:
    try:
        r = subprocess.run(
            [sys.executable, "-c", _PROBE.format(dev=device_type)],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return False, f"compiling a tiny function took over {timeout:.0f} s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return False, f"torch.compile failed on a tiny function: {last}"
    return True, ""
