"""See the model's graph (catalogue item P6): autograd DOT/SVG, ONNX for Netron, TensorBoard.

Three views, each from PyTorch's own machinery where one exists:

* :func:`autograd_dot` walks ``grad_fn.next_functions`` and writes Graphviz DOT: the graph
  that backward will actually run, with parameters named and shaped.
* :func:`export_onnx` uses ``torch.onnx.export`` (the ``torch.export``-based "dynamo"
  exporter); open the file in Netron.
* :func:`tensorboard_graph` uses ``SummaryWriter.add_graph`` (a TorchScript trace).

:func:`save_graph` picks one of them from the file extension. Inputs are a tensor, a tuple of
positional inputs or a dict of keyword inputs (a transformers model's ``input_ids``,
``attention_mask``), in all three views.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from torch_tricks._io import atomic_path
from torch_tricks._optional import require
from torch_tricks.errors import UserError
from torch_tricks.inspect.inputs import call_model, split_inputs

__all__ = [
    "autograd_dot",
    "model_graph",
    "render_dot",
    "export_onnx",
    "tensorboard_graph",
    "save_graph",
    "GRAPH_FORMATS",
]

#: Formats :func:`save_graph` understands (file extension without the dot, or "tensorboard").
GRAPH_FORMATS = ("dot", "svg", "png", "pdf", "onnx", "tensorboard")
_RENDER_FORMATS = ("svg", "png", "pdf")
# Above this many bytes of weights ONNX must keep them in a side file (protobuf's 2 GiB limit).
_ONNX_INLINE_LIMIT = 1_800_000_000


def autograd_dot(
    outputs: Any,
    params: Mapping[str, torch.Tensor] | None = None,
    *,
    show_saved: bool = False,
    max_nodes: int = 5000,
) -> str:
    """The autograd graph behind ``outputs`` (a tensor, or a tuple/list/dict of them) as DOT.

    Nodes are backward functions (``AddmmBackward0``...), leaf tensors (named from
    ``params``, e.g. ``dict(model.named_parameters())``, with their shapes) and the outputs.
    ``show_saved`` adds the tensors each function saved for backward (the activation
    memory). Written by hand: torchviz does the same walk but needs the ``graphviz`` Python
    package and is unmaintained, while DOT is plain text that any Graphviz can render.
    Stops after ``max_nodes`` nodes and says so in the graph label.
    """
    if not _is_int(max_nodes) or max_nodes < 1:
        raise UserError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
    tensors = _graph_outputs(outputs)
    names = {id(t): name for name, t in (params or {}).items() if isinstance(t, torch.Tensor)}
    dot = _AutogradDot(names, show_saved)
    dot.add_outputs(tensors)
    if not dot.walk(max_nodes):
        dot.mark_truncated(max_nodes)
    dot.lines.append("}")
    return "\n".join(dot.lines) + "\n"


def model_graph(model: torch.nn.Module, inputs: Any, *, show_saved: bool = False, max_nodes: int = 5000) -> str:
    """Run ``model`` on ``inputs`` with grad enabled and return its autograd graph as DOT."""
    with torch.enable_grad():
        out = call_model(model, inputs)
    return autograd_dot(out, dict(model.named_parameters()), show_saved=show_saved, max_nodes=max_nodes)


def render_dot(dot: str, path: str | os.PathLike[str], format: str = "svg") -> Path:
    """Render DOT text with Graphviz's ``dot`` program into ``path`` (written atomically)."""
    exe = shutil.which("dot")
    if exe is None:
        raise UserError(
            "rendering needs Graphviz's `dot` program: install Graphviz (apt-get install graphviz, "
            "brew install graphviz) or save a .dot file and view it elsewhere"
        )
    fmt = format.lower().lstrip(".")
    if not fmt.isalnum():
        raise UserError(f"bad Graphviz output format {format!r}: use e.g. svg, png or pdf")
    with atomic_path(path) as tmp:
        proc = subprocess.run(
            [exe, f"-T{fmt}", "-o", str(tmp)], input=dot.encode(), capture_output=True, check=False
        )
        if proc.returncode != 0:
            msg = " ".join(proc.stderr.decode(errors="replace").split())[:300]
            raise UserError(f"Graphviz could not render {format!r}: {msg}")
    return Path(path)


def export_onnx(
    model: torch.nn.Module,
    inputs: Any,
    path: str | os.PathLike[str],
    *,
    opset: int | None = None,
    dynamic_batch: bool = True,
) -> Path:
    """Export ``model`` to an ONNX file (for Netron or onnxruntime) with ``torch.onnx.export``.

    Uses the ``torch.export``-based exporter (``dynamo=True``, PyTorch's default since 2.9):
    the TorchScript one is deprecated, and on torch 2.13 the dynamo one exports CNNs,
    ``nn.TransformerEncoder`` (batch_first) and LSTMs that match eager to ~1e-7. It needs the
    ``onnx`` and ``onnxscript`` packages. The model is exported in eval mode (each module's
    mode is restored afterwards) with the fused attention fast path off.

    ``dynamic_batch`` makes dim 0 symbolic for every tensor input whose dim 0 matches the
    first input's. torch.export silently specialises a size-1 dim for some models, so a
    batch of 1 is repeated to 2 for tracing; pass ``dynamic_batch=False`` for a model that
    hard-codes its batch size. Keyword inputs (a dict) become the ONNX graph's named inputs.
    Weights above ~1.8 GB go to a ``.data`` side file next to ``path``. Export errors from
    torch are raised as they are.
    """
    require("onnx", "onnx", "ONNX export")
    require("onnxscript", "onnx", "ONNX export")
    if opset is not None and (not _is_int(opset) or opset < 7):
        raise UserError(f"opset must be an ONNX opset number such as 18, got {opset!r}")
    args, kwargs = split_inputs(inputs)
    dynamic_shapes = None
    if dynamic_batch:
        args, kwargs, dynamic_shapes = _batch_dynamic(args, kwargs)
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    target = _onnx_target(path)
    # Export into a private folder beside the target (with the final file name, since a .data
    # side file is referenced by name), then move the files into place.
    tmpdir = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        with in_eval_mode(model), _quiet_export():
            torch.onnx.export(
                model,
                args,
                str(tmpdir / target.name),
                kwargs=kwargs or None,
                dynamo=True,
                opset_version=opset,
                dynamic_shapes=dynamic_shapes,
                external_data=weight_bytes > _ONNX_INLINE_LIMIT,
                verbose=False,
            )
        _move_files(tmpdir, target)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return target


def tensorboard_graph(model: torch.nn.Module, inputs: Any, logdir: str | os.PathLike[str]) -> Path:
    """Write the model graph as a TensorBoard event file in ``logdir`` (``tensorboard --logdir``).

    ``add_graph`` traces with TorchScript and re-runs the model to check the trace, so the
    model is traced in eval mode (dropout would make the runs differ) with the fused
    attention fast path off (it takes another code path under the check's no_grad).
    Keyword inputs are traced through a module that takes them positionally (the tracer
    behind ``add_graph`` has no keyword inputs), so the graph's top scope is ``KeywordInputs``.
    """
    require("tensorboard", "tensorboard", "TensorBoard export")
    from torch.utils.tensorboard import SummaryWriter
    logdir = Path(logdir)
    if logdir.exists() and not logdir.is_dir():
        raise UserError(f"TensorBoard log dir {str(logdir)!r} is a file: give a directory")
    args, kwargs = split_inputs(inputs)
    if kwargs:
        model, args = KeywordInputs(model, list(kwargs)), tuple(kwargs.values())
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        # add_graph prints the exception before re-raising it; the library must not print.
        with in_eval_mode(model), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # add_graph has no other tracer; its deprecation is torch's to solve, not the user's.
            warnings.filterwarnings("ignore", r"`torch\.jit\.trace", DeprecationWarning)
            writer.add_graph(model, args, use_strict_trace=False)
    finally:
        writer.close()
    return logdir


def save_graph(model: torch.nn.Module, inputs: Any, path: str | os.PathLike[str], fmt: str | None = None) -> Path:
    """Save the model graph in the format named by ``fmt`` or, failing that, by ``path``'s extension.

    ``.dot`` writes DOT text; ``.svg``/``.png``/``.pdf`` render it with Graphviz; ``.onnx``
    exports ONNX; a directory (or a path without extension) gets a TensorBoard event file.
    """
    p = Path(path)
    fmt = _graph_format(p, fmt)
    if fmt not in GRAPH_FORMATS:
        raise UserError(
            f"unknown graph format {fmt!r} for {str(p)!r}: use a .dot, .svg, .png, .pdf or .onnx "
            "file, or a directory for TensorBoard"
        )
    if fmt == "onnx":
        return export_onnx(model, inputs, p)
    if fmt == "tensorboard":
        return tensorboard_graph(model, inputs, p)
    dot = model_graph(model, inputs)
    if fmt == "dot":
        with atomic_path(p) as tmp:
            tmp.write_text(dot, encoding="utf-8")
        return p
    return render_dot(dot, p, fmt)


# --- helpers ---------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    """An int proper: ``True`` is an int to Python but never a count."""
    return isinstance(value, int) and not isinstance(value, bool)


def _graph_outputs(outputs: Any) -> list[torch.Tensor]:
    """The output tensors of :func:`autograd_dot`; a UserError where they have no graph to draw."""
    tensors = [t for t in _flatten(outputs) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise UserError("autograd_dot needs the model's output tensor(s); got no tensors")
    if not any(t.grad_fn is not None or t.requires_grad for t in tensors):
        raise UserError(
            "the outputs carry no autograd graph: run the forward outside torch.no_grad()/"
            "inference_mode() with parameters that require grad"
        )
    return tensors


def _onnx_target(path: str | os.PathLike[str]) -> Path:
    """The ONNX file's path, its folder created."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"ONNX path {str(target)!r} is a directory: give a file name such as model.onnx")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def _move_files(tmpdir: Path, target: Path) -> None:
    """Move what the export wrote next to ``target``, the model file last."""
    produced = sorted(tmpdir.iterdir(), key=lambda p: p.name == target.name)
    for p in produced:
        os.replace(p, target.parent / p.name)


def _graph_format(p: Path, fmt: str | None) -> str:
    """``fmt`` normalised or, when None, the format ``p`` implies (a directory or no extension: tensorboard)."""
    if fmt is None:
        ext = p.suffix.lower().lstrip(".")
        fmt = "tensorboard" if p.is_dir() or not ext else ext
    return fmt.lower().lstrip(".")


class _AutogradDot:
    """The DOT lines of :func:`autograd_dot`, built as the walk goes: outputs, then a breadth-first
    walk from their grad_fns, then (if it stopped early) the nodes left undescribed."""

    def __init__(self, names: dict[int, str], show_saved: bool) -> None:
        self.names = names
        self.show_saved = show_saved
        self.lines = [
            "digraph autograd {",
            '  graph [rankdir=TB, fontname="monospace", fontsize=10];',
            '  node [shape=box, style="rounded,filled", fillcolor="#eeeeee", fontname="monospace", fontsize=10];',
            '  edge [fontname="monospace", fontsize=9];',
        ]
        self.ids: dict[int, str] = {}
        self.keep: list[Any] = []  # hold references so id() values stay unique during the walk
        self.queue: list[Any] = []
        self.done: set[int] = set()

    def node_id(self, obj: Any) -> str:
        key = id(obj)
        if key not in self.ids:
            self.ids[key] = f"n{len(self.ids)}"
            self.keep.append(obj)
        return self.ids[key]

    def add_leaf(self, nid: str, t: torch.Tensor) -> None:
        name = self.names.get(id(t))
        label = f"{name}\n{_shape(t)}" if name else f"(leaf tensor)\n{_shape(t)}"
        self.lines.append(f"  {nid} [label={_q(label)}, fillcolor=lightblue];")

    def add_outputs(self, tensors: list[torch.Tensor]) -> None:
        """One node per output, an edge from what produced it, and its grad_fn queued for the walk."""
        for i, t in enumerate(tensors):
            out_id = f"out{i}"
            label = f"output{'' if len(tensors) == 1 else f' {i}'}\n{_shape(t)}"
            self.lines.append(f"  {out_id} [label={_q(label)}, fillcolor=darkolivegreen1];")
            if t.grad_fn is not None:
                self.lines.append(f"  {self.node_id(t.grad_fn)} -> {out_id};")
                self.queue.append(t.grad_fn)
            elif t.requires_grad:  # the output is itself a leaf
                self.add_leaf_output(t, out_id)

    def add_leaf_output(self, t: torch.Tensor, out_id: str) -> None:
        """An output that is a leaf tensor: its node (once) and the edge to the output node."""
        if id(t) not in self.done:
            self.done.add(id(t))
            self.add_leaf(self.node_id(t), t)
        self.lines.append(f"  {self.node_id(t)} -> {out_id};")

    def walk(self, max_nodes: int) -> bool:
        """Describe the queued backward functions breadth-first; False when ``max_nodes`` stopped it."""
        head = 0
        while head < len(self.queue):
            fn = self.queue[head]
            head += 1
            if id(fn) in self.done:
                continue
            if len(self.done) >= max_nodes:
                return False
            self.done.add(id(fn))
            self.add_function(fn)
        return True

    def add_function(self, fn: Any) -> None:
        """A backward function's node (a leaf's for AccumulateGrad), its in-edges, its inputs queued."""
        nid = self.node_id(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            self.add_leaf(nid, variable)
        else:
            label = type(fn).__name__
            if self.show_saved:
                label += "".join(f"\n{k}: {v}" for k, v in _saved(fn))
            self.lines.append(f"  {nid} [label={_q(label)}];")
        for nxt, _ in getattr(fn, "next_functions", ()):
            if nxt is not None:
                self.lines.append(f"  {self.node_id(nxt)} -> {nid};")
                self.queue.append(nxt)

    def mark_truncated(self, max_nodes: int) -> None:
        described = {self.ids[k] for k in self.done if k in self.ids}
        for nid in self.ids.values():
            if nid not in described:
                self.lines.append(f'  {nid} [label="...", style=dashed];')
        self.lines.append(f"  graph [label={_q(f'truncated after {max_nodes} nodes (max_nodes)')}, labelloc=t];")


def _q(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, newlines as ``\\n``."""
    text = text.replace("\\", "\\\\").replace('"', '\\"')
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n")
    return f'"{text}"'


def _shape(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"({', '.join(map(str, t.shape))}) {dtype}"


def _saved(fn: Any) -> Iterator[tuple[str, str]]:
    """What a backward node saved, from its ``_saved_*`` attributes (tensors as shapes)."""
    for attr in sorted(a for a in dir(fn) if a.startswith("_saved_")):
        try:
            value = getattr(fn, attr)
        except Exception:  # some saved values raise once freed by backward
            continue
        yield attr.removeprefix("_saved_"), _saved_text(value)


def _saved_text(value: Any) -> str:
    """A saved value for a node label: tensors as shapes, anything else as a short repr."""
    if isinstance(value, torch.Tensor):
        return _shape(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return "[" + ", ".join(_shape(v) if isinstance(v, torch.Tensor) else repr(v) for v in value) + "]"
    text = repr(value)
    return text[:57] + "..." if len(text) > 60 else text


def _flatten(obj: Any) -> Iterator[Any]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _flatten(v)


class KeywordInputs(torch.nn.Module):
    """``model`` called with keyword inputs given positionally: ``forward(*values)`` runs
    ``model(**dict(zip(names, values)))``, for tracers that take positional inputs only."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = list(names)

    def forward(self, *values: Any) -> Any:
        return self.model(**dict(zip(self.names, values)))


def _batch_dynamic(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...] | dict[str, Any] | None]:
    """Mark dim 0 as ``batch`` on tensor inputs that share the first tensor's dim 0: a tuple of
    specs for positional inputs, a dict by name for keyword ones (torch.export's two forms)."""
    values = [*args, *kwargs.values()]
    tensors = [a for a in values if _has_batch_dim(a)]
    if not tensors:
        return args, kwargs, None
    batch = tensors[0].shape[0]
    dim = torch.export.Dim("batch")
    new_values, shapes = zip(*(_mark_batch(a, batch, dim) for a in values))
    if kwargs:  # split_inputs gives keyword or positional inputs, never both
        return (), dict(zip(kwargs, new_values)), dict(zip(kwargs, shapes))
    return tuple(new_values), {}, tuple(shapes)


def _has_batch_dim(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.dim() >= 1


def _mark_batch(a: Any, batch: int, dim: Any) -> tuple[Any, dict[int, Any] | None]:
    """``a`` and its dynamic-shape spec: ``{0: dim}`` for a tensor of this batch (a batch of 1
    repeated to 2, which torch.export would specialise), None for anything else."""
    if not (_has_batch_dim(a) and a.shape[0] == batch):
        return a, None
    if batch == 1:
        a = torch.cat([a, a])
    return a, {0: dim}


@contextlib.contextmanager
def in_eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no MHA fast path for the duration; each module's own mode is restored."""
    modes = [(m, m.training) for m in model.modules()]
    get_fast = getattr(torch.backends.mha, "get_fastpath_enabled", None)
    set_fast = getattr(torch.backends.mha, "set_fastpath_enabled", None)
    fast = get_fast() if get_fast is not None else None
    model.eval()
    if set_fast is not None:
        set_fast(False)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        if set_fast is not None and fast is not None:
            set_fast(fast)


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Hide torch-internal deprecation warnings, "torchvision is not installed" log lines and
    onnxscript's constant folding giving up on a node ("Evaluation failed": the node stays)."""
    logs = [logging.getLogger(name) for name in ("torch.onnx._internal.exporter._registration",
                                                 "onnxscript.optimizer._constant_folding")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            # nn.LSTM's flat-weights cache trips torch.export's attribute check; harmless.
            warnings.filterwarnings("ignore", r"The tensor attributes .* were assigned during export")
            # several inputs sharing the one batch dim: the exporter names it once; harmless.
            warnings.filterwarnings("ignore", r"# The axis name: .* will not be used")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
