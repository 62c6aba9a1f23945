"""Rules about exporting a model: tracing or exporting it while it is in train mode.
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import (CONTAINERS, DROPOUT_FNS, FileAnalysis, has_star_args, kwarg, number, pos,
                                          root_name, walk_local)
from torch_tricks.doctor.registry import StaticRule, static_rule

#: exporter -> the name of its model argument (always the first positional one)
_EXPORTERS = {"torch.jit.trace": "func", "torch.jit.trace_module": "mod", "torch.export.export": "mod",
              "torch.onnx.export": "model", "torch.onnx.dynamo_export": "model"}
_KNOWN_PREFIXES = ("torch.", "builtins.", "print", "len", "isinstance", "getattr", "hasattr", "str", "repr")


def _mode_layer(q: str | None, call: ast.AST | None = None) -> bool:
    """``q`` builds a layer that computes differently in train and eval mode."""
    if not q:
        return False
    last = q.rsplit(".", 1)[-1]
    if q.startswith("torchvision.models.") and last[:1].islower():
        return True  # every torchvision classifier has BatchNorm or Dropout
    if q in DROPOUT_FNS or q == "timm.create_model":
        return True
    if not q.startswith("torch.nn.") or q.count(".") != 2:
        return False
    if "Dropout" in last or "BatchNorm" in last or last.startswith("Transformer"):
        return True
    if last in ("RNN", "LSTM", "GRU", "MultiheadAttention") and isinstance(call, ast.Call):
        p = kwarg(call, "dropout")
        return p is not None and number(p) != 0
    return False


def _class_is_mode_dependent(f: FileAnalysis, cls: ast.ClassDef, depth: int = 0) -> bool:
    """The class (its bases of this file and the local modules it builds included) has dropout or
    batch norm, or reads ``self.training``."""
    key = ("mode_dependent", cls)
    if key in f.memo:
        return f.memo[key]
    f.memo[key] = False
    found = False
    for part in [cls, *f.local_bases(cls)]:
        for node in ast.walk(part):
            if isinstance(node, ast.Attribute) and node.attr == "training":
                found = True
            elif isinstance(node, ast.Call):
                q = f.qualname(node.func)
                if _mode_layer(q, node):
                    found = True
                elif q is None and depth < 3:
                    k = f.kind(node.func)
                    if k is not None and k.cat == "class" and isinstance(k.ref, ast.ClassDef) and k.ref is not cls \
                            and _class_is_mode_dependent(f, k.ref, depth + 1):
                        found = True
            if found:
                break
        if found:
            break
    f.memo[key] = found
    return found


def _mode_dependent(f: FileAnalysis, node: ast.AST, depth: int = 0) -> bool:
    """The file shows that the module ``node`` evaluates to computes differently in train mode."""
    k = f.kind(node)
    if k is None or depth > 4:
        return False
    if k.cat == "self" or (k.cat == "module" and k.detail == "local"):
        return isinstance(k.ref, ast.ClassDef) and f.is_module_class(k.ref) and _class_is_mode_dependent(f, k.ref)
    if k.cat != "module":
        return False
    if _mode_layer(k.detail, k.ref):
        return True
    if k.detail in CONTAINERS and isinstance(k.ref, ast.Call):
        parts = list(k.ref.args) + [kw.value for kw in k.ref.keywords]
        return any(n is not node and isinstance(n, (ast.Name, ast.Call, ast.Attribute))
                   and _mode_dependent(f, n, depth + 1) for part in parts for n in ast.walk(part))
    return False


def _to_eval(call: ast.AST) -> bool | None:
    """True for ``x.eval()`` / ``x.train(False)``, False for ``x.train()`` / ``x.train(True)``, None else."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return None
    if call.func.attr == "eval" and not call.args:
        return True
    if call.func.attr == "train":
        flag = kwarg(call, "mode", 0)
        if flag is None:
            return False
        if isinstance(flag, ast.Constant) and isinstance(flag.value, bool):
            return not flag.value
    return None


def _leaves_eval(f: FileAnalysis, func: ast.AST) -> bool:
    calls = [n for n in walk_local(func) if isinstance(n, ast.Call)]
    return any(_to_eval(c) for c in calls)


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
        mode = _to_eval(c)
        if mode is not None and root_name(c.func.value) in names:
            state = "eval" if mode else "train"
        elif _handed(c, root):
            state = _mode_when_handed(f, c, root) or state
    return state


def _handed(call: ast.Call, root: str) -> bool:
    """``call`` is passed the model named ``root`` (or an attribute of it) as an argument."""
    return any(root_name(a) == root or (isinstance(a, ast.Name) and a.id == root)
               for a in list(call.args) + [kw.value for kw in call.keywords])


def _mode_when_handed(f: FileAnalysis, call: ast.Call, root: str) -> str | None:
    """The model's mode after ``call``, which is handed it: "eval" (a function of this file that
    switches to eval), "unknown" (code the file does not show), None (the mode does not change)."""
    q = f.qualname(call.func)
    if q is not None and q.startswith(_KNOWN_PREFIXES):
        return None
    if isinstance(call.func, ast.Name) and q is None:
        defs = f.plain_functions.get(call.func.id)
        if defs:
            return "eval" if any(_leaves_eval(f, d) for d in defs) else None
        if call.func.id in ("print", "len", "isinstance", "repr", "str", "id", "type"):
            return None
    if isinstance(call.func, ast.Attribute) and root_name(call.func.value) == root:
        return None  # model.load_state_dict(...), model.to(...)
    return "unknown"


def _put_in_eval_somewhere(f: FileAnalysis, root: str) -> bool:
    """Some call in the file switches the model named ``root`` to eval."""
    return any(_to_eval(c) and root_name(c.func.value) == root for c in f.nodes[ast.Call])


def _mode_chosen(call: ast.Call, exporter: str) -> bool:
    """An onnx export whose mode is chosen on purpose (``training=``), or by the TorchScript exporter
    (``dynamo=False``, or the old positional arguments): it switches to eval itself."""
    if exporter != "torch.onnx.export":
        return False
    dynamo = kwarg(call, "dynamo")
    return kwarg(call, "training") is not None or len(call.args) > 3 or (
        isinstance(dynamo, ast.Constant) and dynamo.value is False)


def _built_in_eval(f: FileAnalysis, node: ast.AST, depth: int = 0) -> bool:
    """The expression (or what its name was assigned, two deep) calls ``.eval()`` / ``.train(False)``."""
    if node is None or depth > 2:
        return False
    if any(_to_eval(n) for n in ast.walk(node)):
        return True
    return any(_built_in_eval(f, f.binding_value(n), depth + 1) for n in ast.walk(node) if isinstance(n, ast.Name))


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
            q = f.qualname(call.func)
            if q not in _EXPORTERS or has_star_args(call) or _mode_chosen(call, q):
                continue
            model = kwarg(call, _EXPORTERS[q], 0)
            if model is None or _built_in_eval(f, model) or not _mode_dependent(f, model):
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
        built = f.binding_value(model) if isinstance(model, ast.Name) else None
        parts = frozenset(n.id for n in ast.walk(built) if isinstance(n, ast.Name)) if built else frozenset()
        state = _mode_before(f, frame, root, pos(call), parts)
        if state not in ("train", "none") or (state == "none" and root == "self"):
            return False  # switched to eval, maybe switched by code the file does not show, or a method's self
        b = f.lookup(model) if isinstance(model, ast.Name) else None
        if b is not None and b[1] == "param" and not ExportInTrainMode._callers_leave_train(f, frame, model.id):
            return False
        outer = b is not None and b not in f.bindings.get(frame, {}).get(root, ())
        # a global model (or its attribute) that the file puts in eval somewhere
        return not ((outer or not isinstance(model, ast.Name)) and frame is not f.tree
                    and _put_in_eval_somewhere(f, root))

    @staticmethod
    def _callers_leave_train(f: FileAnalysis, func: ast.AST, name: str) -> bool:
        """Every call of the function ``func`` (a plain function of this file) passes a model that its
        caller did not put in eval before the call; False when there is no such call to see."""
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                len(f.plain_functions.get(func.name, ())) != 1:
            return False
        positional = func.args.posonlyargs + func.args.args
        index = next((i for i, a in enumerate(positional) if a.arg == name), None)
        calls = f.calls_by_name.get(func.name, [])
        if not calls:
            return False
        for c in calls:
            arg = kwarg(c, name, index)
            root = root_name(arg) if arg is not None else None
            if root is None or _built_in_eval(f, arg) or _mode_before(f, f.function_scope(c), root, pos(c)) not in (
                    "train", "none"):
                return False
        return True
