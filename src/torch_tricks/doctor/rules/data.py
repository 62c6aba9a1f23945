"""Rules about feeding the loop: DataLoader without pinned memory or workers where the
file shows they would help, a DistributedSampler that never hears the epoch, a Dataset
that does CUDA work in the loader's worker processes.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import (FileAnalysis, LOOPS, dataloaders, is_backward, is_cuda_device, kwarg,
                                          moves_batch_to_cuda, number, walk_local)
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


_DATASET_BASES = frozenset({"torch.utils.data.Dataset", "torch.utils.data.IterableDataset",
                            "torch.utils.data.dataset.Dataset", "torch.utils.data.dataset.IterableDataset"})
_SAMPLE_METHODS = ("__getitem__", "__getitems__", "__iter__")


def _is_dataset_class(f: FileAnalysis, cls: ast.ClassDef, seen: frozenset = frozenset()) -> bool:
    if any(f.qualname(b) in _DATASET_BASES for b in cls.bases):
        return True
    return any(base not in seen and _is_dataset_class(f, base, seen | {cls}) for base in f.local_bases(cls))


def _self_device_is_cuda(f: FileAnalysis, cls: ast.ClassDef, node: ast.AST) -> bool | None:
    """For ``self.<attr>`` in a method of ``cls``: True/False when the values the class assigns to that
    attribute spell a device (``"cuda"``, ``"cpu"``); None when they do not say."""
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
        return None
    strings = [n.value for value, _, _ in f.self_attrs.get(cls, {}).get(node.attr, ())
               for n in ast.walk(value) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return any(s.startswith("cuda") for s in strings) if strings else None


def _cuda_work(f: FileAnalysis, cls: ast.ClassDef, method: ast.AST) -> ast.Call | None:
    """The first call in ``method`` that puts data on a CUDA device: ``.cuda()``, ``.to(<cuda device>)``,
    a torch factory with ``device=<cuda device>``, a ``torch.cuda.*Tensor``."""
    def cuda_device(node: ast.AST) -> bool:
        said = _self_device_is_cuda(f, cls, node)
        return said if said is not None else is_cuda_device(f, node)

    for node in walk_local(method):
        if not isinstance(node, ast.Call):
            continue
        func, q = node.func, f.qualname(node.func) or ""
        if q.startswith("torch.cuda.") and q.rsplit(".", 1)[-1].endswith("Tensor"):
            return node
        if isinstance(func, ast.Attribute) and not q:
            if func.attr == "cuda":
                return node
            if func.attr == "to":
                device = kwarg(node, "device", 0)
                if device is not None and cuda_device(device):
                    return node
        if q.startswith("torch."):
            device = kwarg(node, "device")
            if device is not None and cuda_device(device):
                return node
    return None


def _loader_of(f: FileAnalysis, cls: ast.ClassDef) -> ast.Call | None:
    """A DataLoader of this file over an instance of ``cls`` with worker processes (num_workers a
    positive literal or a value the file does not fix)."""
    for call, _ in dataloaders(f):
        if any(kw.arg is None for kw in call.keywords):
            continue
        workers = kwarg(call, "num_workers", 5)
        if workers is None or number(workers) == 0 or (isinstance(workers, ast.Constant) and not workers.value):
            continue
        for expr in _dataset_exprs(f, call):
            if isinstance(expr, ast.Call):
                k = f.kind(expr.func)
                if k is not None and k.cat == "class" and k.ref is cls:
                    return call
    return None


@static_rule
class CudaInDatasetGetitem(StaticRule):
    id = "TT129"
    name = "cuda-in-dataset-getitem"
    severity = "error"
    source = ("D8, T5; seeds/003 pytorch训练数据准备 §1 (DataLoader, num_workers) and §4 "
              "(如何加速训练数据准备并载入GPU训练); seeds/001 0x02 读取数据并行操作")
    message = ("CUDA work in a Dataset's __getitem__/__iter__ that a DataLoader runs in worker processes: "
               "'Cannot re-initialize CUDA in forked subprocess', or one CUDA context per worker")
    explanation = ("With num_workers > 0 the DataLoader calls __getitem__ (or __iter__) in worker processes. "
                   "Under the default fork start method, a worker that touches CUDA after the parent has "
                   "initialised it raises 'Cannot re-initialize CUDA in forked subprocess'; under spawn each "
                   "worker creates its own CUDA context (hundreds of MB of GPU memory each) and sends CUDA "
                   "tensors back through IPC, which PyTorch advises against. Fix: return CPU tensors from the "
                   "dataset, DataLoader(..., pin_memory=True), and move the batch in the training loop with "
                   "batch.to(device, non_blocking=True); GPU augmentation belongs on the batch, after the loader.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for cls in f.classes.values():
            if not _is_dataset_class(f, cls):
                continue
            for name in _SAMPLE_METHODS:
                method = f.method(cls, name)
                work = _cuda_work(f, cls, method) if method is not None else None
                if work is None:
                    continue
                loader = _loader_of(f, cls)
                if loader is not None:
                    workers = ast.unparse(kwarg(loader, "num_workers", 5))
                    yield work, (f"`{ast.unparse(work)}` in {cls.name}.{name}, which the DataLoader on line "
                                 f"{loader.lineno} runs in worker processes (num_workers={workers}): CUDA in a forked "
                                 f"worker fails ('Cannot re-initialize CUDA in forked subprocess'); return CPU tensors "
                                 f"and move the batch in the loop")
                break
