"""Rules about devices and timing: a clock read around GPU work without a synchronize,
a ``.cuda()``/``.to()`` whose result is dropped, ``nn.DataParallel``, ``empty_cache()`` every step.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections import defaultdict
from typing import Iterator

from torch_tricks.doctor.analysis import (CLOCKS, FileAnalysis, Kind, LOOPS, MOVE_METHODS, NON_TENSOR_METHODS,
                                          SAFE_BUILTINS, SYNC_FUNCS, SYNC_METHODS, called_method, is_step_loop, pos,
                                          rate_limited, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule


@static_rule
class TimingWithoutSynchronize(StaticRule):
    id = "TT112"
    name = "timing-without-synchronize"
    severity = "warning"
    source = ("X (time.time() around device work without synchronize); P4; "
              "seeds/003 测试阶段 §1 (正确的测试时间计时代码)")
    message = ("wall-clock time read after CUDA work without torch.cuda.synchronize(): "
               "it measures kernel launches, not the work")
    explanation = ("CUDA kernels run asynchronously: time.time() / time.perf_counter() return as soon as the "
                   "kernels are queued, so the measured time is too short and the cost lands on whatever "
                   "synchronises next. Fix: torch.cuda.synchronize() before reading the clock (at both ends), or "
                   "time with torch.cuda.Event(enable_timing=True) or torch.utils.benchmark.Timer, after a "
                   "warm-up.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        if not f.mentions_cuda:
            return
        for scope, reads in _clock_reads(f).items():
            for start, stop, region in _timed_regions(f, scope, reads):
                work = _unsynced_work(f, region)
                if work is not None:
                    yield stop, (f"time read after CUDA work (line {work.lineno}) with no torch.cuda.synchronize() "
                                 f"since the clock started (line {start.lineno}): it measures kernel launches, not "
                                 f"the work")


def _clock_reads(f: FileAnalysis) -> dict[ast.AST, list[ast.Call]]:
    """The wall-clock reads of each function scope, in source order."""
    clocks = defaultdict(list)
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) in CLOCKS:
            clocks[f.function_scope(call)].append(call)
    for reads in clocks.values():
        reads.sort(key=pos)
    return clocks


def _timed_regions(f: FileAnalysis, scope: ast.AST,
                   reads: list[ast.Call]) -> Iterator[tuple[ast.Call, ast.Call, list[ast.Call]]]:
    """(start, stop, calls between them) for consecutive clock reads of ``scope`` whose first is
    assigned (``t0 = time.time()``)."""
    calls = f.calls_in(scope)  # in source order: each region is a slice (linear in the calls, not reads x calls)
    keys = [pos(c) for c in calls]
    for start, stop in zip(reads, reads[1:]):
        if isinstance(f.parent.get(start), (ast.Assign, ast.AnnAssign)):
            yield start, stop, calls[bisect.bisect_right(keys, pos(start)):bisect.bisect_left(keys, pos(stop))]


def _unsynced_work(f: FileAnalysis, region: list[ast.Call]) -> ast.Call | None:
    """The first call of ``region`` that launches device work, when no call of it waits for the
    device (or might: an opaque helper)."""
    work = next((c for c in region if _device_work(f, c)), None)
    if work is None or any(_may_sync(f, c) for c in region):
        return None
    return work


def _may_sync(f: FileAnalysis, call: ast.Call) -> bool:
    """``call`` waits for the device, or might (code this file does not show)."""
    return _syncs(f, call) or _opaque(f, call)


def _device_work(f: FileAnalysis, call: ast.Call) -> bool:
    """A call that launches tensor work: a forward, a backward, a torch op, a tensor method."""
    func = call.func
    q = f.qualname(func)
    if q is not None:
        return q.startswith("torch.") and _is_tensor(f.constructor_kind(q, call))
    if isinstance(func, ast.Attribute):
        return func.attr == "backward" or _tensor_work_method(f, func)
    return _is_model_kind(f, f.kind(func))


def _is_model_kind(f: FileAnalysis, k: Kind | None) -> bool:
    """A module or loss object, or ``self`` in a module class: calling it runs a forward."""
    return k is not None and (k.cat in ("module", "lossfn") or (k.cat == "self" and f.is_module_class(k.ref)))


def _is_tensor(k: Kind | None) -> bool:
    return k is not None and k.cat == "tensor"


def _tensor_work_method(f: FileAnalysis, func: ast.Attribute) -> bool:
    """``func`` is a compute method of a tensor.

    A copy or conversion of the batch (.to(device), .cuda(), .contiguous(memory_format=...)) is data
    preparation, not the timed work; a blocking copy waits for the stream anyway."""
    return (_is_tensor(f.kind(func.value)) and func.attr not in NON_TENSOR_METHODS
            and func.attr not in MOVE_METHODS and func.attr != "contiguous")


#: Builtins that read a tensor's value (so wait for the device) when given one.
_CONVERTERS = ("print", "float", "int", "bool", "str", "repr", "format")


def _syncs(f: FileAnalysis, call: ast.Call) -> bool:
    """A call that waits for the device: synchronize, events, .item()/.cpu()/.tolist(),
    printing or converting a tensor, or a local helper that does one of those."""
    if _waits_for_device(f, call) or _copies_to_cpu(call):
        return True
    func = call.func
    if not isinstance(func, ast.Name):
        return False
    if func.id in _CONVERTERS:
        return any(_mentions_tensor(f, a) for a in call.args)
    return _local_helper_syncs(f, call, func.id)


def _waits_for_device(f: FileAnalysis, call: ast.Call) -> bool:
    """A synchronising function (torch.cuda.synchronize ...) or method (.item(), .cpu() ...)."""
    return f.qualname(call.func) in SYNC_FUNCS or (
        isinstance(call.func, ast.Attribute) and call.func.attr in SYNC_METHODS)


def _copies_to_cpu(call: ast.Call) -> bool:
    """``x.to("cpu")``."""
    return (called_method(call) == "to"
            and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in call.args))


def _local_helper_syncs(f: FileAnalysis, call: ast.Call, name: str) -> bool:
    """``name`` is a function of this file (defined once, never rebound) that waits for the device."""
    local = _local_definition(f, name)
    return local is not None and any(isinstance(n, ast.Call) and n is not call and _waits_for_device(f, n)
                                     for n in walk_local(local))


def _local_definition(f: FileAnalysis, name: str) -> ast.AST | None:
    """The function ``name`` of this file, when it is defined once and never rebound."""
    local = f.plain_functions.get(name)
    if not local or len(local) != 1 or name in f.aliases:
        return None
    return local[0]


def _mentions_tensor(f: FileAnalysis, node: ast.AST) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) and _is_tensor(f.kind(n))
               for n in ast.walk(node))


#: Modules whose functions never synchronise behind the caller's back.
_TRANSPARENT_MODULES = ("torch.", "time.", "math.", "random.", "logging.", "os.", "sys.", "timeit.")


def _opaque(f: FileAnalysis, call: ast.Call) -> bool:
    """A call to code this file does not show (an imported helper might synchronise)."""
    func = call.func
    if isinstance(func, ast.Name):
        return _opaque_name(f, func)
    q = f.qualname(func)
    if q is not None:
        return not q.startswith(_TRANSPARENT_MODULES)
    return False


#: Builtins whose effect is known: harmless, or judged by :func:`_syncs`.
_SHOWN_BUILTINS = SAFE_BUILTINS | frozenset(_CONVERTERS)


def _opaque_name(f: FileAnalysis, func: ast.Name) -> bool:
    """A call of the plain name ``func`` to code this file does not show."""
    if func.id in _SHOWN_BUILTINS:
        return False
    if func.id in f.plain_functions and func.id not in f.aliases:
        return False
    if _is_parameter(f, func):
        return False  # a model or loss passed in: forwards do not synchronise by themselves
    k = f.kind(func)
    return k is None or k.cat not in ("module", "lossfn", "class", "self")


def _is_parameter(f: FileAnalysis, name: ast.Name) -> bool:
    """``name`` is bound as a parameter of the enclosing function."""
    b = f.lookup(name)
    return b is not None and b[1] == "param"


@static_rule
class DeviceMoveNotAssigned(StaticRule):
    id = "TT113"
    name = "device-move-not-assigned"
    severity = "error"
    source = ("X (.cuda() on a tensor without reassigning); "
              "seeds/003 Tensor的操作 §8 (将tensor以及model迁移至cuda上)")
    message = "tensor .cuda()/.to()/.cpu()/.half() returns a new tensor and the result is discarded: reassign it"
    explanation = ("For a tensor, .cuda(), .to(), .cpu(), .half(), .float() and the other conversions are not "
                   "in place: they return a converted copy and leave the original where it was (only nn.Module's "
                   ".to()/.cuda() move in place). Fix: x = x.to(device).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for stmt in f.nodes[ast.Expr]:
            call = _move_call(stmt.value)
            if call is None or not _is_tensor_value(f, call.func.value):
                continue
            m = call.func.attr
            recv = ast.unparse(call.func.value)
            recv = recv if len(recv) <= 30 else "x"
            yield call, (f"`{recv}.{m}()` returns a new tensor and the result is discarded: "
                         f"write `{recv} = {recv}.{m}(...)`")


def _move_call(node: ast.AST) -> ast.Call | None:
    """``node`` if it calls a device / dtype conversion method (``.type()`` only with an argument)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    m = node.func.attr
    if m not in MOVE_METHODS or (m == "type" and not node.args):
        return None
    return node


def _is_tensor_value(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` is a tensor, by its kind or (a name of unknown kind) by how it is used."""
    k = f.kind(node)
    return _is_tensor(k) or (k is None and isinstance(node, ast.Name) and f.tensor_by_use(node))


@static_rule
class DataParallel(StaticRule):
    id = "TT114"
    name = "data-parallel"
    severity = "warning"
    source = ("X (DataParallel use); T18; seeds/002 分布式数据并行DistributedDataParallel "
              "(DataParallel 和 DistributedDataParallel 区别)")
    message = "nn.DataParallel is single-process and slower than DistributedDataParallel: use DDP with torchrun"
    explanation = ("DataParallel drives every GPU from one Python process: each step it replicates the model, "
                   "scatters the inputs and gathers the outputs on GPU 0 (unbalanced memory), all under the GIL. "
                   "PyTorch recommends DistributedDataParallel even on one machine. Fix: one process per GPU "
                   "(torchrun), torch.distributed.init_process_group, a DistributedSampler, and "
                   "DDP(model, device_ids=[local_rank]).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            if f.qualname(call.func) in ("torch.nn.DataParallel", "torch.nn.parallel.data_parallel") \
                    and not _implements_data_parallel(f, call):
                yield call, self.message


_DP_IMPLEMENTER = re.compile(r"(Strategy|Plugin|Accelerator|DataParallel)$|data_?parallel", re.IGNORECASE)


def _implements_data_parallel(f: FileAnalysis, call: ast.Call) -> bool:
    """``call`` sits in code that offers DataParallel as one option among others (a framework's
    ``DataParallelStrategy``, a ``wrap_data_parallel`` helper): the choice is its user's, not this code's."""
    return any(isinstance(anc, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and _DP_IMPLEMENTER.search(anc.name)
               for anc in f.ancestors(call))


@static_rule
class EmptyCacheInLoop(StaticRule):
    id = "TT115"
    name = "empty-cache-in-loop"
    severity = "warning"
    source = "X (empty_cache() inside the loop); T16; seeds/001 基本操作 check list; seeds/003 内存优化和加速 §3"
    message = "torch.cuda.empty_cache() in the training loop slows every step and frees no memory your tensors use"
    explanation = ("empty_cache() only hands cached, unused blocks back to the driver (so nvidia-smi shows less); "
                   "the allocator then has to cudaMalloc them again, which synchronises and costs time every "
                   "step. It never frees memory held by live tensors, so it does not cure an out-of-memory "
                   "error. Fix: remove it from the loop; if memory grows, find what keeps tensors alive (e.g. an "
                   "accumulated loss, TT117).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            if f.qualname(call.func) == "torch.cuda.empty_cache" and _runs_every_step(f, call):
                yield call, self.message


def _runs_every_step(f: FileAnalysis, node: ast.AST) -> bool:
    """The innermost loop around ``node`` is a training-step loop, and no except handler or
    rate-limiting ``if`` between them makes it occasional."""
    for anc in f.local_ancestors(node):
        if isinstance(anc, ast.ExceptHandler):
            return False  # recovering from an out-of-memory error: a fair use
        if isinstance(anc, ast.If) and rate_limited(anc.test):
            return False  # every N steps, or when memory runs high
        if isinstance(anc, LOOPS):
            return is_step_loop(f, anc)
    return False
