"""Rules about devices and timing: a clock read around GPU work without a synchronize,
a ``.cuda()``/``.to()`` whose result is dropped, ``nn.DataParallel``, ``empty_cache()`` every step.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections import defaultdict
from typing import Iterator

from torch_tricks.doctor.analysis import (CLOCKS, FileAnalysis, LOOPS, MOVE_METHODS, NON_TENSOR_METHODS,
                                          SAFE_BUILTINS, SYNC_FUNCS, SYNC_METHODS, is_step_loop, pos, rate_limited,
                                          walk_local)
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
        clocks = defaultdict(list)
        for call in f.nodes[ast.Call]:
            if f.qualname(call.func) in CLOCKS:
                clocks[f.function_scope(call)].append(call)
        for scope, reads in clocks.items():
            reads.sort(key=pos)
            calls = f.calls_in(scope)  # in source order: each region is a slice (linear in the calls, not reads x calls)
            keys = [pos(c) for c in calls]
            for start, stop in zip(reads, reads[1:]):
                if not isinstance(f.parent.get(start), (ast.Assign, ast.AnnAssign)):
                    continue
                region = calls[bisect.bisect_right(keys, pos(start)):bisect.bisect_left(keys, pos(stop))]
                work = next((c for c in region if _device_work(f, c)), None)
                if work is None or any(_syncs(f, c) or _opaque(f, c) for c in region):
                    continue
                yield stop, (f"time read after CUDA work (line {work.lineno}) with no torch.cuda.synchronize() since the "
                             f"clock started (line {start.lineno}): it measures kernel launches, not the work")


def _device_work(f: FileAnalysis, call: ast.Call) -> bool:
    """A call that launches tensor work: a forward, a backward, a torch op, a tensor method."""
    func = call.func
    q = f.qualname(func)
    if q is not None:
        k = f.constructor_kind(q, call) if q.startswith("torch.") else None
        return k is not None and k.cat == "tensor"
    if isinstance(func, ast.Attribute):
        if func.attr == "backward":
            return True
        k = f.kind(func.value)
        # A copy or conversion of the batch (.to(device), .cuda(), .contiguous(memory_format=...)) is data
        # preparation, not the timed work; a blocking copy waits for the stream anyway.
        return (k is not None and k.cat == "tensor" and func.attr not in NON_TENSOR_METHODS
                and func.attr not in MOVE_METHODS and func.attr != "contiguous")
    k = f.kind(func)
    return k is not None and (k.cat in ("module", "lossfn") or (k.cat == "self" and f.is_module_class(k.ref)))


def _syncs(f: FileAnalysis, call: ast.Call) -> bool:
    """A call that waits for the device: synchronize, events, .item()/.cpu()/.tolist(),
    printing or converting a tensor, or a local helper that does one of those."""
    func = call.func
    q = f.qualname(func)
    if q in SYNC_FUNCS:
        return True
    if isinstance(func, ast.Attribute):
        if func.attr in SYNC_METHODS:
            return True
        if func.attr == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in call.args):
            return True
    if isinstance(func, ast.Name):
        if func.id in ("print", "float", "int", "bool", "str", "repr", "format"):
            return any(_mentions_tensor(f, a) for a in call.args)
        local = f.plain_functions.get(func.id)
        if local and len(local) == 1 and func.id not in f.aliases:
            return any(isinstance(n, ast.Call) and n is not call and (f.qualname(n.func) in SYNC_FUNCS or (
                isinstance(n.func, ast.Attribute) and n.func.attr in SYNC_METHODS)) for n in walk_local(local[0]))
    return False


def _mentions_tensor(f: FileAnalysis, node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            k = f.kind(n)
            if k is not None and k.cat == "tensor":
                return True
    return False


def _opaque(f: FileAnalysis, call: ast.Call) -> bool:
    """A call to code this file does not show (an imported helper might synchronise)."""
    func = call.func
    if isinstance(func, ast.Name):
        if func.id in SAFE_BUILTINS or func.id in ("print", "float", "int", "bool", "str", "repr", "format"):
            return False
        if func.id in f.plain_functions and func.id not in f.aliases:
            return False
        b = f.lookup(func)
        if b is not None and b[1] == "param":
            return False  # a model or loss passed in: forwards do not synchronise by themselves
        k = f.kind(func)
        return k is None or k.cat not in ("module", "lossfn", "class", "self")
    q = f.qualname(func)
    if q is not None:
        return not q.startswith(("torch.", "time.", "math.", "random.", "logging.", "os.", "sys.", "timeit."))
    return False


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
            call = stmt.value
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            m = call.func.attr
            if m not in MOVE_METHODS or (m == "type" and not call.args):
                continue
            recv = call.func.value
            k = f.kind(recv)
            if (k is not None and k.cat == "tensor") or (k is None and isinstance(recv, ast.Name) and f.tensor_by_use(recv)):
                recv = ast.unparse(call.func.value)
                recv = recv if len(recv) <= 30 else "x"
                yield call, (f"`{recv}.{m}()` returns a new tensor and the result is discarded: "
                             f"write `{recv} = {recv}.{m}(...)`")


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
            if f.qualname(call.func) != "torch.cuda.empty_cache":
                continue
            for anc in f.local_ancestors(call):
                if isinstance(anc, ast.ExceptHandler):
                    break  # recovering from an out-of-memory error: a fair use
                if isinstance(anc, ast.If) and rate_limited(anc.test):
                    break  # every N steps, or when memory runs high
                if isinstance(anc, LOOPS):
                    if is_step_loop(f, anc):
                        yield call, self.message
                    break
