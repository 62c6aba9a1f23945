"""Memory accounting of a training step, and a leak check across steps (P3, T27).

* :func:`memory_report`: bytes of parameters, gradients and optimizer state (for the
  real optimizer after a real step), activations saved for backward (measured with
  ``saved_tensors_hooks``, each storage once, parameters excluded), and the peak of one
  training step: device peak on CUDA, process peak (``VmHWM``) on CPU, and everywhere
  the peak of live tensor bytes the step allocated.
* :func:`leak_check`: runs a step function N times and reports live tensor memory
  growth per step; it flags the ``total_loss += loss`` pattern, which keeps every step's
  graph (and its saved activations) alive, and stays quiet for ``loss.item()``.

Why a hand-written tensor tracker (:class:`LiveTensors`): CUDA has
``memory_allocated()``, but the CPU allocator exposes no counter, and process RSS moves
with allocator caching and page reuse, so it cannot tell a small per-step leak from
noise. A dispatch mode sees every tensor the step creates, and a ``weakref.finalize``
on its storage sees it die, which gives exact live bytes on any device.
"""

from __future__ import annotations

import copy
import gc

import threading
import time
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from torch_tricks._format import human_bytes, table
from torch_tricks._gc import new_objects_only
from torch_tricks.device import module_device
from torch_tricks.inspect.inputs import input_tensors
from torch_tricks.inspect.step import Workloads

__all__ = [
    "MemoryReport",
    "LeakReport",
    "LiveTensors",
    "memory_report",
    "saved_activation_bytes",
    "leak_check",
    "process_memory",
]


@dataclass
class MemoryReport:
    """Bytes of one training step. ``None`` where a figure cannot be measured here."""

    device: str
    optimizer: str
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int  # saved for backward, unique storages, parameters excluded
    saved_tensors: int
    input_bytes: int
    step_tensor_peak_bytes: int  # peak of live tensors allocated by the step itself
    device_peak_bytes: int | None  # CUDA: max_memory_allocated during the step
    process_peak_bytes: int | None  # CPU: peak resident set size during the step
    process_peak_method: str | None
    activation_by_module: dict[str, int] = field(default_factory=dict)

    @property
    def model_state_bytes(self) -> int:
        """Parameters + buffers + gradients + optimizer state: what stays between steps."""
        return self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optimizer_state_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model_state_bytes"] = self.model_state_bytes
        return d

    def to_text(self, model_name: str = "model", batch: int | None = None, top: int = 8) -> str:
        """What ``torch-tricks memory`` prints: the breakdown, then the ``top`` modules by saved
        activations. ``model_name`` and ``batch`` head it, as the report does not know them."""
        rows = [
            ["parameters", human_bytes(self.param_bytes)],
            ["buffers", human_bytes(self.buffer_bytes)],
            ["gradients", human_bytes(self.grad_bytes)],
            [f"optimizer state ({self.optimizer})", human_bytes(self.optimizer_state_bytes)],
            ["= model state between steps", human_bytes(self.model_state_bytes)],
            [f"activations saved for backward ({self.saved_tensors} tensors)", human_bytes(self.activation_bytes)],
            ["input batch", human_bytes(self.input_bytes)],
            ["peak of tensors allocated in a step", human_bytes(self.step_tensor_peak_bytes)],
        ]
        if self.device_peak_bytes is not None:
            rows.append(["device peak during a step (max_memory_allocated)", human_bytes(self.device_peak_bytes)])
        if self.process_peak_bytes is not None:
            rows.append([f"process peak RSS during a step ({self.process_peak_method})",
                         human_bytes(self.process_peak_bytes)])
        head = f"{model_name}, batch {batch}" if batch is not None else model_name
        text = [f"{head}, {self.device}:", table(["memory", "bytes"], rows)]
        largest = list(self.activation_by_module.items())[:top]
        if largest:
            text += ["", "largest saved activations by module:"]
            text += [f"  {name or '(model)'}: {human_bytes(b)}" for name, b in largest]
        return "\n".join(text)


def memory_report(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    copy_model: bool = True,
    target: Any = None,
) -> MemoryReport:
    """Measure the memory of a real training step of ``model`` on ``inputs``.

    Two steps run: the first creates gradients and optimizer state and counts the saved
    activations, the second is the steady-state step whose peak is reported. The model
    is deep-copied first (``copy_model``) so its weights are left untouched. ``inputs``: a
    tensor, a tuple (positional) or a dict (keyword inputs); with ``target`` the loss is
    ``loss_fn(output, target)``, else ``loss_fn(output)`` (default: the sum of the output means).
    """
    work_model = copy.deepcopy(model) if copy_model else model
    work_model.train()
    wl = Workloads(work_model, inputs, loss_fn=loss_fn, optimizer=optimizer, target=target)
    device = module_device(work_model, input_tensors(wl.inputs))

    # Step 1: saved activations, gradients, optimizer state.
    wl.optimizer.zero_grad(set_to_none=True)
    saved = _SavedTensorCounter(work_model)
    with saved:
        loss = wl.loss()
    loss.backward()
    wl.optimizer.step()
    del loss

    param_bytes = _bytes(work_model.parameters())
    buffer_bytes = _bytes(work_model.buffers())
    grad_bytes = _bytes(p.grad for p in work_model.parameters() if p.grad is not None)
    opt_bytes = _optimizer_state_bytes(wl.optimizer)

    # Step 2: the steady-state peak.
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
    peak = _ProcessPeak() if not cuda else None
    with LiveTensors() as live:
        if peak:
            peak.start()
        wl.step()
        if cuda:
            torch.cuda.synchronize(device)
        if peak:
            peak.stop()
    device_peak = torch.cuda.max_memory_allocated(device) - base_alloc if cuda else None
    input_bytes = sum(t.numel() * t.element_size() for t in input_tensors(wl.inputs))
    return MemoryReport(
        device=str(device),
        optimizer=optimizer if isinstance(optimizer, str) else type(wl.optimizer).__name__,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=opt_bytes,
        activation_bytes=saved.total_bytes,
        saved_tensors=saved.count,
        input_bytes=input_bytes,
        step_tensor_peak_bytes=live.peak_bytes,
        device_peak_bytes=device_peak,
        process_peak_bytes=peak.peak_bytes if peak else None,
        process_peak_method=peak.method if peak else None,
        activation_by_module=dict(sorted(saved.by_module.items(), key=lambda kv: -kv[1])),
    )


def saved_activation_bytes(model: nn.Module, inputs: Any, loss_fn: Callable[..., Any] | None = None) -> int:
    """Bytes saved for backward by one forward of ``model`` (unique storages, no parameters)."""
    wl = Workloads(model, inputs, loss_fn=loss_fn)
    saved = _SavedTensorCounter(model)
    with saved:
        loss = wl.loss()
    del loss
    return saved.total_bytes


@dataclass
class LeakReport:
    """Memory after each step of :func:`leak_check`: live tensor bytes, and the size of
    autograd graphs still reachable from live tensors (in nodes)."""

    live_bytes: list[int]
    graph_nodes: list[int]
    rss_bytes: list[int | None]
    warmup: int
    growth_per_step_bytes: float
    graph_growth_per_step: float
    measured_steps: int
    leaking: bool
    reasons: list[str]
    threshold_bytes: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["message"] = self.message
        return d

    @property
    def message(self) -> str:
        if self.leaking:
            return "; ".join(self.reasons) + (
                " (e.g. `total_loss += loss` keeps every step's graph alive: use loss.item() or loss.detach())"
            )
        return (
            f"no growth over {self.measured_steps} steps after {self.warmup} warm-up steps "
            f"(threshold {self.threshold_bytes} B/step for tensors, 1 node/step for graphs)"
        )

    def to_text(self) -> str:
        """The line ``torch-tricks memory --leak-steps`` prints."""
        return f"leak check: {'LEAK: ' if self.leaking else ''}{self.message}"


def leak_check(
    step_fn: Callable[[], Any],
    *,
    steps: int = 8,
    warmup: int = 2,
    threshold_bytes: int = 1024,
    device: torch.device | str | None = None,
) -> LeakReport:
    """Run ``step_fn`` ``warmup + steps`` times and report memory growth per step.

    Two signals, both exact rather than read off the noisy process RSS:

    * live bytes of tensors created inside the check (CUDA: ``memory_allocated``), which
      catches tensors piling up in a list, a cache, or graphs kept before ``backward``;
    * autograd graph nodes reachable from live tensors, which catches ``total_loss +=
      loss`` after ``backward``: the saved tensors are freed, but every step's graph
      stays chained to ``total_loss``.

    A signal counts as a leak when it grows on average (more than ``threshold_bytes``
    per step, or 1 node per step) and grew in at least 3/4 of the measured steps.
    """
    if steps < 2:
        raise ValueError("leak_check needs steps >= 2 to see a trend")
    cuda = device is not None and torch.device(device).type == "cuda"
    live_series: list[int] = []
    nodes: list[int] = []
    rss: list[int | None] = []
    with _GraphCensus() as census, LiveTensors() as live:
        for _ in range(warmup + steps):
            step_fn()
            gc.collect()  # only what the steps made, once the census has frozen the rest
            if cuda:
                torch.cuda.synchronize(device)
                live_series.append(torch.cuda.memory_allocated(device))
            else:
                live_series.append(live.live_bytes)
            nodes.append(census.graph_nodes())
            rss.append(process_memory().get("rss"))
    growth, grew_b = _trend(live_series[warmup:])
    node_growth, grew_n = _trend(nodes[warmup:])
    need = 0.75 * (steps - 1)
    reasons = []
    if growth > threshold_bytes and grew_b >= need:
        reasons.append(f"live tensors grow by {growth / 1024:.1f} KiB per step")
    if node_growth >= 1 and grew_n >= need:
        reasons.append(f"autograd graphs kept alive across steps grow by {node_growth:.0f} nodes per step")
    return LeakReport(
        live_bytes=live_series,
        graph_nodes=nodes,
        rss_bytes=rss,
        warmup=warmup,
        growth_per_step_bytes=float(growth),
        graph_growth_per_step=float(node_growth),
        measured_steps=steps,
        leaking=bool(reasons),
        reasons=reasons,
        threshold_bytes=threshold_bytes,
    )


def _trend(series: list[int]) -> tuple[float, int]:
    """(average growth per step, number of steps that grew)."""
    deltas = [b - a for a, b in zip(series, series[1:])]
    return (series[-1] - series[0]) / max(len(deltas), 1), sum(d > 0 for d in deltas)


class _GraphCensus:
    """Autograd nodes reachable from every live tensor, counted cheaply in a large process.

    A full ``gc.collect()`` and ``gc.get_objects()`` per step cost about half a second
    each in a process holding millions of objects, which is most of a leak check; inside
    :func:`~torch_tricks._gc.new_objects_only` both see only what the steps made. The
    tensors that existed before are kept by weak reference and looked at too, since one
    of them can start to carry a graph (``total += loss`` on a tensor made before the check).
    """

    def __enter__(self) -> "_GraphCensus":
        self._scope = new_objects_only()
        # the scans below miss what the scope freezes: its tensors are kept here (none when nothing will be frozen)
        self._old = [] if gc.get_freeze_count() else [weakref.ref(t) for t in _tensors(gc.get_objects())]
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)

    def graph_nodes(self) -> int:
        old = (ref() for ref in self._old)
        roots = [t.grad_fn for t in (*_tensors(gc.get_objects()), *old) if t is not None and t.grad_fn is not None]
        seen: set[int] = set()
        keep: list[Any] = []  # holds the nodes while counting, so that no id is reused
        todo = roots
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            keep.append(node)
            todo.extend(fn for fn, _ in getattr(node, "next_functions", ()))
        return len(seen)


def _tensors(objects: list[Any]) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on some module proxies warns
        return [o for o in objects if isinstance(o, torch.Tensor)]


class LiveTensors(TorchDispatchMode):
    """Live and peak bytes of tensor storages allocated while active (see module docstring).

    Only storages an op *allocates* count: an op whose output shares storage with one of
    its inputs (a view, ``detach``, ``.data``, an in-place op) allocates nothing, and
    counting it would count weights that existed before the region (``copy.deepcopy``
    reads them through ``.data``, checkpointing through ``detach``) as new.

    Two things a dispatch mode alone does not see are followed too, so that FSDP2's
    per-rank memory is right: a wrapper subclass (a DTensor) owns no storage of its own,
    its local tensors do (they are counted); and FSDP2 frees and re-allocates the
    unsharded parameters by resizing their storage in place (``UntypedStorage.resize_``,
    not an op): while the mode is active, a resize of a counted storage changes the count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._alive: dict[int, int] = {}  # id(storage) -> the bytes counted for it
        self._lock = threading.Lock()
        self._resize: Any = None

    def __enter__(self) -> "LiveTensors":
        _RESIZE_WATCHERS.append(self)
        if len(_RESIZE_WATCHERS) == 1:
            _patch_resize(True)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _RESIZE_WATCHERS.remove(self)
            if not _RESIZE_WATCHERS:
                _patch_resize(False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(st) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)
                  for st in _storages(t)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    if id(st) not in inputs:
                        self._track(st)
        return out

    def _track(self, st: Any) -> None:
        key = id(st)
        if key in self._alive:
            return
        nbytes = st.nbytes()
        with self._lock:
            self._alive[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(st, self._free, key)

    def _resized(self, st: Any) -> None:
        key = id(st)
        with self._lock:
            old = self._alive.get(key)
            if old is None:
                return
            new = st.nbytes()
            self._alive[key] = new
            self.live_bytes += new - old
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int) -> None:
        with self._lock:
            nbytes = self._alive.pop(key, None)
            if nbytes is not None:
                self.live_bytes -= nbytes


_RESIZE_WATCHERS: list[LiveTensors] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _patch_resize(on: bool) -> None:
    """Route ``UntypedStorage.resize_`` through the active trackers (FSDP2 frees/re-allocates this way)."""
    if not on:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
        return

    def resize_(self, size):  # noqa: ANN001 - the storage method's own signature
        out = _ORIGINAL_RESIZE(self, size)
        for w in list(_RESIZE_WATCHERS):
            w._resized(self)
        return out

    torch.UntypedStorage.resize_ = resize_


def _storages(t: torch.Tensor) -> list[Any]:
    """The storages ``t`` owns: its own, or a wrapper subclass's inner tensors' (a DTensor's local shard)."""
    if type(t) is not torch.Tensor and type(t) is not nn.Parameter and is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [st for a in attrs for st in _storages(getattr(t, a))]
    try:
        return [t.untyped_storage()]
    except Exception:  # tensors without storage (sparse, some subclasses)
        return []


def process_memory() -> dict[str, int]:
    """Resident set size and its high-water mark of this process, from ``/proc`` (Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key = "rss" if line.startswith("VmRSS") else "hwm"
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        import resource

        out["hwm"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


# -- internals --------------------------------------------------------------------------

class _ProcessPeak:
    """Peak RSS during a region: resets the kernel's high-water mark when allowed
    (``/proc/self/clear_refs``), else samples RSS from a thread every millisecond."""

    def __init__(self) -> None:
        self.peak_bytes: int | None = None
        self.method: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._samples: list[int] = []

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM"
            return
        except OSError:
            pass
        self.method = "sampled-rss"
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = process_memory().get("rss")
            if rss is not None:
                self._samples.append(rss)
            time.sleep(0.001)

    def stop(self) -> None:
        if self.method == "VmHWM":
            self.peak_bytes = process_memory().get("hwm")
        else:
            self._stop.set()
            if self._thread:
                self._thread.join()
            self._samples.append(process_memory().get("rss", 0))
            self.peak_bytes = max(self._samples)


class _SavedTensorCounter:
    """Counts tensors saved for backward, each storage once, parameters and buffers excluded,
    attributed to the innermost module running when they were saved."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.exclude = {id(p.untyped_storage()) for p in model.parameters()}
        self.exclude |= {id(b.untyped_storage()) for b in model.buffers()}
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # storages stay referenced so ids are not reused
        self.total_bytes = 0
        self.count = 0
        self.by_module: dict[str, int] = {}
        self._stack: list[str] = []
        self._hooks: list[Any] = []
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
        except Exception:
            return t
        key = id(st)
        if key in self.exclude or key in self.seen:
            return t
        self.seen.add(key)
        self.keep.append(st)
        self.count += 1
        self.total_bytes += st.nbytes()
        where = self._stack[-1] if self._stack else ""
        self.by_module[where] = self.by_module.get(where, 0) + st.nbytes()
        return t

    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        name = self.names.get(id(module))
        if name is not None and self._stack and self._stack[-1] == name:
            self._stack.pop()

    def __enter__(self) -> "_SavedTensorCounter":
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._pre),
            nn.modules.module.register_module_forward_hook(self._post),
        ]
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self._stack.clear()
        self.keep.clear()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and id(v) not in seen:
                seen.add(id(v))
                total += v.numel() * v.element_size()
    return total



