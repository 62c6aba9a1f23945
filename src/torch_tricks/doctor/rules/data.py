"""Rules about feeding the loop: DataLoader without pinned memory or workers where the
file shows they would help, a DistributedSampler that never hears the epoch, a Dataset
that does CUDA work in the loader's worker processes.
"""

from __future__ import annotations

import ast
from typing import Iterable, Iterator

from torch_tricks.doctor.analysis import (FileAnalysis, LOOPS, called_method, dataloaders, is_backward, is_cuda_device,
                                          kwarg, moves_batch_to_cuda, number, walk_local)
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
    return any(_names_device(n) for e in _dataset_exprs(f, call) for n in ast.walk(e))


def _names_device(node: ast.AST) -> bool:
    """A ``.cuda`` / ``.to`` attribute or a ``device=`` keyword."""
    return ((isinstance(node, ast.Attribute) and node.attr in ("cuda", "to"))
            or (isinstance(node, ast.keyword) and node.arg == "device"))


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

    tier = "hygiene"
    tier_why = ("pinned batches save a staging copy per batch, which matters only where the copy is a visible share "
                "of the step (large inputs, short steps); the file does not show that: with --select hygiene only")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call, loops in dataloaders(f):
            if not _pin_memory_settled(f, call) and any(moves_batch_to_cuda(f, loop) for loop in loops):
                yield call, self.message


def _pin_memory_settled(f: FileAnalysis, call: ast.Call) -> bool:
    """The loader sets pin_memory (or may, through ``**kwargs``), or its data is already on a device."""
    return _has_star_kwargs(call) or kwarg(call, "pin_memory", 7) is not None or _dataset_on_device(f, call)


def _has_star_kwargs(call: ast.Call) -> bool:
    """``call`` passes ``**kwargs``: any argument may be among them."""
    return any(kw.arg is None for kw in call.keywords)


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

    tier = "hygiene"
    tier_why = ("on data already in memory (tensors, a tokenized datasets.Dataset) workers only add start-up and "
                "copies: reported by default only where the file shows per-item work, a dataset of this file whose "
                "__getitem__ opens, reads, decodes or transforms, or a torchvision image dataset")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call, loops in dataloaders(f):
            if not _workers_settled(f, call) and _has_backward(loops):
                yield call, self.message

    def matters(self, f: FileAnalysis, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and _per_item_work(f, node)


_PER_ITEM_CALLS = frozenset("open imread imdecode read decode load loads transform transforms augment resize "
                            "convert".split())


def _per_item_work(f: FileAnalysis, call: ast.Call) -> bool:
    """The loader's dataset reads or decodes each item: a torchvision dataset (PIL decoding, transforms per
    item), or a class of this file whose ``__getitem__`` calls open / read / decode / a transform."""
    for expr in _dataset_exprs(f, call):
        for n in ast.walk(expr):
            if not isinstance(n, ast.Call):
                continue
            q = f.qualname(n.func) or ""
            if q.startswith("torchvision.datasets."):
                return True
            name = n.func.id if isinstance(n.func, ast.Name) else None
            if name is not None and _getitem_works(f, name):
                return True
    return False


def _getitem_works(f: FileAnalysis, cls_name: str) -> bool:
    """The class ``cls_name`` of this file has a ``__getitem__`` that calls one of :data:`_PER_ITEM_CALLS`."""
    for cls in f.nodes[ast.ClassDef]:
        if cls.name != cls_name:
            continue
        for item in cls.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__getitem__":
                return any(isinstance(c, ast.Call) and _callee(c) in _PER_ITEM_CALLS for c in ast.walk(item))
    return False


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _workers_settled(f: FileAnalysis, call: ast.Call) -> bool:
    """The loader sets num_workers (or may, through ``**kwargs``), or its dataset is an in-memory TensorDataset."""
    return _has_star_kwargs(call) or _sets_workers(call) or _in_memory_dataset(f, call)


def _sets_workers(call: ast.Call) -> bool:
    """The loader passes a num_workers other than a literal 0."""
    workers = kwarg(call, "num_workers", 5)
    return workers is not None and number(workers) != 0


def _has_backward(loops: Iterable[ast.AST]) -> bool:
    """A backward call in one of ``loops`` (a training loop)."""
    return any(is_backward(n) for loop in loops for n in walk_local(loop))


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
        samplers = _distributed_samplers(f)
        if not samplers or _calls_set_epoch(f):
            return
        if not _has_training_loop(f):
            return  # the epochs run elsewhere
        for call in samplers:
            if not _has_star_kwargs(call) and not _shuffle_off(call):
                yield call, self.message


def _distributed_samplers(f: FileAnalysis) -> list[ast.Call]:
    return [c for c in f.nodes[ast.Call] if f.qualname(c.func) in _DIST_SAMPLERS]


def _has_training_loop(f: FileAnalysis) -> bool:
    """A loop of this file calls backward."""
    return _has_backward(loop for t in LOOPS for loop in f.nodes[t])


def _calls_set_epoch(f: FileAnalysis) -> bool:
    """The file calls ``.set_epoch()`` on something (a sampler, probably)."""
    return any(called_method(c) == "set_epoch" for c in f.nodes[ast.Call])


def _shuffle_off(call: ast.Call) -> bool:
    """The sampler is given shuffle=False (or 0)."""
    shuffle = kwarg(call, "shuffle", 3)
    return (shuffle is not None and number(shuffle) == 0) or (
        isinstance(shuffle, ast.Constant) and shuffle.value is False)


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
    if not _is_self_attribute(node):
        return None
    strings = _assigned_strings(f, cls, node.attr)
    return any(s.startswith("cuda") for s in strings) if strings else None


def _assigned_strings(f: FileAnalysis, cls: ast.ClassDef, attr: str) -> list[str]:
    """The string constants in the values ``cls`` assigns to ``self.<attr>``."""
    return [n.value for value, _, _ in f.self_attrs.get(cls, {}).get(attr, ()) for n in ast.walk(value)
            if _is_string(n)]


def _is_self_attribute(node: ast.AST) -> bool:
    """``self.<attr>``."""
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _cuda_work(f: FileAnalysis, cls: ast.ClassDef, method: ast.AST) -> ast.Call | None:
    """The first call in ``method`` that puts data on a CUDA device: ``.cuda()``, ``.to(<cuda device>)``,
    a torch factory with ``device=<cuda device>``, a ``torch.cuda.*Tensor``."""
    return next((node for node in walk_local(method) if isinstance(node, ast.Call) and _puts_on_cuda(f, cls, node)),
                None)


def _puts_on_cuda(f: FileAnalysis, cls: ast.ClassDef, call: ast.Call) -> bool:
    """``call`` (in a method of ``cls``) puts data on a CUDA device."""
    func, q = call.func, f.qualname(call.func) or ""
    if _is_cuda_tensor_type(q):
        return True
    if isinstance(func, ast.Attribute) and not q:
        return _moves_to_cuda(f, cls, call)
    return q.startswith("torch.") and _cuda_device(f, cls, kwarg(call, "device"))


def _moves_to_cuda(f: FileAnalysis, cls: ast.ClassDef, call: ast.Call) -> bool:
    """The method call ``call`` is ``.cuda()`` or ``.to(<cuda device>)``."""
    attr = call.func.attr
    return attr == "cuda" or (attr == "to" and _cuda_device(f, cls, kwarg(call, "device", 0)))


def _is_cuda_tensor_type(q: str) -> bool:
    """A legacy CUDA tensor type: ``torch.cuda.FloatTensor`` ..."""
    return q.startswith("torch.cuda.") and q.rsplit(".", 1)[-1].endswith("Tensor")


def _cuda_device(f: FileAnalysis, cls: ast.ClassDef, device: ast.AST | None) -> bool:
    """``device`` (an argument in a method of ``cls``) names a CUDA device."""
    if device is None:
        return False
    said = _self_device_is_cuda(f, cls, device)
    return said if said is not None else is_cuda_device(f, device)


def _loader_of(f: FileAnalysis, cls: ast.ClassDef) -> ast.Call | None:
    """A DataLoader of this file over an instance of ``cls`` with worker processes (num_workers a
    positive literal or a value the file does not fix)."""
    for call, _ in dataloaders(f):
        if _has_star_kwargs(call) or not _spawns_workers(call):
            continue
        if any(_instantiates(f, expr, cls) for expr in _dataset_exprs(f, call)):
            return call
    return None


def _spawns_workers(call: ast.Call) -> bool:
    """The loader's num_workers is given and is not a literal 0 (or other false constant)."""
    workers = kwarg(call, "num_workers", 5)
    return not (workers is None or number(workers) == 0 or (isinstance(workers, ast.Constant) and not workers.value))


def _instantiates(f: FileAnalysis, expr: ast.AST, cls: ast.ClassDef) -> bool:
    """``expr`` is a call of the class ``cls``."""
    if not isinstance(expr, ast.Call):
        return False
    k = f.kind(expr.func)
    return k is not None and k.cat == "class" and k.ref is cls


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
            found = _sample_cuda_work(f, cls)
            if found is None:
                continue
            loader = _loader_of(f, cls)
            if loader is None:
                continue
            name, work = found
            workers = ast.unparse(kwarg(loader, "num_workers", 5))
            yield work, (f"`{ast.unparse(work)}` in {cls.name}.{name}, which the DataLoader on line "
                         f"{loader.lineno} runs in worker processes (num_workers={workers}): CUDA in a forked "
                         f"worker fails ('Cannot re-initialize CUDA in forked subprocess'); return CPU tensors "
                         f"and move the batch in the loop")


def _sample_cuda_work(f: FileAnalysis, cls: ast.ClassDef) -> tuple[str, ast.Call] | None:
    """(method name, call) of the first sample method (__getitem__ ...) of the Dataset class ``cls`` that
    does CUDA work; None when ``cls`` is no Dataset or none does."""
    if not _is_dataset_class(f, cls):
        return None
    for name in _SAMPLE_METHODS:
        method = f.method(cls, name)
        work = _cuda_work(f, cls, method) if method is not None else None
        if work is not None:
            return name, work
    return None
