"""Rules about checkpoints: ``torch.load`` without ``map_location`` or ``weights_only``, ``torch.save`` of a
whole module; and what a ``torch.load`` reads as far as the file shows (:func:`loaded_checkpoint`), which
TT111's message and ``doctor --fix`` both go by.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterator

from torch_tricks.doctor.analysis import (MODULE_ONLY_METHODS, FileAnalysis, called_method, end, is_name, kwarg, pos,
                                          root_name)
from torch_tricks.doctor.registry import StaticRule, static_rule


def _calls_of(f: FileAnalysis, q: str) -> Iterator[ast.Call]:
    """The calls of ``q`` in the file, except those passing ``**kwargs``."""
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) == q and not any(kw.arg is None for kw in call.keywords):
            yield call


@static_rule
class TorchLoadWithoutMapLocation(StaticRule):
    id = "TT110"
    name = "torch-load-without-map-location"
    severity = "info"
    source = ("X (torch.load without map_location); T20, T26; "
              "seeds/003 训练阶段 §6 (载入模型权重GPU内存被额外占用); "
              "seeds/002 问题 §1")
    message = "torch.load without map_location restores tensors to the device they were saved from: pass map_location"
    explanation = ("Without map_location, tensors saved from cuda:0 are loaded back onto cuda:0: on a machine "
                   "without that GPU the load fails, and under DDP every process allocates memory on GPU 0 (the "
                   "extra processes seen in nvidia-smi). Fix: torch.load(f, map_location='cpu') and then "
                   "load_state_dict / .to(device), or map_location=f'cuda:{local_rank}'.")

    tier = "hygiene"
    tier_why = ("most loads are of files written from CPU tensors or reloaded by the same run on the same device "
                "(13 of 18 findings on the real-code set were such): reported by default only where the file saves "
                "the weights of a model it moves to an accelerator, not moved back to the CPU, so a CPU-only "
                "machine (or another rank's GPU) would have to load GPU tensors")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in _calls_of(f, "torch.load"):
            if _device_mapping_matters(f, call):
                yield call, self.message

    def matters(self, f: FileAnalysis, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and _loads_weights(f, node) and _saves_device_weights(f)


def _loads_weights(f: FileAnalysis, call: ast.Call) -> bool:
    """The load is of a model's weights, as far as the file shows: a state_dict (handed to load_state_dict, or
    saved as one), a whole module (saved as one, or used as one), not some other cached object."""
    return loaded_checkpoint(f, call).holds in (WEIGHTS, MODULE) or _loaded_module(f, call)


def _saves_device_weights(f: FileAnalysis) -> bool:
    """The file ``torch.save``s a module or its ``state_dict()`` that it moves to an accelerator (``.cuda()``,
    ``.to(<cuda device>)``) and never to the CPU: its checkpoints hold GPU tensors."""
    on_device = _moved_to_accelerator(f) - _moved_to_cpu(f)
    for save in _calls_of(f, "torch.save"):
        obj = kwarg(save, "obj", 0)
        if obj is None or any(called_method(n) == "cpu" for n in ast.walk(obj)):
            continue
        if {n.id for n in ast.walk(obj) if isinstance(n, ast.Name)} & on_device:
            return True
    return False


def _moved_to_accelerator(f: FileAnalysis) -> set[str]:
    """The names the file moves to an accelerator: ``x.cuda()``, ``x.to(dev)``, ``net = Net().to(dev)``."""
    moved: set[str | None] = set()
    for c in f.nodes[ast.Call]:
        if called_method(c) in ("cuda", "to") and _to_accelerator(f, c):
            moved.add(root_name(c.func.value))
            assign = f.parent.get(c)
            if isinstance(assign, ast.Assign):
                moved |= {t.id for t in assign.targets if isinstance(t, ast.Name)}
    moved.discard(None)
    return moved  # type: ignore[return-value]


def _moved_to_cpu(f: FileAnalysis) -> set[str]:
    """The names the file moves back to the CPU (``x.cpu()``, ``x.to("cpu")``)."""
    return {root_name(c.func.value) for c in f.nodes[ast.Call]
            if called_method(c) == "cpu" or (called_method(c) == "to" and _names_cpu(c))} - {None}


def _to_accelerator(f: FileAnalysis, call: ast.Call) -> bool:
    """``x.cuda()``, or ``x.to(d)`` with ``d`` a CUDA device or a device variable of a file that uses CUDA."""
    if called_method(call) == "cuda":
        return True
    dev = kwarg(call, "device", 0)
    if isinstance(dev, ast.Constant):
        return isinstance(dev.value, str) and dev.value.startswith("cuda")
    return dev is not None and (f.mentions_cuda or any((f.qualname(n) or "").startswith("torch.accelerator.")
                                                       for n in f.nodes[ast.Attribute]))


def _names_cpu(call: ast.Call) -> bool:
    dev = kwarg(call, "device", 0)
    return isinstance(dev, ast.Constant) and dev.value == "cpu"


def _device_mapping_matters(f: FileAnalysis, call: ast.Call) -> bool:
    """The ``torch.load`` ``call`` passes no map_location, and what it loads may hold device tensors
    saved elsewhere."""
    return kwarg(call, "map_location", 1) is None and not _holds_numpy(f, call) and not _in_memory(f, call)


def _in_memory(f: FileAnalysis, call: ast.Call) -> bool:
    """``torch.load`` reads an ``io.BytesIO`` buffer (a broadcast object, bytes from a worker): written by
    ``torch.save`` in the same job, whose devices are kept on purpose; no file moves between machines."""
    src = kwarg(call, "f", 0)
    if isinstance(src, ast.Name):
        src = f.binding_value(src)
    return isinstance(src, ast.Call) and f.qualname(src.func) == "io.BytesIO"


def _holds_numpy(f: FileAnalysis, call: ast.Call) -> bool:
    """What ``call`` loads is used as a NumPy array (handed to ``torch.from_numpy`` or a ``numpy``
    function, whole or indexed): the file holds no device tensors, so there is no device to map."""
    name = _assigned_name(f, call)
    if name is None:
        return False
    return any(pos(c) > pos(call) and _hands_to_numpy(f, c, name) for c in f.calls_in(f.function_scope(call)))


def _assigned_name(f: FileAnalysis, value: ast.AST) -> str | None:
    """The name ``value`` is assigned to (``name = value``), else None."""
    target = f.parent.get(value)
    if isinstance(target, ast.Assign) and len(target.targets) == 1 and isinstance(target.targets[0], ast.Name):
        return target.targets[0].id
    return None


def _hands_to_numpy(f: FileAnalysis, c: ast.Call, name: str) -> bool:
    """``c`` is ``torch.from_numpy`` or a ``numpy`` function, and an argument reads the variable ``name``."""
    q = f.qualname(c.func) or ""
    return (q == "torch.from_numpy" or q.startswith("numpy.")) and _reads(c.args, name)


def _reads(exprs: list[ast.AST], name: str) -> bool:
    """One of ``exprs`` reads the variable ``name``."""
    return any(isinstance(n, ast.Name) and n.id == name for e in exprs for n in ast.walk(e))


@static_rule
class TorchLoadWithoutWeightsOnly(StaticRule):
    id = "TT111"
    name = "torch-load-without-weights-only"
    severity = "warning"
    source = "X (torch.load without weights_only); T26"
    message = ("torch.load without weights_only: its default is True only since torch 2.6, and True refuses pickled "
               "objects: pass weights_only=True for tensors/state_dicts, False only for a trusted file")
    explanation = ("torch.load unpickles the file. Before torch 2.6 the default, weights_only=False, runs any "
                   "code an untrusted checkpoint carries; from 2.6 the default is True, which loads tensors, "
                   "state_dicts and plain numbers/strings/containers but refuses other Python objects: a file "
                   "written by torch.save(model, path) (a whole pickled nn.Module) no longer loads without "
                   "weights_only=False. Saying it explicitly makes the load the same on every version. The message "
                   "says what the file shows about the checkpoint: the torch.save that writes the same path (or "
                   "buffer), or the result handed to load_state_dict. Fix: torch.load(f, map_location='cpu', "
                   "weights_only=True) for tensors and state_dicts (`doctor --fix` writes it only there); for a "
                   "whole module, weights_only=False for a file you trust, or better save model.state_dict() and "
                   "load that into the model. Quiet where the code already chose weights_only loading: inside "
                   "torch.serialization.safe_globals(...), in a file that calls add_safe_globals, and in the "
                   "fallback of a load that passes weights_only (an except after it, the other branch of a version "
                   "check).")

    tier = "hygiene"
    tier_why = ("most loads are of state_dicts and tensors, which load the same under either default (20 of 37 "
                "findings on the real-code set): reported by default only where the file shows the load is of a "
                "whole pickled module (saved as one in the file, or used as a module after the load), which fails "
                "under torch >= 2.6's default")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        allowlist = _adds_safe_globals(f)
        for call in _calls_of(f, "torch.load"):
            if kwarg(call, "weights_only") is None and not allowlist and not _weights_only_meant(f, call):
                yield call, weights_only_message(loaded_checkpoint(f, call))

    def matters(self, f: FileAnalysis, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and (loaded_checkpoint(f, node).holds == MODULE or _loaded_module(f, node))


def _loaded_module(f: FileAnalysis, call: ast.Call) -> bool:
    """What ``call`` loads is then used as an ``nn.Module``: called, or one of its module-only methods."""
    name = _assigned_name(f, call)
    if name is None:
        return False
    for c in f.calls_in(f.function_scope(call)):
        if pos(c) <= pos(call):
            continue
        if (isinstance(c.func, ast.Name) and c.func.id == name) or (
                called_method(c) in MODULE_ONLY_METHODS and is_name(c.func.value, name)):
            return True
    return False


def _adds_safe_globals(f: FileAnalysis) -> bool:
    """The file calls ``torch.serialization.add_safe_globals``: it loads with weights_only on purpose."""
    return any(f.qualname(c.func) == "torch.serialization.add_safe_globals" for c in f.nodes[ast.Call])


def _weights_only_meant(f: FileAnalysis, call: ast.Call) -> bool:
    """The code around ``call`` already chose weights_only loading: it runs inside ``with
    torch.serialization.safe_globals(...)`` (which only serves weights_only=True, the default since torch
    2.6), or it is the fallback of one that passes weights_only (an ``except`` after a ``try`` that does, or
    the other branch of an ``if`` on the version): a shim for an older torch that has no such argument."""
    child: ast.AST = call
    for anc in f.local_ancestors(call):
        if _chooses_weights_only(f, anc, child):
            return True
        child = anc
    return False


def _chooses_weights_only(f: FileAnalysis, anc: ast.AST, child: ast.AST) -> bool:
    """The statement ``anc`` chooses weights_only loading for its part ``child``: a ``with safe_globals``,
    a ``try`` whose body passes weights_only (``child`` a handler), an ``if`` whose other branch does."""
    if isinstance(anc, (ast.With, ast.AsyncWith)):
        return _in_safe_globals(f, anc)
    if isinstance(anc, ast.Try):
        return child in anc.handlers and _passes_weights_only(f, anc.body)
    if isinstance(anc, ast.If):
        return child is not anc.test and _passes_weights_only(f, _other_branch(anc, child))
    return False


def _in_safe_globals(f: FileAnalysis, block: ast.With | ast.AsyncWith) -> bool:
    return any(isinstance(item.context_expr, ast.Call)
               and f.qualname(item.context_expr.func) == "torch.serialization.safe_globals" for item in block.items)


def _other_branch(test: ast.If, child: ast.AST) -> list[ast.stmt]:
    """The branch of ``test`` that does not hold ``child``."""
    return test.orelse if child in test.body else test.body


def _passes_weights_only(f: FileAnalysis, nodes: list[ast.AST]) -> bool:
    """Some ``torch.load`` in the statements ``nodes`` passes weights_only."""
    return any(isinstance(n, ast.Call) and f.qualname(n.func) == "torch.load" and kwarg(n, "weights_only")
               is not None for stmt in nodes for n in ast.walk(stmt))


# --------------------------------------------------------------------------- what a torch.load reads

WEIGHTS, MODULE, OBJECT, UNKNOWN = "weights", "module", "object", "unknown"


@dataclass(frozen=True)
class Checkpoint:
    """What a ``torch.load`` reads, as far as the file shows, and where it shows it. ``holds`` is
    ``weights`` (what weights_only=True loads: tensors, state_dicts, numbers and strings, in lists, tuples
    and dicts), ``module`` (a whole pickled nn.Module), ``object`` (something else torch.save pickled)
    or ``unknown`` (the file does not write it, nor hands the result to ``load_state_dict``)."""

    holds: str
    line: int = 0  # the torch.save (or the load_state_dict) that shows it
    saved: str = ""  # what that torch.save stores, as written


def loaded_checkpoint(f: FileAnalysis, call: ast.Call) -> Checkpoint:
    """What the ``torch.load`` ``call`` reads: decided by the ``torch.save`` calls of the file that
    write the same path or buffer (a whole module among them decides), else by the result being
    handed to ``load_state_dict`` (a state_dict). Shared by TT111 and ``doctor --fix``, which adds
    weights_only=True only to ``weights``: on anything else it would break the load on an older torch
    or say what the file does not show."""
    saves = [(save, _saved_holds(f, save)) for save in _saves_to(f, kwarg(call, "f", 0))]
    module = next((s for s in saves if s[1] == MODULE), None)
    if module is not None:
        return _checkpoint(module)
    if saves and all(holds == WEIGHTS for _, holds in saves):
        return _checkpoint(saves[0])
    use = _state_dict_use(f, call)
    if use is not None:
        return Checkpoint(WEIGHTS, use.lineno)
    return _checkpoint(next(s for s in saves if s[1] == OBJECT)) if saves else Checkpoint(UNKNOWN)


def weights_only_message(c: Checkpoint) -> str:
    """TT111's message for a load of ``c``: the fix that keeps that load working."""
    if c.holds == WEIGHTS:
        shown = f"saved on line {c.line}" if c.saved else f"handed to load_state_dict on line {c.line}"
        return (f"torch.load without weights_only of tensors/state_dicts ({shown}): pass weights_only=True, the "
                f"default only since torch 2.6 (older torch runs any code a file carries)")
    if c.holds == MODULE:
        return (f"torch.load of a whole pickled module ({c.saved} saved on line {c.line}) fails under "
                f"weights_only=True, the default since torch 2.6: pass weights_only=False for a trusted file, or "
                f"save {c.saved}.state_dict() and load that into the model")
    if c.holds == OBJECT:
        return (f"torch.load without weights_only of what torch.save stores on line {c.line} ({c.saved}), not shown "
                f"to be only tensors/state_dicts: pass weights_only=True if it is, else weights_only=False for a "
                f"trusted file (the default since torch 2.6, True, refuses other objects)")
    return ("torch.load without weights_only of a file whose contents this code does not show: check what it "
            "holds, then pass weights_only=True (tensors, state_dicts: the default since torch 2.6) or False (a "
            "trusted file of other pickled objects, which the default refuses)")


def _checkpoint(save: tuple[ast.Call, str]) -> Checkpoint:
    call, holds = save
    obj = kwarg(call, "obj", 0)
    return Checkpoint(holds, call.lineno, ast.unparse(obj) if obj is not None else "the object")


def _saves_to(f: FileAnalysis, src: ast.AST | None) -> list[ast.Call]:
    """The ``torch.save`` calls of the file that write where ``src`` (a load's file) reads: the same
    path or buffer, spelled the same with its names bound the same (see :func:`_path_key`)."""
    if src is None:
        return []
    if "torch.save targets" not in f.memo:
        f.memo["torch.save targets"] = [(save, _path_key(f, dst)) for save in _calls_of(f, "torch.save")
                                        if (dst := kwarg(save, "f", 1)) is not None]
    key = _path_key(f, src)
    return [save for save, dst in f.memo["torch.save targets"] if dst == key]


_KEY_DEPTH = 8


def _path_key(f: FileAnalysis, node: object, depth: int = 0) -> object:
    """A value equal for two expressions that name the same file or buffer: the expression's
    structure, with each name replaced by what it was assigned (a path string, ``os.path.join(...)``),
    the ``open(...)`` it was opened by, or else its binding (a parameter, a loop variable)."""
    if isinstance(node, ast.Name):
        return _name_key(f, node, depth)
    if isinstance(node, ast.expr_context):
        return None
    if isinstance(node, ast.AST):
        return (type(node).__name__,) + tuple(_path_key(f, getattr(node, k, None), depth) for k in node._fields)
    if isinstance(node, list):
        return tuple(_path_key(f, n, depth) for n in node)
    return node  # a constant's value


def _name_key(f: FileAnalysis, node: ast.Name, depth: int) -> object:
    b = f.lookup(node)
    if b is None:
        return ("name", node.id)  # bound nowhere in the file: the same global everywhere
    value = _opened_file(f, node, b) if b[1] == "value" and b[2] is None else f.binding_value(node)
    if value is not None and depth < _KEY_DEPTH and not _new_buffer(f, value):
        return _path_key(f, value, depth + 1)
    return ("name", node.id, b[0], id(b[2]))


def _new_buffer(f: FileAnalysis, value: ast.AST) -> bool:
    """``value`` makes a new ``io.BytesIO``: each one is another buffer, however it is spelled."""
    return isinstance(value, ast.Call) and f.qualname(value.func) == "io.BytesIO"


def _opened_file(f: FileAnalysis, node: ast.Name, b: tuple) -> ast.AST | None:
    """The file ``node`` was opened from, when its binding ``b`` is ``with open(file, ...) as node``."""
    for block in f.nodes[ast.With] + f.nodes[ast.AsyncWith]:
        for item in block.items:
            ctx = item.context_expr
            if is_name(item.optional_vars, node.id) and end(ctx) == b[0] and _is_open(f, ctx):
                return kwarg(ctx, "file", 0)
    return None


def _is_open(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` calls the builtin ``open`` (or ``io.open``)."""
    if not isinstance(node, ast.Call):
        return False
    q = f.qualname(node.func)
    return q in ("io.open", "builtins.open") or (q is None and is_name(node.func, "open"))


def _saved_holds(f: FileAnalysis, save: ast.Call) -> str:
    """What the ``torch.save`` call ``save`` stores: ``module``, ``weights`` or ``object``."""
    obj = kwarg(save, "obj", 0)
    if obj is None:
        return OBJECT
    if _is_module(f, obj):
        return MODULE
    return WEIGHTS if _loads_weights_only(f, obj) else OBJECT


def _loads_weights_only(f: FileAnalysis, node: ast.AST, depth: int = 0) -> bool:
    """``node`` evaluates to what weights_only=True loads: a tensor, a state_dict, a number or a
    string, or a list, tuple, set or dict (with constant keys) of these."""
    if depth > _KEY_DEPTH:
        return False
    if isinstance(node, ast.Dict):
        return all(isinstance(k, ast.Constant) for k in node.keys) and _all_load(f, node.values, depth)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return not any(isinstance(e, ast.Starred) for e in node.elts) and _all_load(f, node.elts, depth)
    if isinstance(node, ast.IfExp):
        return _all_load(f, [node.body, node.orelse], depth)
    if isinstance(node, ast.Name):
        return _name_loads(f, node, depth)
    return _is_state_dict(node) or _tensor_value(f, node) or _plain_value(f, node, depth)


def _all_load(f: FileAnalysis, nodes: list[ast.AST], depth: int) -> bool:
    return all(_loads_weights_only(f, n, depth + 1) for n in nodes)


def _name_loads(f: FileAnalysis, node: ast.Name, depth: int) -> bool:
    """The variable ``node`` holds what weights_only=True loads: by its assigned value (a dict or list
    not changed in place afterwards: ``ckpt["args"] = args`` may add anything), its kind, or its being
    a number."""
    value = f.binding_value(node)
    if value is not None:
        return not _changed_in_place(f, node) and _loads_weights_only(f, value, depth + 1)
    return _tensor_value(f, node) or _plain_value(f, node, depth)


_IN_PLACE = frozenset("update setdefault append extend insert __setitem__".split())


def _changed_in_place(f: FileAnalysis, node: ast.Name) -> bool:
    """The value ``node`` reads gets an item assigned or is updated, appended to ... in its function."""
    b = f.lookup(node)
    uses = f.uses.get(f.function_scope(node), {}).get(node.id, ())
    return any(_changes(f.parent.get(use), use) for use in uses if f.lookup(use) is b)


def _changes(parent: ast.AST | None, use: ast.Name) -> bool:
    """``parent`` (of the read ``use``) is ``use[...] = ...`` / ``del use[...]`` or ``use.update`` ..."""
    if isinstance(parent, ast.Subscript):
        return parent.value is use and not isinstance(parent.ctx, ast.Load)
    return isinstance(parent, ast.Attribute) and parent.attr in _IN_PLACE


def _is_state_dict(node: ast.AST) -> bool:
    """``node`` is ``x.state_dict()``."""
    return called_method(node) == "state_dict" and not node.args


_RNG_STATES = frozenset({"torch.get_rng_state", "torch.random.get_rng_state", "torch.cuda.get_rng_state",
                         "torch.cuda.get_rng_state_all"})


def _tensor_value(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` is a tensor (a random-number state among them), and not a model's output, which may be
    another object (a ``ModelOutput`` of transformers)."""
    if isinstance(node, ast.Call) and (f.qualname(node.func) in _RNG_STATES):
        return True
    k = f.kind(node)
    model_output = isinstance(node, ast.Call) and f.is_module_kind(f.kind(node.func))
    return k is not None and k.cat == "tensor" and not model_output


_PLAIN_CALLS = frozenset("int float str bool len repr".split())
_PLAIN_METHODS = frozenset("item tolist".split())


def _plain_value(f: FileAnalysis, node: ast.AST, depth: int) -> bool:
    """``node`` is a number or a string: a constant, an f-string, arithmetic on them, ``int(...)``,
    ``len(...)``, ``t.item()``, a variable assigned one, a ``range`` or ``enumerate`` counter."""
    if isinstance(node, (ast.Constant, ast.JoinedStr)):
        return True
    if isinstance(node, ast.UnaryOp):
        return _plain_value(f, node.operand, depth)
    if isinstance(node, ast.BinOp):
        return _plain_value(f, node.left, depth) and _plain_value(f, node.right, depth)
    if isinstance(node, ast.Call):
        return called_method(node) in _PLAIN_METHODS or _calls_builtin(f, node, _PLAIN_CALLS)
    return isinstance(node, ast.Name) and depth < _KEY_DEPTH and _plain_variable(f, node, depth + 1)


def _plain_variable(f: FileAnalysis, node: ast.Name, depth: int) -> bool:
    """The variable ``node`` holds a number or a string: assigned one, incremented by one (``n += 1``
    after ``n = 0``), or a ``range`` / ``enumerate`` counter."""
    b = f.lookup(node)
    if b is None:
        return False
    how, what, extra = b[1], b[2], b[3]
    if how == "value":
        return what is not None and not extra and _plain_value(f, what, depth)
    if how == "aug":
        return _plain_value(f, what.target, depth) and _plain_value(f, what.value, depth)
    return how == "for" and _counts(f, what.iter, extra)


def _calls_builtin(f: FileAnalysis, call: ast.Call, names: frozenset[str]) -> bool:
    """``call`` calls one of the builtins ``names`` (not a name the file imports)."""
    return isinstance(call.func, ast.Name) and call.func.id in names and f.qualname(call.func) is None


def _counts(f: FileAnalysis, it: ast.AST, path: tuple) -> bool:
    """The element at ``path`` of ``for ... in it`` is an int: ``range(...)``, or ``enumerate``'s counter."""
    if not isinstance(it, ast.Call):
        return False
    return (_calls_builtin(f, it, _RANGE) and path == ()) or (_calls_builtin(f, it, _ENUMERATE) and path == (0,))


_RANGE, _ENUMERATE = frozenset({"range"}), frozenset({"enumerate"})


def _state_dict_use(f: FileAnalysis, call: ast.Call) -> ast.Call | None:
    """The ``x.load_state_dict(...)`` call the result of ``call`` is handed to, whole: directly, or through
    the variable it is assigned to. None when there is none."""
    parent = f.parent.get(call)
    if _loads_state_dict(parent, call):
        return parent
    name = _assigned_name(f, call)
    if name is None:
        return None
    binding = _own_binding(f, f.parent[call], name)
    for use in f.uses.get(f.function_scope(call), {}).get(name, ()):
        if f.lookup(use) is binding and _loads_state_dict(f.parent.get(use), use):
            return f.parent[use]
    return None


def _own_binding(f: FileAnalysis, stmt: ast.Assign, name: str) -> tuple | None:
    """The binding of ``name`` that the assignment ``stmt`` makes."""
    return next((b for b in f.bindings.get(f.scope_of.get(stmt), {}).get(name, ()) if b[2] is stmt.value), None)


def _loads_state_dict(parent: ast.AST | None, arg: ast.AST) -> bool:
    """``parent`` is ``x.load_state_dict(arg, ...)``."""
    return called_method(parent) == "load_state_dict" and bool(parent.args) and parent.args[0] is arg


@static_rule
class SaveWholeModule(StaticRule):
    id = "TT128"
    name = "save-whole-module"
    severity = "warning"
    source = ("T26, T20; seeds/003 测试阶段 §4 多GPU模型权重的保存与加载 (torch.save(model.state_dict(), ...)); "
              "seeds/002 问题 §1 不同 python 版本下保存和加载模型的问题 (pickle)")
    message = ("torch.save of a whole nn.Module pickles its class by reference: the checkpoint breaks when the code "
               "moves or changes; save model.state_dict()")
    explanation = ("torch.save(model, path) pickles the module object: its class is stored as a reference "
                   "(module path and name), not as code. Loading needs the same class at the same import path, so "
                   "renaming a file, moving the class or changing its __init__ breaks every old checkpoint, and the "
                   "load runs arbitrary unpickling (it needs weights_only=False). It also saves a DataParallel or "
                   "compiled wrapper with the model. Fix: torch.save(model.state_dict(), path) (inside a dict with "
                   "the optimizer state and epoch if resuming), then model.load_state_dict(torch.load(path, "
                   "weights_only=True)); for a self-contained artefact use torch.export / torch.jit.save.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in _calls_of(f, "torch.save"):
            obj = kwarg(call, "obj", 0)
            if not _is_module(f, obj):
                continue
            name = ast.unparse(obj)
            yield call, (f"torch.save({name}, ...) pickles the whole module (its class by reference): the checkpoint "
                         f"breaks when the code moves or changes; save {name}.state_dict()")


def _is_module(f: FileAnalysis, obj: ast.AST | None) -> bool:
    """``obj`` is an nn.Module: its kind says so, or (kind unknown) its variable is used as one."""
    k = f.kind(obj)
    if k is None:
        return _used_as_module(f, obj)
    return k.cat == "module" or (k.cat == "self" and f.is_module_class(k.ref))


def _used_as_module(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` is a name whose variable (any binding of it in the same scope) is used as an nn.Module
    elsewhere in the file: ``.parameters()``, ``.eval()``, ``.named_modules()`` ... called on it (a model
    built by a class of another file)."""
    if not isinstance(node, ast.Name):
        return False
    b = f.lookup(node)
    if not _assigned_without_torch(f, b):
        return False  # torch.jit.script(model), torch.load(...): not a plain module of this file's making
    binds = _same_variable(f, node.id, b)
    if not binds:
        return False
    return any(_calls_module_method(f, call, node.id, binds) for call in f.nodes[ast.Call])


def _assigned_without_torch(f: FileAnalysis, b: tuple | None) -> bool:
    """The binding ``b`` assigns a value that reads nothing of torch."""
    return b is not None and b[1] == "value" and not _mentions_torch(f, b[2])


def _same_variable(f: FileAnalysis, name: str, b: tuple) -> list | None:
    """The bindings of ``name`` in the scope whose binding ``b`` is."""
    return next((names[name] for names in f.bindings.values() if b in names.get(name, ())), None)


def _mentions_torch(f: FileAnalysis, expr: ast.AST) -> bool:
    """``expr`` reads something of torch."""
    return any((f.qualname(n) or "").startswith("torch.")
               for n in ast.walk(expr) if isinstance(n, (ast.Name, ast.Attribute)))


def _calls_module_method(f: FileAnalysis, call: ast.Call, name: str, binds: list) -> bool:
    """``call`` is ``name.eval()``, ``name.parameters()`` ... with ``name`` bound by one of ``binds``."""
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr in MODULE_ONLY_METHODS and isinstance(func.value, ast.Name) \
        and func.value.id == name and f.lookup(func.value) in binds
