"""Rules about feeding the loop: DataLoader without pinned memory or workers where the
file shows they would help, a DistributedSampler that never hears the epoch.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import (FileAnalysis, LOOPS, dataloaders, is_backward, kwarg, moves_batch_to_cuda,
                                          number, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule


def _dataset_exprs(f: FileAnalysis, call: ast.Call) -> list[ast.AST]:
    """The loader's dataset expression and what the variables in it were assigned, two deep."""
    exprs, todo = [], [(kwarg(call, "dataset", 0), 0)]
    while todo:
        expr, depth = todo.pop()
        if expr is None:
            continue
        exprs.append(expr)
        if depth < 2:
            todo.extend((f.binding_value(n), depth + 1) for n in ast.walk(expr) if isinstance(n, ast.Name))
    return exprs


def _dataset_on_device(f: FileAnalysis, call: ast.Call) -> bool:
    """The dataset holds tensors already moved to a device (pinning those would fail)."""
    return any((isinstance(n, ast.Attribute) and n.attr in ("cuda", "to"))
               or (isinstance(n, ast.keyword) and n.arg == "device")
               for e in _dataset_exprs(f, call) for n in ast.walk(e))


def _in_memory_dataset(f: FileAnalysis, call: ast.Call) -> bool:
    """The dataset is a TensorDataset: indexing it is cheap, workers only add overhead."""
    return any(isinstance(n, ast.Call) and (f.qualname(n.func) or "").endswith("TensorDataset")
               for e in _dataset_exprs(f, call) for n in ast.walk(e))


@static_rule
class LoaderWithoutPinMemory(StaticRule):
    id = "TT120"
    name = "loader-without-pin-memory"
    severity = "info"
    source = "D8, T5; seeds/003 pytorch训练数据准备 §1 (pin_memory); seeds/001 0x02 读取数据并行操作"
    message = ("DataLoader without pin_memory=True feeds batches to CUDA: set pin_memory=True and copy with "
               "non_blocking=True")
    explanation = ("Batches in pageable memory are copied to the GPU through a staging buffer, synchronously. With "
                   "pin_memory=True the loader returns page-locked batches, and .to(device, non_blocking=True) "
                   "copies them while the GPU computes. Fix: DataLoader(..., pin_memory=True) and "
                   "x.to(device, non_blocking=True). Leave it off when the host is short of RAM (pinned memory "
                   "cannot be swapped).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call, loops in dataloaders(f):
            if any(kw.arg is None for kw in call.keywords) or kwarg(call, "pin_memory", 7) is not None:
                continue
            if _dataset_on_device(f, call):
                continue
            if any(moves_batch_to_cuda(f, loop) for loop in loops):
                yield call, self.message


@static_rule
class LoaderWithoutWorkers(StaticRule):
    id = "TT121"
    name = "loader-without-workers"
    severity = "info"
    source = "D8; seeds/001 0x02 读取数据并行操作 (num_workers); seeds/003 pytorch训练数据准备 §1"
    message = ("DataLoader with num_workers=0 in a training loop: batches load in the training process while the "
               "device waits; set num_workers > 0")
    explanation = ("With num_workers=0 (the default) every batch is read, decoded and collated in the training "
                   "process between steps, so the accelerator idles meanwhile. Fix: "
                   "DataLoader(..., num_workers=k, persistent_workers=True) with k up to the CPU cores "
                   "(torch-tricks' loader tuner measures the best k). Keep 0 for data already in memory, or to "
                   "debug.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call, loops in dataloaders(f):
            if any(kw.arg is None for kw in call.keywords):
                continue
            workers = kwarg(call, "num_workers", 5)
            if (workers is not None and number(workers) != 0) or _in_memory_dataset(f, call):
                continue
            if any(is_backward(n) for loop in loops for n in walk_local(loop)):
                yield call, self.message


_DIST_SAMPLERS = ("torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler")


@static_rule
class DistributedSamplerWithoutSetEpoch(StaticRule):
    id = "TT123"
    name = "distributed-sampler-without-set-epoch"
    severity = "warning"
    source = "T18; seeds/001 (DistributedSampler); torch.utils.data.distributed.DistributedSampler's documentation"
    message = ("DistributedSampler without set_epoch(epoch): every epoch shuffles in the same order; call "
               "sampler.set_epoch(epoch) before each epoch")
    explanation = ("A DistributedSampler shuffles with a generator seeded by seed + epoch, and its epoch only "
                   "changes through set_epoch(). Without it every epoch visits the samples in the same order on "
                   "every rank: the shuffling is done once, and the model sees the same batches each epoch. "
                   "Fix: `sampler.set_epoch(epoch)` at the start of each epoch (before iterating the loader). "
                   "Quiet with shuffle=False, when the file calls set_epoch anywhere, and where no training loop "
                   "is in sight.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        samplers = [c for c in f.nodes[ast.Call] if f.qualname(c.func) in _DIST_SAMPLERS]
        if not samplers or any(isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch" for c in f.nodes[ast.Call]):
            return
        if not any(is_backward(n) for t in LOOPS for loop in f.nodes[t] for n in walk_local(loop)):
            return  # no training loop (a backward in a loop) in this file: the epochs run elsewhere
        for call in samplers:
            shuffle = kwarg(call, "shuffle", 3)
            if any(kw.arg is None for kw in call.keywords) or (shuffle is not None and number(shuffle) == 0) or (
                    isinstance(shuffle, ast.Constant) and shuffle.value is False):
                continue
            yield call, self.message
