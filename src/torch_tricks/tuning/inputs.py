"""The tune's arguments, checked and read before anything is measured: the budget and run length, the tricks
to skip and the data path, the model, the processes, the memory limit and sizes such as ``8GiB``; what is
wrong is one UserError line."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import get_trick
from torch_tricks.tuning import distributed as D

def _check_budget_and_steps(budget_s: float, steps: int | None) -> None:
    if not budget_s or budget_s <= 0:
        raise UserError("--budget-seconds must be > 0")
    if steps is not None and not _is_count(steps):
        raise UserError(f"steps (the training run's length in optimizer steps) must be a whole number >= 1, "
                        f"not {steps!r}")


def _is_count(n: Any) -> bool:
    """A whole number >= 1 (not a bool)."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _check_skip_and_data(skip: Sequence[str], data: Any) -> None:
    """An unknown trick name to skip, or a data path that is not there: a UserError before anything is measured."""
    for name_ in skip:
        if name_.split(":")[0] != "threads":  # the intra-op threads: raced on a CPU, not a registered trick
            get_trick(name_.split(":")[0])  # an unknown name is a UserError listing the tricks
    if data is not None and isinstance(data, (str, Path)) and not Path(data).exists():
        raise UserError(f"no data set at {str(data)!r} (--data takes a pack, an ImageFolder tree or an HDF5 file)")


def _build_model(model_fn: Callable[[], nn.Module] | nn.Module) -> nn.Module:
    """A copy of the given module, or what ``model_fn()`` builds; what goes wrong is one UserError line."""
    if isinstance(model_fn, nn.Module):
        return copy.deepcopy(model_fn)
    try:
        model = model_fn()
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"building the model raised {one_line(exc, with_type=True)}") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"model_fn returned {type(model).__name__}, not an nn.Module")
    return model


def _parameter_counts(model: nn.Module) -> dict[str, int]:
    """The parameters that train and all of them (each once: tied weights count once): with LoRA or a frozen
    backbone the optimizer's state and the gradients scale with the first, the weights with the second."""
    params = list(model.parameters())
    return {"trainable": sum(p.numel() for p in params if p.requires_grad), "total": sum(p.numel() for p in params)}


def _input_shapes(inputs: tuple[Any, ...]) -> list[list[int]]:
    """The shape of each tensor input, without its batch dimension."""
    return [list(t.shape[1:]) for t in inputs if isinstance(t, torch.Tensor)]


def _worlds(processes: int | None, batch: int, dev: torch.device) -> tuple[int, int]:
    """(the world torchrun launched this process in, the ranks of the distributed rows: 0 for none), checked."""
    world = D.launched_world()
    if processes is not None and world > 1:
        raise UserError("--processes launches the ranks itself: run the tune without torchrun, or drop --processes")
    dist_world = world if world > 1 else (processes or 0)
    if processes is not None or world > 1:
        D.check_world(dist_world, batch, dev)
    return world, dist_world


def _memory_limit(limit: int | None, dev: torch.device) -> tuple[int, str]:
    if limit is not None:
        if limit <= 0:
            raise UserError("--memory-limit must be > 0, e.g. 8GiB")
        return int(limit), "given"
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory), "the GPU's total memory"
    available = _available_ram()
    if available is not None:
        return int(available * 0.8), "80% of the RAM available at start"
    return 8 << 30, "a default of 8 GiB (available RAM unknown)"


def _available_ram() -> int | None:
    """Bytes of RAM available now (/proc/meminfo's MemAvailable); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None



# -- sizes -------------------------------------------------------------------------------------

# KB/MB/GB are decimal; KiB/MiB/GiB and the bare K/M/G (as docker and free read them) binary.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"8GiB"`` -> 8589934592; ``"512MB"`` (decimal), ``"1.5G"`` (binary), ``"1000000"`` (bytes); else a UserError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UserError(f"cannot read the size {text!r}: give a number with a unit, e.g. 8GiB, 512MiB or 2GB")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"the size {text!r} must be > 0")
    return value



def token_rows_of(data: Any) -> Any:
    """``data`` as token rows for the tune's token phase (a data set with ``lengths``, or a list of
    ``{"input_ids": ...}`` rows), else None (a path: the loader phase)."""
    from torch_tricks.data.token_batches import TokenRowList, is_token_rows

    if is_token_rows(data):
        return data
    if isinstance(data, (list, tuple)) and data and all(isinstance(r, dict) and set(r) == {"input_ids"}
                                                         for r in data):
        return TokenRowList(data)
    return None
