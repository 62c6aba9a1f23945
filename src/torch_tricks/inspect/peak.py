"""The machine's peak matmul rate per dtype, measured once and cached: the yardstick of MFU (issue 22, item 6).

nanoGPT prints its MFU against a fixed A100 figure; a step on a 2-core CPU or on an H100 measured
against that number says nothing about how far *this* machine's step is from *this* machine's
limit. :func:`device_peak` measures it: square matmuls of growing size (256 up to 4096, stopping
where the next size would take over a second a product) in each dtype the device computes in, at
the process's thread count, the best rate of a few timed products after a warm-up. The
result is cached per machine in the user's cache directory (``$TORCH_TRICKS_CACHE``, else
``$XDG_CACHE_HOME/torch-tricks``, else ``~/.cache/torch-tricks``), keyed by device name,
instruction set or compute capability, thread count and torch version, so a change of any of
them measures again. :func:`mfu` is the model FLOPs utilisation of a step against it.

Written here: torch has no peak-rate query (``torch.cuda`` knows the device's name, not its
FLOP/s, and a CPU's depends on its kernels, threads and clock).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from torch_tricks._io import atomic_path
from torch_tricks.device import resolve as resolve_device
from torch_tricks.device import synchronize
from torch_tricks.errors import UserError
from torch_tricks.train.precision import precision_support

__all__ = ["Peak", "device_peak", "cached_peak", "mfu", "rate", "cache_path", "machine_key", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIZES = (256, 512, 1024, 2048, 4096)
_SLOW_S = 1.0  # a next product predicted slower than this ends the climb to larger sizes
_TIMED_S = 0.3  # each size is timed for about this long (at least two products)


@dataclass
class Peak:
    """The peak matmul FLOP/s of one machine per dtype, and the size that reached it."""

    key: str
    device: str
    flops: dict[str, float]  # dtype -> FLOP/s
    size: dict[str, int]  # dtype -> the matmul size of the best rate
    measured_at: str
    cached: bool = False  # read from the cache (not measured by this call)
    path: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        rows = [f"peak matmul rate of {self.device} ({self.key})"]
        rows += [f"  {d:<5} {rate(f):>16}  (square matmuls, best at {self.size[d]})" for d, f in self.flops.items()]
        src = f"cached in {self.path} (measured {self.measured_at})" if self.cached else \
            f"measured now, cached in {self.path}"
        return "\n".join(rows + [f"  {src}", *(f"  note: {n}" for n in self.notes)])


def device_peak(device: str | torch.device = "auto", *, refresh: bool = False, max_size: int = 4096,
                measure: Callable[[torch.device, torch.dtype, int], tuple[float, int]] | None = None) -> Peak:
    """The peak matmul rate of ``device`` per dtype: from the cache, or measured (and cached) when the cache has no
    entry for this machine, or ``refresh``. ``max_size`` bounds the largest matmul (tests use small ones)."""
    dev = resolve_device(device)
    key = machine_key(dev)
    path = cache_path()
    cached = cached_peak(dev)
    if cached is not None and not refresh and max(cached.size.values()) <= max_size:
        return cached
    entries = _read(path)
    peak = _measure_all(dev, key, max_size, measure or _measure_dtype)
    peak.path = str(path)
    entries[key] = {k: v for k, v in peak.to_dict().items() if k not in ("cached", "path", "key")}
    _write(path, entries)
    return peak


def cached_peak(device: str | torch.device = "auto") -> Peak | None:
    """The cached peak of ``device``'s machine, or None where it was not measured yet (nothing is measured)."""
    dev = resolve_device(device)
    key = machine_key(dev)
    entry = _read(cache_path()).get(key)
    if entry is None:
        return None
    return Peak(key, entry["device"], entry["flops"], entry["size"], entry["measured_at"], cached=True,
                path=str(cache_path()), notes=entry.get("notes", []))


def rate(flops_per_s: float) -> str:
    """A FLOP/s figure in the unit that reads best: ``172.7 GFLOP/s``, ``699.0 TFLOP/s``, ``3.2 MFLOP/s``."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:.1f} TFLOP/s"
    return f"{flops_per_s / 1e9:.1f} GFLOP/s" if flops_per_s >= 1e9 else f"{flops_per_s / 1e6:.1f} MFLOP/s"


def mfu(flops_per_step: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the step's model FLOPs per second over the peak rate of its dtype."""
    if step_s <= 0 or peak_flops <= 0:
        raise UserError("mfu needs a step time and a peak rate above 0")
    return flops_per_step / step_s / peak_flops


def cache_path() -> Path:
    """Where the peaks are cached: ``$TORCH_TRICKS_CACHE/peaks.json``, else the user's cache directory."""
    root = os.environ.get("TORCH_TRICKS_CACHE")
    if root:
        return Path(root) / "peaks.json"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "torch-tricks" / "peaks.json"


def machine_key(dev: torch.device) -> str:
    """What a peak depends on: device name, instruction set or compute capability, threads, torch version."""
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        what = f"{torch.cuda.get_device_name(dev)}|sm_{major}{minor}"
    else:
        what = f"{_cpu_name()}|{torch.backends.cpu.get_cpu_capability()}|threads={torch.get_num_threads()}"
    return f"{what}|torch={torch.__version__}"


# -- internals ----------------------------------------------------------------------------------------

def _measure_all(dev: torch.device, key: str, max_size: int,
                 measure: Callable[[torch.device, torch.dtype, int], tuple[float, int]]) -> Peak:
    flops, size, notes = {}, {}, []
    for name, dtype in DTYPES.items():
        if name != "fp32":
            ok, why = precision_support(name, dev)
            if not ok:
                notes.append(f"{name} not measured: {why}")
                continue
        flops[name], size[name] = measure(dev, dtype, max_size)
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    return Peak(key, label, flops, size, time.strftime("%Y-%m-%d %H:%M:%S"), notes=notes)


def _measure_dtype(dev: torch.device, dtype: torch.dtype, max_size: int) -> tuple[float, int]:
    """(the best FLOP/s of square matmuls in ``dtype`` up to ``max_size``, the size that reached it)."""
    best, best_n = 0.0, 0
    gen = torch.Generator(device=dev).manual_seed(0)
    for n in (s for s in SIZES if s <= max_size):
        a = torch.randn(n, n, device=dev, generator=gen).to(dtype)
        b = torch.randn(n, n, device=dev, generator=gen).to(dtype)
        _time_products(a, b, dev, 1)  # the warm-up: library start-up, kernel choice for the shape, first touch
        one = _time_products(a, b, dev, 1)  # (an H100's first fp32 product took long enough to end the climb at 256)
        reps = max(2, int(_TIMED_S / max(one, 1e-6)))
        rate = 2 * n ** 3 / _time_products(a, b, dev, reps)
        if rate > best:
            best, best_n = rate, n
        if 8 * one > _SLOW_S:  # the next size (twice the side) would take eight times as long
            break
    return best, best_n


def _time_products(a: torch.Tensor, b: torch.Tensor, dev: torch.device, reps: int) -> float:
    """Seconds per product, the best of ``reps`` (each synchronised)."""
    best = float("inf")
    out = torch.empty_like(a)
    for _ in range(reps):
        synchronize(dev)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read(path: Path) -> dict[str, Any]:
    """The cached entries; an unreadable or damaged cache is an empty one (it is measured again and rewritten)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, entries: dict[str, Any]) -> None:
    try:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(entries, indent=1))
    except OSError as exc:
        raise UserError(f"cannot write the peak cache {str(path)!r} ({exc.strerror}): set TORCH_TRICKS_CACHE to a "
                        "writable folder") from None
