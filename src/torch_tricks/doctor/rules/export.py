"""Rules about exporting a model: tracing or exporting it while it is in train mode.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import (CONTAINERS, DROPOUT_FNS, FileAnalysis, Kind, has_star_args, kwarg, number,
                                          pos, root_name, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule

#: exporter -> the name of its model argument (always the first positional one)
_EXPORTERS = {"torch.jit.trace": "func", "torch.jit.trace_module": "mod", "torch.export.export": "mod",
              "torch.onnx.export": "model", "torch.onnx.dynamo_export": "model"}
_KNOWN_PREFIXES = ("torch.", "builtins.", "print", "len", "isinstance", "getattr", "hasattr", "str", "repr")
#: functions whose result (or behaviour) depends on the mode
_MODE_FUNCS = DROPOUT_FNS | {"timm.create_model"}
#: torch.nn layers that have train-mode dropout only when built with a nonzero ``dropout=``
_DROPOUT_OPTION = frozenset({"RNN", "LSTM", "GRU", "MultiheadAttention"})
#: builtins that do not change the mode of a model handed to them
_HARMLESS_BUILTINS = frozenset({"print", "len", "isinstance", "repr", "str", "id", "type"})
#: expressions that may evaluate to a module
_MODULE_EXPRS = (ast.Name, ast.Call, ast.Attribute)


def _mode_layer(q: str | None, call: ast.AST | None = None) -> bool:
    """``q`` builds a layer that computes differently in train and eval mode."""
    if not q:
        return False
    if q in _MODE_FUNCS or _is_torchvision_classifier(q):
        return True
    layer = _torch_nn_layer(q)
    return layer is not None and _nn_layer_has_mode(layer, call)


def _is_torchvision_classifier(q: str) -> bool:
    """Every torchvision classifier (built by a lowercase function) has BatchNorm or Dropout."""
    return q.startswith("torchvision.models.") and q.rsplit(".", 1)[-1][:1].islower()


def _torch_nn_layer(q: str) -> str | None:
    """``X`` for ``torch.nn.X``, else None."""
    if not q.startswith("torch.nn.") or q.count(".") != 2:
        return None
    return q.rsplit(".", 1)[-1]


def _nn_layer_has_mode(layer: str, call: ast.AST | None) -> bool:
    """The ``torch.nn`` layer class ``layer`` (built by ``call``) has dropout or batch norm."""
    if "Dropout" in layer or "BatchNorm" in layer or layer.startswith("Transformer"):
        return True
    return layer in _DROPOUT_OPTION and isinstance(call, ast.Call) and _dropout_given(call)


def _dropout_given(call: ast.Call) -> bool:
    """``call`` passes a ``dropout=`` that is not 0."""
    p = kwarg(call, "dropout")
    return p is not None and number(p) != 0


def _class_is_mode_dependent(f: FileAnalysis, cls: ast.ClassDef, depth: int = 0) -> bool:
    """The class (its bases of this file and the local modules it builds included) has dropout or
    batch norm, or reads ``self.training``."""
    key = ("mode_dependent", cls)
    if key in f.memo:
        return f.memo[key]
    f.memo[key] = False
    found = any(_node_has_mode(f, cls, node, depth) for part in [cls, *f.local_bases(cls)] for node in ast.walk(part))
    f.memo[key] = found
    return found


def _node_has_mode(f: FileAnalysis, cls: ast.ClassDef, node: ast.AST, depth: int) -> bool:
    """``node``, in the code of ``cls``, reads ``.training`` or builds a layer that depends on the mode."""
    if isinstance(node, ast.Attribute):
        return node.attr == "training"
    if not isinstance(node, ast.Call):
        return False
    q = f.qualname(node.func)
    if _mode_layer(q, node):
        return True
    return q is None and depth < 3 and _builds_mode_dependent_class(f, cls, node, depth)


def _builds_mode_dependent_class(f: FileAnalysis, cls: ast.ClassDef, call: ast.Call, depth: int) -> bool:
    """``call`` builds another class of this file that is mode dependent."""
    k = f.kind(call.func)
    return k is not None and k.cat == "class" and isinstance(k.ref, ast.ClassDef) and k.ref is not cls \
        and _class_is_mode_dependent(f, k.ref, depth + 1)


def _mode_dependent(f: FileAnalysis, node: ast.AST, depth: int = 0) -> bool:
    """The file shows that the module ``node`` evaluates to computes differently in train mode."""
    k = f.kind(node)
    if k is None or depth > 4:
        return False
    if _is_local_module(k):
        return _local_module_has_mode(f, k.ref)
    if k.cat != "module":
        return False
    return _mode_layer(k.detail, k.ref) or _container_has_mode(f, node, k.detail, k.ref, depth)


def _is_local_module(k: Kind) -> bool:
    """``self``, or a module built by a class of this file."""
    return k.cat == "self" or (k.cat == "module" and k.detail == "local")


def _local_module_has_mode(f: FileAnalysis, ref: object) -> bool:
    return isinstance(ref, ast.ClassDef) and f.is_module_class(ref) and _class_is_mode_dependent(f, ref)


def _container_has_mode(f: FileAnalysis, node: ast.AST, q: str | None, ref: object, depth: int) -> bool:
    """``node`` is a container (``nn.Sequential`` ...) built by ``ref`` from a mode-dependent module."""
    if q not in CONTAINERS or not isinstance(ref, ast.Call):
        return False
    return any(_mode_dependent(f, n, depth + 1) for n in _module_expressions(ref, node))


def _module_expressions(call: ast.Call, skip: ast.AST) -> Iterator[ast.AST]:
    """The expressions in ``call``'s arguments that may evaluate to a module (``skip`` aside)."""
    for part in _arguments(call):
        for n in ast.walk(part):
            if n is not skip and isinstance(n, _MODULE_EXPRS):
                yield n


def _arguments(call: ast.Call) -> list[ast.AST]:
    """The positional and keyword argument values of ``call``."""
    return list(call.args) + [kw.value for kw in call.keywords]


def _to_eval(call: ast.AST) -> bool | None:
    """True for ``x.eval()`` / ``x.train(False)``, False for ``x.train()`` / ``x.train(True)``, None else."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return None
    if call.func.attr == "eval" and not call.args:
        return True
    if call.func.attr == "train":
        return _train_to_eval(call)
    return None


def _train_to_eval(call: ast.Call) -> bool | None:
    """For ``x.train(...)``: False for ``train()`` / ``train(True)``, True for ``train(False)``, None
    when the flag is not a literal."""
    flag = kwarg(call, "mode", 0)
    if flag is None:
        return False
    if isinstance(flag, ast.Constant) and isinstance(flag.value, bool):
        return not flag.value
    return None


def _leaves_eval(f: FileAnalysis, func: ast.AST) -> bool:
    return any(_to_eval(n) for n in walk_local(func))


def _mode_before(f: FileAnalysis, frame: ast.AST, root: str, before: tuple[int, int],
                 parts: frozenset = frozenset()) -> str:
    """What the code of ``frame`` before ``before`` did to the mode of the model named ``root``:
    "eval", "train" (switched to train mode), "none" (nothing seen) or "unknown" (handed to code the
    file does not show, which may switch it). ``parts``: other names whose mode is the model's (the
    model a Sequential of its children was built from)."""
    names = parts | {root}
    state = "none"
    for c in f.calls_in(frame):
        if pos(c) >= before:
            break
        state = _mode_after(f, c, root, names, state)
    return state


def _mode_after(f: FileAnalysis, call: ast.Call, root: str, names: frozenset, state: str) -> str:
    """The mode of the model named ``root`` (or one of ``names``) after ``call``, ``state`` before it."""
    mode = _to_eval(call)
    if mode is not None and root_name(call.func.value) in names:
        return "eval" if mode else "train"
    if _handed(call, root):
        return _mode_when_handed(f, call, root) or state
    return state


def _handed(call: ast.Call, root: str) -> bool:
    """``call`` is passed the model named ``root`` (or an attribute of it) as an argument."""
    return any(root_name(a) == root for a in _arguments(call))


def _mode_when_handed(f: FileAnalysis, call: ast.Call, root: str) -> str | None:
    """The model's mode after ``call``, which is handed it: "eval" (a function of this file that
    switches to eval), "unknown" (code the file does not show), None (the mode does not change)."""
    q = f.qualname(call.func)
    if q is not None and q.startswith(_KNOWN_PREFIXES):
        return None
    if isinstance(call.func, ast.Name) and q is None:
        return _mode_after_plain_call(f, call.func.id)
    if _is_method_of(call, root):
        return None  # model.load_state_dict(...), model.to(...)
    return "unknown"


def _mode_after_plain_call(f: FileAnalysis, name: str) -> str | None:
    """As :func:`_mode_when_handed`, for a call of the plain name ``name`` (not an import)."""
    defs = f.plain_functions.get(name)
    if defs:
        return "eval" if any(_leaves_eval(f, d) for d in defs) else None
    return None if name in _HARMLESS_BUILTINS else "unknown"


def _is_method_of(call: ast.Call, root: str) -> bool:
    """``call`` calls a method of the model named ``root`` (or of an attribute of it)."""
    return isinstance(call.func, ast.Attribute) and root_name(call.func.value) == root


def _put_in_eval_somewhere(f: FileAnalysis, root: str) -> bool:
    """Some call in the file switches the model named ``root`` to eval."""
    return any(_to_eval(c) and root_name(c.func.value) == root for c in f.nodes[ast.Call])


def _mode_chosen(call: ast.Call, exporter: str) -> bool:
    """An onnx export whose mode is chosen on purpose (``training=``), or by the TorchScript exporter
    (``dynamo=False``, or the old positional arguments): it switches to eval itself."""
    if exporter != "torch.onnx.export":
        return False
    return kwarg(call, "training") is not None or len(call.args) > 3 or _dynamo_off(call)


def _dynamo_off(call: ast.Call) -> bool:
    """``torch.onnx.export(..., dynamo=False)``: the TorchScript exporter."""
    dynamo = kwarg(call, "dynamo")
    return isinstance(dynamo, ast.Constant) and dynamo.value is False


def _built_in_eval(f: FileAnalysis, node: ast.AST, depth: int = 0) -> bool:
    """The expression (or what its name was assigned, two deep) calls ``.eval()`` / ``.train(False)``."""
    if node is None or depth > 2:
        return False
    if _switches_to_eval(node):
        return True
    return any(_built_in_eval(f, f.binding_value(n), depth + 1) for n in _names_in(node))


def _switches_to_eval(node: ast.AST) -> bool:
    """Some call in the expression ``node`` is ``.eval()`` / ``.train(False)``."""
    return any(_to_eval(n) for n in ast.walk(node))


def _names_in(node: ast.AST) -> list[ast.Name]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Name)]


@static_rule
class ExportInTrainMode(StaticRule):
    id = "TT130"
    name = "export-in-train-mode"
    severity = "warning"
    source = ("I7, T13; seeds/003 网络模型构建 §4 (torch.onnx.export(net, dummy_input, 'model.onnx')) and 测试阶段 §2 "
              "(model.eval(): BN 和 Dropout 在训练和测试时行为不同)")
    message = ("model traced or exported without eval(): dropout and BatchNorm are recorded in train mode (random "
               "drops, batch statistics) in the exported graph; call model.eval() first")
    explanation = ("torch.jit.trace, torch.export.export and the torch.export-based torch.onnx.export (the default "
                   "since PyTorch 2.9; earlier exporters switched to eval themselves) record the model as it runs "
                   "now. In train mode that is dropout dropping activations at random and BatchNorm normalising "
                   "with the statistics of the example batch (and updating its running averages): the exported "
                   "model gives different, noisy predictions from the eager model in eval mode, silently. Fix: "
                   "model.eval() before exporting (and torch.no_grad()); export for training on purpose with "
                   "torch.export.export_for_training or onnx's training=TrainingMode.TRAINING. Reported only for "
                   "a model the file shows to have dropout or batch norm, with no eval() before the export in that "
                   "function (nor in the callers that pass it in).")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        for call in f.nodes[ast.Call]:
            export = _export_of(f, call)
            if export is None:
                continue
            q, model = export
            if not _records_mode(f, model):
                continue
            root = root_name(model)
            if root is not None and self._exported_in_train(f, call, model, root):
                name = ast.unparse(model)
                yield call, (f"`{q}` of `{name}` without {name}.eval() before it: dropout and BatchNorm are recorded "
                             f"in train mode in the exported graph; call {name}.eval() first")

    @staticmethod
    def _exported_in_train(f: FileAnalysis, call: ast.Call, model: ast.AST, root: str) -> bool:
        """The export ``call`` sees ``model`` (named ``root``) in train mode: nothing before it in its
        function (nor in the callers that pass the model in) switches it to eval."""
        frame = f.function_scope(call)
        state = _mode_before(f, frame, root, pos(call), _built_from(f, model))
        if _maybe_in_eval(state, root):
            return False
        b = f.lookup(model) if isinstance(model, ast.Name) else None
        if ExportInTrainMode._parameter_maybe_in_eval(f, frame, model, b):
            return False
        return not _outer_model_put_in_eval(f, frame, model, root, b)

    @staticmethod
    def _parameter_maybe_in_eval(f: FileAnalysis, frame: ast.AST, model: ast.AST, b) -> bool:
        """``model`` is a parameter of the function ``frame`` (bound by ``b``), and not every caller is
        seen to pass it in train mode."""
        return b is not None and b[1] == "param" and not ExportInTrainMode._callers_leave_train(f, frame, model.id)

    @staticmethod
    def _callers_leave_train(f: FileAnalysis, func: ast.AST, name: str) -> bool:
        """Every call of the function ``func`` (a plain function of this file) passes a model that its
        caller did not put in eval before the call; False when there is no such call to see."""
        if not _single_plain_function(f, func):
            return False
        index = _positional_index(func, name)
        calls = f.calls_by_name.get(func.name, [])
        return bool(calls) and all(_caller_leaves_train(f, c, name, index) for c in calls)


def _export_of(f: FileAnalysis, call: ast.Call) -> tuple[str, ast.AST] | None:
    """(exporter, model) for a call that exports or traces a model in the mode it is in; None else."""
    q = f.qualname(call.func)
    if q not in _EXPORTERS or has_star_args(call) or _mode_chosen(call, q):
        return None
    model = kwarg(call, _EXPORTERS[q], 0)
    return None if model is None else (q, model)


def _records_mode(f: FileAnalysis, model: ast.AST) -> bool:
    """The mode ``model`` is in changes what an export records: it depends on the mode, and its
    expression does not already switch it to eval."""
    return not _built_in_eval(f, model) and _mode_dependent(f, model)


def _built_from(f: FileAnalysis, model: ast.AST) -> frozenset:
    """The names in what the name ``model`` was assigned (the children a Sequential was built from)."""
    built = f.binding_value(model) if isinstance(model, ast.Name) else None
    return frozenset(n.id for n in _names_in(built)) if built else frozenset()


def _maybe_in_eval(state: str, root: str) -> bool:
    """Switched to eval, maybe switched by code the file does not show, or a method's self."""
    return state not in ("train", "none") or (state == "none" and root == "self")


def _outer_model_put_in_eval(f: FileAnalysis, frame: ast.AST, model: ast.AST, root: str, b) -> bool:
    """A global model (or its attribute), used in a function, that the file puts in eval somewhere."""
    outer = b is not None and b not in f.bindings.get(frame, {}).get(root, ())
    return (outer or not isinstance(model, ast.Name)) and frame is not f.tree and _put_in_eval_somewhere(f, root)


def _single_plain_function(f: FileAnalysis, func: ast.AST) -> bool:
    """``func`` is a plain function of this file, the only one of its name."""
    return isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(f.plain_functions.get(func.name, ())) == 1


def _positional_index(func: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> int | None:
    positional = func.args.posonlyargs + func.args.args
    return next((i for i, a in enumerate(positional) if a.arg == name), None)


def _caller_leaves_train(f: FileAnalysis, call: ast.Call, name: str, index: int | None) -> bool:
    """``call`` passes (as parameter ``name``, at ``index``) a model its caller did not put in eval."""
    arg = kwarg(call, name, index)
    root = root_name(arg) if arg is not None else None
    if root is None or _built_in_eval(f, arg):
        return False
    return _mode_before(f, f.function_scope(call), root, pos(call)) in ("train", "none")
