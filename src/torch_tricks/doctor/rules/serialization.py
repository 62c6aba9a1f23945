"""Rules about reading checkpoints: ``torch.load`` without ``map_location`` or ``weights_only``.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import MODULE_ONLY_METHODS, FileAnalysis, kwarg, pos
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

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in _calls_of(f, "torch.load"):
            if _device_mapping_matters(f, call):
                yield call, self.message


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
    message = ("torch.load without weights_only (its default changed in torch 2.6): pass weights_only=True, "
               "or False only for trusted files")
    explanation = ("torch.load unpickles the file. Before torch 2.6 the default, weights_only=False, runs any "
                   "code an untrusted checkpoint carries; from 2.6 the default is True and checkpoints that hold "
                   "other Python objects fail to load. Saying it explicitly makes the load safe and the same on "
                   "every version. Fix: torch.load(f, map_location='cpu', weights_only=True); weights_only=False "
                   "only for files you trust. Quiet where the code already chose weights_only loading: inside "
                   "torch.serialization.safe_globals(...), in a file that calls add_safe_globals, and in the "
                   "fallback of a load that passes weights_only (an except after it, the other branch of a version "
                   "check).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        allowlist = _adds_safe_globals(f)
        for call in _calls_of(f, "torch.load"):
            if kwarg(call, "weights_only") is None and not allowlist and not _weights_only_meant(f, call):
                yield call, self.message


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
