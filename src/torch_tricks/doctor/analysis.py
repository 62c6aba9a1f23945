"""The doctor's shared reading of one file: what every static rule asks of the code.

:class:`FileAnalysis` parses nothing itself; it indexes an :mod:`ast` tree once: parents,
scopes, the bindings of each name in each function (assignments, loop targets, parameters,
imports), ``self.x = ...`` attributes per class, and the import aliases. On that index it
answers the questions the rules share, memoised: the *kind* of an expression (a tensor, a
batch from a DataLoader, a module, a loss, an optimizer ... :meth:`FileAnalysis.kind`), whether
a node runs with autograd off (:meth:`FileAnalysis.no_grad`), the calls of a frame, which loop
is a training loop (:func:`is_step_loop`), which loader feeds it and what it moves to CUDA.
Rules ask this module instead of matching their own spelling, so a model passed in as a
parameter or a tensor unpacked from a batch is recognised the same way by every rule.

Written on :mod:`ast` by hand: no linter framework (ruff, TorchFix's libcst visitors) exposes
a PyTorch-aware notion of "kind", and the doctor must run without importing torch.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator


FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
SCOPES = (ast.Module, ast.ClassDef) + FUNCS + COMPS
LOOPS = (ast.For, ast.AsyncFor, ast.While)
NOWHERE = (10**9, 0)
ACT_FUNCS = {"torch.nn.functional.log_softmax": "log_softmax", "torch.log_softmax": "log_softmax",
             "torch.special.log_softmax": "log_softmax",
             "torch.nn.functional.softmax": "softmax", "torch.softmax": "softmax", "torch.special.softmax": "softmax",
             "torch.sigmoid": "sigmoid", "torch.nn.functional.sigmoid": "sigmoid", "torch.special.expit": "sigmoid"}
ACT_METHODS = {"log_softmax": "log_softmax", "softmax": "softmax", "sigmoid": "sigmoid"}
ACT_MODULES = {"torch.nn.LogSoftmax": "log_softmax", "torch.nn.Softmax": "softmax", "torch.nn.Sigmoid": "sigmoid"}
ACTS = frozenset(ACT_METHODS.values())
F_LOSSES = frozenset("""cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
    binary_cross_entropy_with_logits kl_div poisson_nll_loss gaussian_nll_loss ctc_loss margin_ranking_loss
    hinge_embedding_loss multilabel_margin_loss soft_margin_loss multilabel_soft_margin_loss
    cosine_embedding_loss multi_margin_loss triplet_margin_loss triplet_margin_with_distance_loss""".split())
TENSOR_FUNCS = frozenset("""tensor as_tensor asarray from_numpy frombuffer zeros ones empty full rand randn randint
    randperm arange linspace logspace eye zeros_like ones_like empty_like full_like rand_like randn_like
    randint_like normal bernoulli multinomial stack cat concat concatenate hstack vstack dstack matmul mm bmm
    einsum exp log log1p sqrt rsqrt abs sum mean std var prod where clamp clip tanh relu max min amax amin
    argmax argmin sort topk gather index_select masked_select norm cdist pow square add sub mul div
    flatten reshape transpose permute squeeze unsqueeze chunk split tensor_split roll flip cumsum
    outer dot baddbmm addmm conv2d softmax log_softmax sigmoid
    Tensor FloatTensor LongTensor IntTensor ByteTensor BoolTensor DoubleTensor HalfTensor""".split())
NON_TENSOR_METHODS = frozenset("""item tolist numpy size dim ndimension numel element_size nelement
    data_ptr is_contiguous is_floating_point storage untyped_storage stride get_device backward
    register_hook __len__ type""".split())
VIEW_METHODS = frozenset("""view reshape flatten squeeze unsqueeze permute transpose contiguous float double
    half bfloat16 to cuda cpu type_as view_as reshape_as narrow""".split())
MODULE_SELF_METHODS = frozenset("""to cuda cpu half float double bfloat16 train eval requires_grad_
    share_memory apply type to_empty xpu ipu mtia""".split())
SHAPE_METHODS = frozenset("view reshape unsqueeze squeeze permute transpose size dim numel contiguous flatten"
                          .split())
MODULE_ONLY_METHODS = frozenset("""eval parameters named_parameters modules named_modules children named_children
    buffers named_buffers register_forward_hook register_forward_pre_hook register_full_backward_hook""".split())
MOVE_METHODS = frozenset("cuda cpu to half float double bfloat16 long int short byte char bool pin_memory type"
                         .split())
STATELESS_MODULES = frozenset("torch.nn." + n for n in """ReLU ReLU6 LeakyReLU GELU SiLU Mish ELU CELU SELU
    Tanh Sigmoid Hardtanh Hardswish Hardsigmoid Softplus Softsign Softshrink Hardshrink Tanhshrink LogSigmoid
    Softmax LogSoftmax Softmin Softmax2d Threshold GLU Identity Flatten Unflatten MaxPool1d MaxPool2d
    MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d
    AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d LPPool1d LPPool2d Upsample UpsamplingNearest2d
    UpsamplingBilinear2d PixelShuffle PixelUnshuffle ChannelShuffle ZeroPad2d ConstantPad1d ConstantPad2d
    ConstantPad3d ReflectionPad1d ReflectionPad2d ReplicationPad1d ReplicationPad2d""".split())
PARAMETER_FREE_MODULES = STATELESS_MODULES | frozenset("torch.nn." + n for n in """Dropout Dropout1d Dropout2d
    Dropout3d AlphaDropout FeatureAlphaDropout""".split())
# Layers of other libraries that hold no parameters, recognised by their class name (timm's DropPath and
# DropBlock2d, torchvision's StochasticDepth): calling one records no graph worth a no_grad.
PARAMETER_FREE_NAME = re.compile(r"^(Drop\w*|\w*Dropout\w*|StochasticDepth|Identity)$")
RNN_MODULES = frozenset({"torch.nn.RNN", "torch.nn.LSTM", "torch.nn.GRU"})
CONTAINERS = frozenset({"torch.nn.ModuleList", "torch.nn.ModuleDict", "torch.nn.Sequential",
                        "torch.nn.ParameterList", "torch.nn.ParameterDict"})
DROPOUT_FNS = frozenset("torch.nn.functional." + n for n in
                        "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout".split())
NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})
CLOCKS = frozenset({"time.time", "time.perf_counter", "time.monotonic", "time.time_ns",
                    "time.perf_counter_ns", "time.monotonic_ns", "timeit.default_timer"})
SYNC_FUNCS = frozenset({"torch.cuda.synchronize", "torch.cuda.current_stream", "torch.cuda.default_stream",
                        "torch.cuda.Event", "torch.cuda.Stream", "torch.accelerator.synchronize",
                        "torch.mps.synchronize", "torch.xpu.synchronize", "torch.distributed.barrier"})
SYNC_METHODS = frozenset("synchronize item tolist numpy cpu elapsed_time wait".split())
SAFE_BUILTINS = frozenset("""range len enumerate zip list dict tuple set str repr isinstance issubclass min
    max sum abs round sorted reversed iter next getattr setattr hasattr super type format any all map filter
    divmod hash id""".split())
TQDM = frozenset({"tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.trange"})
_SAME_ELEMENTS = TQDM | {"iter", "tqdm"}  # iter(x), tqdm(x): the elements of x
LOADERISH = re.compile(r"(?:^|_)(?:data)?loader$|^dl$|_dl$", re.IGNORECASE)
DATALOADER = "torch.utils.data.DataLoader"
WRAPPERS = frozenset({"torch.nn.DataParallel", "torch.nn.DistributedDataParallel", "torch.compile"})
RENAMED = {"torch.nn.functional.sigmoid": "torch.sigmoid", "torch.special.expit": "torch.sigmoid",
            "torch.serialization.load": "torch.load", "torch.autograd.no_grad": "torch.no_grad",
            "torch.autograd.grad_mode.no_grad": "torch.no_grad",
            "torch.autograd.inference_mode": "torch.inference_mode",
            "torch.autograd.grad_mode.inference_mode": "torch.inference_mode",
            "torch.autograd.set_grad_enabled": "torch.set_grad_enabled",
            "torch.autograd.grad_mode.set_grad_enabled": "torch.set_grad_enabled",
            "torch.autograd.enable_grad": "torch.enable_grad", "torch.nn.parameter.Parameter": "torch.nn.Parameter",
            "tqdm.auto.trange": "tqdm.trange"}


def canon(q: str | None) -> str | None:
    """One spelling per torch object: ``torch.nn.modules.loss.CrossEntropyLoss`` is
    ``torch.nn.CrossEntropyLoss``, ``torch.utils.data.dataloader.DataLoader`` is
    ``torch.utils.data.DataLoader``."""
    if q is None:
        return None
    parts = q.split(".")
    home = _public_home(q, parts) if parts[-1][:1].isupper() else None
    return f"{home}.{parts[-1]}" if home is not None else RENAMED.get(q, q)


def _public_home(q: str, parts: list[str]) -> str | None:
    """The package that exports the class ``q`` names by its defining module (``torch.nn`` for
    ``torch.nn.modules.loss.CrossEntropyLoss``); None when ``q`` is spelled as exported."""
    if q.startswith("torch.nn."):
        return "torch.nn" if _exported_by_nn(q, parts) else None
    if q.startswith("torch.utils.data.") and parts[-1] == "DataLoader":
        return "torch.utils.data"
    if q.startswith("torch.optim.") and len(parts) == 4 and parts[2] not in ("lr_scheduler", "swa_utils"):
        return "torch.optim"  # torch.optim.adamw.AdamW; a scheduler keeps its module
    return None


def _exported_by_nn(q: str, parts: list[str]) -> bool:
    """A class of ``torch.nn.modules.*``, or DataParallel/DDP of ``torch.nn.parallel.*``."""
    return ((q.startswith("torch.nn.modules.") and len(parts) >= 4)
            or (q.startswith("torch.nn.parallel.") and parts[-1] in ("DataParallel", "DistributedDataParallel")))


def is_torch_nn_class(q: str | None) -> bool:
    return bool(q) and q.startswith("torch.nn.") and q.count(".") == 2 and q[9:10].isupper()


def is_loss(q: str | None) -> bool:
    return bool(q) and ((is_torch_nn_class(q) and q.endswith("Loss"))
                        or (q.startswith("torch.nn.functional.") and q[20:] in F_LOSSES))


def pos(node: ast.AST) -> tuple[int, int]:
    return (node.lineno, node.col_offset)


def end(node: ast.AST) -> tuple[int, int]:
    return (node.end_lineno, node.end_col_offset)


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def kwarg(call: ast.Call, name: str, index: int | None = None) -> ast.AST | None:
    """The argument ``name`` of ``call`` (by keyword, or at positional ``index``)."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return _positional(call, index) if index is not None else None


def _positional(call: ast.Call, index: int) -> ast.AST | None:
    """The argument at position ``index``, when no ``*args`` comes before it."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[:index + 1]):
        return call.args[index]
    return None


def has_star_args(call: ast.Call) -> bool:
    return any(kw.arg is None for kw in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)


def _put_last(node: ast.AST, name: str) -> ast.AST | None:
    """The element ``node`` puts last into the list ``name``: ``name.append(x)``, ``name += [.., x]``,
    ``name = [.., x]``; None for any other node."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
            and is_name(node.func.value, name) and len(node.args) == 1):
        return node.args[0]
    target = node.target if isinstance(node, ast.AugAssign) else (
        node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
    value = node.value if isinstance(node, (ast.AugAssign, ast.Assign)) else None
    if is_name(target, name) and isinstance(value, ast.List) and value.elts:
        return value.elts[-1]
    return None


def number(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    return None


def called_method(node: ast.AST) -> str | None:
    """``name`` for a method call ``x.name(...)``; None for any other node."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def is_name(node: ast.AST | None, name: str) -> bool:
    """``node`` is the bare name ``name``."""
    return isinstance(node, ast.Name) and node.id == name


def is_false(node: ast.AST | None) -> bool:
    """``node`` is the literal ``False``."""
    return isinstance(node, ast.Constant) and node.value is False


def walk_local(root: ast.AST, into_loops: bool = True) -> Iterator[ast.AST]:
    """Nodes under ``root`` without entering nested functions and classes (their code runs
    elsewhere), nor nested loops if ``into_loops`` is False."""
    stack = list(ast.iter_child_nodes(root))[::-1]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, FUNCS + (ast.ClassDef,)) or (not into_loops and isinstance(node, LOOPS)):
            continue
        stack.extend(list(ast.iter_child_nodes(node))[::-1])


RECORDED = frozenset({ast.Name, ast.Call, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor,
                      ast.comprehension, ast.With, ast.AsyncWith, ast.NamedExpr, ast.FunctionDef,
                      ast.AsyncFunctionDef, ast.ClassDef, ast.arguments, ast.Import, ast.ImportFrom, ast.Global,
                      ast.Nonlocal, ast.ExceptHandler, ast.Delete})


@dataclass(frozen=True)
class Kind:
    """What an expression evaluates to, as far as the file shows."""

    # tensor | batch | module | lossfn | loader | device | optimizer | scheduler | params | named_params | self | class
    # | func
    cat: str
    # tensor: log_softmax, softmax, sigmoid, loss, param, batch, expanded; module/lossfn: qualname or "local"
    detail: str | None = None
    ref: object = None  # ClassDef for local modules and self; the constructor Call; a FunctionDef

    def key(self):
        return (self.cat, self.detail, self.ref if isinstance(self.ref, (ast.ClassDef, ast.FunctionDef)) else None)


TENSOR = Kind("tensor")
LOSS = Kind("tensor", "loss")
PARAM = Kind("tensor", "param")
BATCH = Kind("tensor", "batch")


class FileAnalysis:
    """A parsed file with what the rules ask of it: parents, scopes, name bindings,
    import aliases, and the kind of an expression (memoised)."""

    def __init__(self, tree: ast.Module, source: str):
        self.tree = tree
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.parent: dict[ast.AST, ast.AST] = {}
        self.scope_of: dict[ast.AST, ast.AST | None] = {}
        self.bindings: dict[ast.AST, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self.uses: dict[ast.AST, dict[str, list[ast.Name]]] = defaultdict(lambda: defaultdict(list))
        self.global_names: dict[ast.AST, set[str]] = defaultdict(set)
        self.nodes: dict[type, list[ast.AST]] = defaultdict(list)
        self.aliases: dict[str, str] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.plain_functions: dict[str, list[ast.AST]] = defaultdict(list)
        self.calls_by_name: dict[str, list[ast.Call]] = defaultdict(list)
        self.self_attrs: dict[ast.ClassDef, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self._kinds: dict[ast.AST, Kind | None] = {}
        self._qualnames: dict[ast.AST, str | None] = {}
        self._busy: set = set()
        self.memo: dict = {}
        self._index()

    # ---- indexing

    def _index(self) -> None:
        stack: list[tuple[ast.AST, ast.AST | None]] = [(self.tree, None)]
        scope_of, parent, nodes = self.scope_of, self.parent, self.nodes
        while stack:
            node, scope = stack.pop()
            scope_of[node] = scope
            nodes[type(node)].append(node)
            if type(node) in RECORDED:
                self._record(node, scope)
            inner = node if isinstance(node, SCOPES) else scope
            for child in reversed(list(ast.iter_child_nodes(node))):
                parent[child] = node
                stack.append((child, inner))
        self._sort_bindings()

    def _sort_bindings(self) -> None:
        """Each name's bindings in source order (:meth:`lookup` takes the latest before a read)."""
        for table in self.bindings.values():
            for binds in table.values():
                binds.sort(key=lambda b: b[0])

    def _record(self, node: ast.AST, scope: ast.AST | None) -> None:
        if isinstance(node, ast.Name):
            self.uses[self.frame_of(scope)][node.id].append(node)
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                self.calls_by_name[node.func.id].append(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            self._record_import(node, scope)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.arguments)):
            self._record_definition(node, scope)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            self.global_names[scope].update(node.names)
        else:
            self._record_binding(node, scope)

    def _record_binding(self, node: ast.AST, scope: ast.AST | None) -> None:
        """The names a statement binds: assignments, loop and ``with`` targets, ``except ... as``, ``del``."""
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.AugAssign)):
            self._record_assignment(node, scope)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._bind_loop(scope, node.target, node, end(node.iter))
        elif isinstance(node, ast.comprehension):
            self._bind_loop(scope, node.target, node, (0, 0))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self._bind(scope, item.optional_vars, None, end(item.context_expr), node)
        else:
            self._record_unbinding(node, scope)

    def _record_assignment(self, node: ast.AST, scope: ast.AST | None) -> None:
        """``x = v`` (each target), ``x: T = v``, ``(x := v)``, and ``x += v``."""
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(scope, target, node.value, end(node), node)
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name):
                self._add(scope, node.target.id, (end(node), "aug", node, None))
        elif node.value is not None:
            self._bind(scope, node.target, node.value, end(node), node)

    def _record_unbinding(self, node: ast.AST, scope: ast.AST | None) -> None:
        """``except ... as name`` and ``del name``: the name's value is unknown from there on."""
        if isinstance(node, ast.ExceptHandler):
            if node.name:
                self._add(scope, node.name, (pos(node), "unknown", node, None))
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self._add(scope, t.id, (end(node), "unknown", node, None))

    def _record_definition(self, node: ast.AST, scope: ast.AST | None) -> None:
        """A function or class (its name, and the table it belongs in), or a function's parameters."""
        if isinstance(node, ast.arguments):
            self._record_parameters(node)
            return
        self._add(scope, node.name, (pos(node), "def", node, None))
        if isinstance(node, ast.ClassDef):
            self.classes[node.name] = node
        elif not isinstance(self.parent.get(node), ast.ClassDef):
            self.plain_functions[node.name].append(node)

    def _record_parameters(self, node: ast.arguments) -> None:
        func = self.parent.get(node)
        for arg in node.posonlyargs + node.args + node.kwonlyargs + [node.vararg, node.kwarg]:
            if arg is not None:
                self._add(func, arg.arg, ((0, 0), "param", func, arg.arg))

    def _record_import(self, node: ast.Import | ast.ImportFrom, scope: ast.AST | None) -> None:
        """The local names an import binds, and the qualified names they stand for."""
        for alias in node.names:
            bound = _imported_name(node, alias)
            if bound is not None:
                local, qualified = bound
                self.aliases[local] = qualified
                self._add(scope, local, (end(node), "import", node, None))

    def _add(self, scope, name: str, binding: tuple) -> None:
        self.bindings[scope][name].append(binding)

    def _bind(self, scope, target, value, pos, stmt, path: tuple = ()) -> None:
        if isinstance(target, ast.Name):
            self._add(scope, target.id, (pos, "value", value, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            self._bind_unpacking(scope, target, value, pos, stmt, path)
        elif isinstance(target, ast.Starred):
            self._bind(scope, target.value, None, pos, stmt)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and value is not None:
            self._bind_self_attr(scope, target, value, path, stmt)

    def _bind_unpacking(self, scope, target, value, pos, stmt, path: tuple) -> None:
        """``a, b = ...``: element by element from a display of the same length (``a, b = x, y``), else
        each name to its ``path`` into the value."""
        if not path and _same_length_displays(target, value):
            for t, v in zip(target.elts, value.elts):
                self._bind(scope, t, v, pos, stmt)
        else:
            for i, t in enumerate(target.elts):
                self._bind(scope, t, value if not isinstance(t, ast.Starred) else None, pos, stmt, path + (i,))

    def _bind_self_attr(self, scope, target: ast.Attribute, value: ast.AST, path: tuple, stmt: ast.AST) -> None:
        """``self.x = value`` in a method (``self`` its first parameter): recorded for the class."""
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        cls = self.parent.get(scope)
        args = scope.args.posonlyargs + scope.args.args
        if isinstance(cls, ast.ClassDef) and args and args[0].arg == target.value.id:
            self.self_attrs[cls][target.attr].append((value, path, stmt))

    def _bind_loop(self, scope, target, loop, pos, path: tuple = ()) -> None:
        if isinstance(target, ast.Name):
            self._add(scope, target.id, (pos, "for", loop, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for i, t in enumerate(target.elts):
                self._bind_loop(scope, t, loop, pos, path + (i,))
        elif isinstance(target, ast.Starred):
            self._bind_loop(scope, target.value, loop, pos, path + (None,))

    # ---- positions and structure

    def line(self, lineno: int) -> str:
        return self.lines[lineno - 1] if 0 < lineno <= len(self.lines) else ""

    def column(self, node: ast.AST) -> int:
        """1-based column in characters (ast counts UTF-8 bytes)."""
        line = self.line(node.lineno)
        if line.isascii():
            return node.col_offset + 1
        return len(line.encode("utf-8")[:node.col_offset].decode("utf-8", "replace")) + 1

    def frame_of(self, scope):
        """The function (or module) whose frame runs code of ``scope``: comprehensions and class
        bodies run in the enclosing one."""
        while isinstance(scope, COMPS + (ast.ClassDef,)) and scope is not None:
            scope = self.scope_of.get(scope)
        return scope

    def function_scope(self, node: ast.AST):
        """The function (or module) whose frame runs ``node``: comprehensions run inline."""
        return self.frame_of(self.scope_of.get(node))

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        node = self.parent.get(node)
        while node is not None:
            yield node
            node = self.parent.get(node)

    def local_ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        """Ancestors up to (not including) the enclosing function or class."""
        for anc in self.ancestors(node):
            if isinstance(anc, FUNCS + (ast.ClassDef, ast.Module)):
                return
            yield anc

    def loops_around(self, node: ast.AST) -> list[ast.AST]:
        return [a for a in self.local_ancestors(node) if isinstance(a, LOOPS)]

    def method_class(self, node: ast.AST) -> ast.ClassDef | None:
        """The nn.Module subclass whose method (or a function nested in one) holds ``node``."""
        for anc in self.ancestors(node):
            if isinstance(anc, ast.ClassDef):
                return anc if self.is_module_class(anc) else None
        return None

    def qualname(self, node: ast.AST) -> str | None:
        """The dotted name ``node`` refers to through the file's imports, canonical."""
        try:
            return self._qualnames[node]
        except KeyError:
            pass
        spelled = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        q = self._resolve(spelled) if spelled is not None else None
        self._qualnames[node] = q
        return q

    def _resolve(self, spelled: str) -> str | None:
        """The canonical name a dotted spelling stands for through the file's imports; None when
        its head is not imported."""
        head, _, rest = spelled.partition(".")
        if head not in self.aliases:
            return None
        return canon(self.aliases[head] + ("." + rest if rest else ""))

    @property
    def mentions_cuda(self) -> bool:
        """The file uses CUDA somewhere (``.cuda``, ``torch.cuda``, a ``"cuda..."`` device)."""
        if "cuda" not in self.memo:
            self.memo["cuda"] = self._uses_cuda()
        return self.memo["cuda"]

    def _uses_cuda(self) -> bool:
        return any(n.attr == "cuda" for n in self.nodes[ast.Attribute]) or any(
            isinstance(n.value, str) and n.value.startswith("cuda") for n in self.nodes[ast.Constant])

    # ---- names

    def lookup(self, node: ast.Name):
        """The binding of ``node`` where it is read: the latest one before it in its own
        function, else the last one in an enclosing function or the module."""
        name, where = node.id, pos(node)
        for scope, own in self._scopes_searched(node, name):
            binds = self.bindings.get(scope, {}).get(name)
            if binds:
                found = _last_before(binds, where) if own else binds[-1]
                if found is not None or not isinstance(scope, COMPS):
                    return found  # None: bound later in this function, a loop-carried value
        return None

    def _scopes_searched(self, node: ast.Name, name: str) -> Iterator[tuple[ast.AST, bool]]:
        """The scopes where the read ``node`` of ``name`` may find its binding, innermost first, each
        with whether the read runs in its frame (its function, or a comprehension inline in it): a
        class body is not seen from its methods, and a ``global`` name is the module's."""
        scope, own = self.scope_of.get(node), True
        while scope is not None:
            if isinstance(scope, ast.ClassDef) and not own:
                scope = self.scope_of.get(scope)
                continue
            if name in self.global_names.get(scope, ()):
                scope, own = self.tree, False
            yield scope, own
            own = own and isinstance(scope, COMPS)
            scope = self.scope_of.get(scope)

    def binding_value(self, node: ast.AST) -> ast.AST | None:
        """The expression a Name was last assigned (plain ``x = expr`` only)."""
        if isinstance(node, ast.Name):
            b = self.lookup(node)
            if b is not None and b[1] == "value" and not b[3]:
                return b[2]
        return None

    # ---- kinds

    def kind(self, node: ast.AST | None) -> Kind | None:
        """What ``node`` evaluates to, or None when the file does not show it."""
        if node is None:
            return None
        if node in self._kinds:
            return self._kinds[node]
        if node in self._busy or len(self._busy) > 60:
            return None
        self._busy.add(node)
        try:
            k = self._kind(node)
        finally:
            self._busy.discard(node)
        self._kinds[node] = k
        return k

    def _kind(self, node: ast.AST) -> Kind | None:
        if isinstance(node, ast.Name):
            return self._name_kind(node)
        if isinstance(node, ast.Call):
            return self._call_kind(node)
        if isinstance(node, ast.Attribute):
            return self._attribute_kind(node)
        if isinstance(node, ast.Subscript):
            return _item_kind(self.kind(node.value))
        return self._operation_kind(node)

    def _operation_kind(self, node: ast.AST) -> Kind | None:
        """A tensor for arithmetic with a tensor; for ``a if c else b``, the kind both branches share."""
        if isinstance(node, ast.BinOp):
            return TENSOR if self._is_tensor(node.left) or self._is_tensor(node.right) else None
        if isinstance(node, ast.IfExp):
            return _same_kind(self.kind(node.body), self.kind(node.orelse))
        return None

    def _name_kind(self, node: ast.Name) -> Kind | None:
        b = self.lookup(node)
        return self._binding_kind(b) if b is not None else None

    def _is_tensor(self, node: ast.AST) -> bool:
        return _category(self.kind(node)) == "tensor"

    def _binding_kind(self, b) -> Kind | None:
        _, how, a, extra = b
        if how == "value":
            return self._assigned_kind(a, extra)
        if how == "for":
            return self._element_kind(a.iter, extra)
        if how == "aug":
            return self._augmented_kind(a, b)
        if how == "param":
            return self._param_kind(a, extra)
        if how == "def":
            return Kind("class" if isinstance(a, ast.ClassDef) else "func", ref=a)
        return None

    def _augmented_kind(self, stmt: ast.AugAssign, binding: tuple) -> Kind | None:
        """``x += v`` keeps the kind of the value of ``x`` before it."""
        return self.kind(stmt.target) if self.lookup(stmt.target) is not binding else None

    def _assigned_kind(self, value: ast.AST, path: tuple) -> Kind | None:
        """The kind of a name assigned ``value`` (at ``path`` into it when unpacked: the elements of a
        tensor, as from torch.max or chunk, are tensors)."""
        if path:
            return TENSOR if self._is_tensor(value) else None
        return self.kind(value)

    def _element_kind(self, it: ast.AST, path: tuple) -> Kind | None:
        """The kind of the loop variable at ``path`` in ``for <target> in it``."""
        unwrapped = self._unwrap_iterable(it, path)
        if unwrapped is None:
            return None
        it, path = unwrapped
        k = self.kind(it)
        if k is None and self.looks_like_loader(it):
            k = Kind("loader")
        return _element_of(k, path) if k is not None else None

    def _unwrap_iterable(self, it: ast.AST, path: tuple) -> tuple[ast.AST, tuple] | None:
        """The iterable under ``enumerate(...)`` / ``tqdm(...)`` / ``iter(...)`` and the path into its
        elements; None when the path picks ``enumerate``'s counter."""
        while isinstance(it, ast.Call) and it.args:
            fn = self.qualname(it.func) or _called_function(it)
            if fn == "enumerate":
                if path[:1] != (1,):  # the counter, or the whole (counter, element) pair
                    return None
                path, it = path[1:], it.args[0]
            elif fn in _SAME_ELEMENTS:
                it = it.args[0]
            else:
                break
        return it, path

    def looks_like_loader(self, node: ast.AST) -> bool:
        spelled = dotted(node)
        return spelled is not None and bool(LOADERISH.search(spelled.rsplit(".", 1)[-1]))

    def _param_kind(self, func: ast.AST, name: str) -> Kind | None:
        """A parameter's kind: ``self`` in a method; for a plain function, the kind every
        call in this file passes (when they all agree); failing that, what the function
        itself shows (:meth:`module_by_use`): a model passed in from another file is a module
        when it is annotated as one or the function calls ``.eval()``/``.parameters()`` on it."""
        if isinstance(func, ast.Lambda):
            return None
        positional = func.args.posonlyargs + func.args.args
        cls = self.parent.get(func)
        if isinstance(cls, ast.ClassDef):
            if _is_self_parameter(func, positional, name):
                return Kind("self", ref=cls)
            return self.module_by_use(func, name)
        if len(self.plain_functions.get(func.name, ())) != 1:
            return self.module_by_use(func, name)
        return self._kind_passed_in(func, name, positional)

    def _kind_passed_in(self, func: ast.AST, name: str, positional: list[ast.arg]) -> Kind | None:
        """The kind every call of the plain function ``func`` in this file passes as its parameter
        ``name``; :meth:`module_by_use` when none of them shows a kind (or there is no call)."""
        kinds = self._passed_kinds(func, name, positional)
        if kinds is None:
            return None
        if all(k is None for k in kinds):
            return self.module_by_use(func, name)
        if any(k is None for k in kinds):
            return None
        return _agreed_kind(kinds)

    def _passed_kinds(self, func: ast.AST, name: str, positional: list[ast.arg]) -> list[Kind | None] | None:
        """The kind each call of ``func`` in this file passes as its parameter ``name``; None when a
        call does not pass it (a default applies)."""
        index = next((i for i, a in enumerate(positional) if a.arg == name), None)
        kinds = []
        for call in self.calls_by_name.get(func.name, ()):
            arg = kwarg(call, name, index)
            if arg is None:
                return None
            kinds.append(self.kind(arg))
        return kinds

    def tensor_by_use(self, node: ast.Name) -> bool:
        """The value ``node`` reads (a name whose kind is unknown: a parameter, an element
        unpacked from a batch passed in) is used as a tensor in its function: ``.shape`` /
        ``.ndim`` read, a shape method called (``.view``, ``.unsqueeze``, ``.size()`` ...), or
        handed to a ``torch.*`` tensor function, through the same binding. Batch objects with an
        in-place ``.to()`` (PyG's ``Batch``, ``BatchEncoding``) have none of these."""
        binding = self.lookup(node)
        if binding is None or binding[1] not in ("value", "for", "param"):
            return False
        key = ("tensor_by_use", id(binding[2]), node.id, binding[0])
        if key in self.memo:
            return self.memo[key]
        uses = self.uses.get(self.function_scope(node), {}).get(node.id, ())
        found = any(self._used_as_tensor(use) for use in uses if self.lookup(use) is binding)
        self.memo[key] = found
        return found

    def _used_as_tensor(self, use: ast.Name) -> bool:
        """This read of a name shows a tensor: its ``.shape``/``.ndim``, a shape method called on
        it, or it handed to a torch tensor function."""
        parent = self.parent.get(use)
        if isinstance(parent, ast.Attribute) and parent.value is use:
            return self._is_shape_use(parent)
        if isinstance(parent, ast.Call) and use in parent.args:
            return _takes_tensors(self.qualname(parent.func))
        return False

    def _is_shape_use(self, attr: ast.Attribute) -> bool:
        """``x.shape``, ``x.ndim``, or a shape method called: ``x.view(...)``, ``x.size()`` ..."""
        return attr.attr in ("shape", "ndim") or (attr.attr in SHAPE_METHODS
                                                  and _is_called(attr, self.parent.get(attr)))

    def module_by_use(self, func: ast.AST, name: str) -> Kind | None:
        """``Kind("module")`` if parameter ``name`` of ``func`` is shown to be an nn.Module by
        the function itself: annotated ``nn.Module`` (or an nn class), or the receiver of a
        method only modules have (``.eval()``, ``.parameters()``, ``.named_modules()`` ...)
        while the name is never rebound. None otherwise."""
        key = ("module_by_use", func, name)
        if key in self.memo:
            return self.memo[key]
        args = func.args.posonlyargs + func.args.args + func.args.kwonlyargs
        arg = next((a for a in args if a.arg == name), None)
        found = self._module_shown_by(func, arg) if arg is not None else None
        self.memo[key] = found
        return found

    def _module_shown_by(self, func: ast.AST, arg: ast.arg) -> Kind | None:
        """The module kind the parameter ``arg`` of ``func`` is shown to have: by its annotation, or
        (never rebound) by a module-only method called on it."""
        q = self.qualname(arg.annotation) if arg.annotation is not None else None
        if _is_nn_module_class(q):
            return Kind("module", q)
        if any(b[1] != "param" for b in self.bindings.get(func, {}).get(arg.arg, ())):
            return None
        return Kind("module") if _calls_module_method_on(func, arg.arg) else None

    def _attribute_kind(self, node: ast.Attribute) -> Kind | None:
        if self.qualname(node) is not None:
            return None  # a module-level name such as torch.float16
        rk = self.kind(node.value)
        k = _tensor_attribute_kind(rk, node.attr)
        if k is not None:
            return k
        return self._self_attr_kind(rk.ref, node.attr) if _is_local_instance(rk) else None

    def _self_attr_kind(self, cls, attr: str, seen=None) -> Kind | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        entries = self.self_attrs.get(cls, {}).get(attr)
        if entries:
            return self._assigned_attr_kind(entries)
        bases, seen = self._bases_to_search(cls, seen)
        for base in bases:
            k = self._self_attr_kind(base, attr, seen)
            if k is not None:
                return k
        return None

    def _assigned_attr_kind(self, entries: list) -> Kind | None:
        """The kind every assignment ``self.attr = value`` of a class gives, when they agree."""
        kinds = [self._assigned_kind(value, path) for value, path, _ in entries]
        if kinds[0] is not None and all(k is not None and k.key() == kinds[0].key() for k in kinds):
            return kinds[0]
        return None

    def _call_kind(self, node: ast.Call) -> Kind | None:
        func = node.func
        q = self.qualname(func)
        if q is not None:
            return self.constructor_kind(q, node)
        if isinstance(func, ast.Attribute):
            return self._method_result_kind(func)
        return self._callable_result_kind(func)

    def _method_result_kind(self, func: ast.Attribute) -> Kind | None:
        """What calling the method ``func`` (``x.m``) gives, by the method and the kind of ``x``."""
        m = func.attr
        if m in _TENSOR_RESULTS:
            return _TENSOR_RESULTS[m]
        rk = self.kind(func.value)
        cat = _category(rk)
        if cat in (None, "module", "self") and m in _PARAMETER_METHODS:
            return Kind(_PARAMETER_METHODS[m])
        if cat == "tensor":
            return _tensor_method_kind(rk, m)
        if cat in ("module", "lossfn", "self") and m in MODULE_SELF_METHODS:
            return self._module_itself(rk)
        return self._callable_result_kind(func)

    def _module_itself(self, k: Kind) -> Kind | None:
        """What ``module.to(...)`` / ``.train()`` / ``.cuda()`` returns: the module (of a local class for ``self``)."""
        if k.cat in ("module", "lossfn"):
            return k
        return self._local_module(k.ref)

    def _local_module(self, cls) -> Kind | None:
        """An instance of the class ``cls`` of this file, when it is an nn.Module."""
        return Kind("module", "local", cls) if self.is_module_class(cls) else None

    def _callable_result_kind(self, func: ast.AST) -> Kind | None:
        """What calling the object ``func`` gives: a loss function's loss, a module's output, a local
        module class's instance."""
        fk = self.kind(func)  # a callable object: a loss, a module (self.fc, model.encoder), a class
        cat = _category(fk)
        if cat == "lossfn":
            return LOSS
        if cat == "class":
            return self._local_module(fk.ref)
        if cat == "module" and fk.detail in RNN_MODULES:
            return None  # (output, state): output is a PackedSequence when the input was packed
        if self.is_module_kind(fk):
            return Kind("tensor", self.output_activation(fk))
        return None

    def constructor_kind(self, q: str, node: ast.Call) -> Kind | None:
        if q in WRAPPERS and node.args:  # DataParallel(model), DDP(model), torch.compile(model) call model
            k = self.kind(node.args[0])
            return k if _category(k) == "module" else None
        return _nn_object_kind(q, node) or _library_object_kind(q, node) or _tensor_function_kind(q)

    def output_activation(self, k: Kind) -> str | None:
        """``softmax``/``log_softmax``/``sigmoid`` if calling this module returns that."""
        if _is_local_instance(k):
            return self.forward_activation(k.ref)
        if k.cat != "module":
            return None
        if k.detail in ACT_MODULES:
            return ACT_MODULES[k.detail]
        if k.detail == "torch.nn.Sequential" and isinstance(k.ref, ast.Call) and k.ref.args:
            return self._last_layer_activation(k)
        return None

    def _last_layer_activation(self, k: Kind) -> str | None:
        """The output activation of the last layer of the ``nn.Sequential(...)`` of kind ``k``; for
        ``nn.Sequential(*layers)``, the layer last put in ``layers`` before it (appended, maybe under an ``if``)."""
        arg = k.ref.args[-1]
        if isinstance(arg, ast.Starred):
            arg = self._last_listed(arg.value, k.ref)
        last = self.kind(arg) if arg is not None else None
        if _category(last) == "module" and last is not k:
            return self.output_activation(last)
        return None

    def _last_listed(self, name: ast.AST, before: ast.AST) -> ast.AST | None:
        """The element last put into the list variable ``name`` before ``before``, in the same frame:
        ``name.append(x)``, ``name += [x]``, ``name = [..., x]``; None where the file does not show it."""
        if not isinstance(name, ast.Name):
            return None
        scope = self.function_scope(before)
        last: tuple[tuple[int, int], ast.AST] | None = None
        for node in walk_local(scope):
            item = _put_last(node, name.id)
            if item is not None and pos(node) < pos(before) and (last is None or pos(node) > last[0]):
                last = (pos(node), item)
        return last[1] if last is not None else None

    def forward_activation(self, cls) -> str | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        key = ("fwd", cls)
        if key not in self.memo:
            self.memo[key] = None  # while it is decided: a forward that calls itself shows none
            self.memo[key] = _sole_activation(self._returned_activations(cls))
        return self.memo[key]

    def _returned_activations(self, cls: ast.ClassDef, name: str = "forward", depth: int = 0) -> set[str | None]:
        """The activation (None for none or not a tensor) of each value the class's ``forward`` returns; a
        ``return self.helper(x)`` of a method of the class counts the helper's returns (three calls deep)."""
        method = self.method(cls, name)
        if method is None:
            return set()
        out: set[str | None] = set()
        for node in walk_local(method):
            if isinstance(node, ast.Return):
                helper = _self_method_call(node.value)
                if helper is not None and depth < 3 and self.method(cls, helper) is not None:
                    out |= self._returned_activations(cls, helper, depth + 1)
                else:
                    out.add(_activation(self.kind(node.value)))
        return out

    def method(self, cls: ast.ClassDef, name: str, seen=None):
        own = _own_method(cls, name)
        if own is not None:
            return own
        bases, seen = self._bases_to_search(cls, seen)
        for base in bases:
            found = self.method(base, name, seen)
            if found is not None:
                return found
        return None

    def _bases_to_search(self, cls: ast.ClassDef, seen: set | None) -> tuple[list[ast.ClassDef], set]:
        """The local bases of ``cls`` not searched yet, and the classes searched once ``cls`` is
        (a guard against cyclic bases)."""
        seen = (seen or set()) | {cls}
        return [base for base in self.local_bases(cls) if base not in seen], seen

    def local_bases(self, cls: ast.ClassDef) -> list[ast.ClassDef]:
        return [self.classes[b.id] for b in cls.bases
                if isinstance(b, ast.Name) and b.id in self.classes and self.classes[b.id] is not cls]

    def is_module_kind(self, k: Kind | None) -> bool:
        """``k`` is an nn.Module: a module, or ``self`` in a module class."""
        cat = _category(k)
        return cat == "module" or (cat == "self" and self.is_module_class(k.ref))

    def is_module_class(self, cls) -> bool:
        """``cls`` derives from torch.nn.Module (directly, through an nn class, a Lightning
        module, or another class of this file)."""
        if not isinstance(cls, ast.ClassDef):
            return False
        key = ("module", cls)
        if key not in self.memo:
            self.memo[key] = False  # while it is decided: a cycle of bases makes no module
            self.memo[key] = self._derives_from_module(cls)
        return self.memo[key]

    def _derives_from_module(self, cls: ast.ClassDef) -> bool:
        return (any(_is_module_base(self.qualname(base)) for base in cls.bases)
                or any(self.is_module_class(b) for b in self.local_bases(cls)))

    # ---- gradient mode

    def _grad_mode(self, expr: ast.AST) -> str | None:
        """'off' if ``with expr:`` / ``@expr`` disables autograd, 'on' if it enables it."""
        call = expr if isinstance(expr, ast.Call) else None
        func = call.func if call is not None else expr
        q = self.qualname(func)
        if q is not None and q.startswith("torch."):
            return _torch_grad_mode(q, call)
        return _wrapper_grad_mode(func)

    def _first_grad_mode(self, exprs: list[ast.AST]) -> str | None:
        """The grad mode set by the first of ``exprs`` (``with`` items, decorators) that sets one."""
        for expr in exprs:
            mode = self._grad_mode(expr)
            if mode is not None:
                return mode
        return None

    def no_grad(self, node: ast.AST) -> bool:
        """``node`` runs with autograd off: inside ``with torch.no_grad()`` (or
        inference_mode / set_grad_enabled(False)) in its function, under a decorated
        function, or after a ``torch.set_grad_enabled(False)`` statement."""
        inside = True
        child = node
        for anc in self.ancestors(node):
            mode = self._with_grad_mode(anc, child) if inside else None
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mode = self._function_grad_mode(anc, node, inside)
                inside = False
            if mode is not None:
                return mode == "off"
            child = anc
        return inside and self._grad_disabled_before(self.tree, node)

    def _function_grad_mode(self, func: ast.AST, node: ast.AST, inside: bool) -> str | None:
        """The grad mode ``func`` sets for ``node`` in it: by a decorator, or, when ``node`` runs
        in ``func``'s own frame (``inside``), 'off' after a ``torch.set_grad_enabled(False)``."""
        mode = self._first_grad_mode(func.decorator_list)
        if mode is None and inside and self._grad_disabled_before(func, node):
            return "off"
        return mode

    def _with_grad_mode(self, anc: ast.AST, child: ast.AST) -> str | None:
        """The grad mode ``anc`` sets for ``child`` when it is a ``with`` whose body holds it."""
        if isinstance(anc, (ast.With, ast.AsyncWith)) and child in anc.body:
            return self._first_grad_mode([item.context_expr for item in anc.items])
        return None

    def _grad_disabled_before(self, scope: ast.AST, node: ast.AST) -> bool:
        state = None
        for stmt in walk_local(scope):
            if self._is_set_grad_statement(stmt) and pos(stmt) < pos(node):
                state = self._grad_mode(stmt.value)
        return state == "off"

    def _is_set_grad_statement(self, stmt: ast.AST) -> bool:
        """A statement ``torch.set_grad_enabled(...)`` (not a ``with``): the mode holds from there on."""
        return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and self.qualname(stmt.value.func) == "torch.set_grad_enabled")

    # ---- calls grouped by frame

    def calls_in(self, scope: ast.AST) -> list[ast.Call]:
        """The calls that run in ``scope``'s frame, in source order."""
        if "by_frame" not in self.memo:
            groups = defaultdict(list)
            for call in self.nodes[ast.Call]:
                groups[self.function_scope(call)].append(call)
            for calls in groups.values():
                calls.sort(key=pos)
            self.memo["by_frame"] = groups
        return self.memo["by_frame"].get(scope, [])

    def backward_mentions(self, scope: ast.AST, name: str) -> bool:
        """A ``.backward()`` (or autograd.backward/grad) in ``scope`` is called on an
        expression that uses ``name``, directly or through a variable assigned from it."""
        return any(self._mentions(expr, name) for call in self.calls_in(scope)
                   for expr in self._backward_operands(call))

    def _mentions(self, expr: ast.AST, name: str) -> bool:
        """``expr`` uses ``name``, directly or through a variable assigned from it."""
        return any(self._reads(n, name) for n in [expr, *ast.walk(expr)] if isinstance(n, ast.Name))

    def _backward_operands(self, call: ast.Call) -> list[ast.AST]:
        """What a backward call differentiates: ``x`` of ``x.backward()``, the first argument of
        ``torch.autograd.backward``/``grad``; nothing for another call."""
        q = self.qualname(call.func)
        if is_backward(call):
            return [call.func.value]
        if q in ("torch.autograd.backward", "torch.autograd.grad"):
            return list(call.args[:1])
        return []

    def _reads(self, n: ast.Name, name: str) -> bool:
        """``n`` is ``name``, or a variable assigned from an expression that uses ``name``."""
        if n.id == name:
            return True
        value = self.binding_value(n)
        return value is not None and any(is_name(v, name) for v in ast.walk(value))


def forward_before(f: FileAnalysis, node: ast.AST) -> bool:
    """A module or loss is called before ``node`` in its function's frame (a graph may exist): a module
    of this file or torch.nn, or a callable passed in as a parameter (a model given to a train step)."""
    here = pos(node)
    for c in f.calls_in(f.function_scope(node)):
        if pos(c) >= here:
            return False
        if _calls_model(f, c):
            return True
    return False


def _calls_model(f: FileAnalysis, call: ast.Call) -> bool:
    """``call`` calls a module or a loss, or a callable passed in as a parameter."""
    k = f.kind(call.func)
    return _category(k) == "lossfn" or f.is_module_kind(k) or _is_parameter(f, call.func)


def backward_after(f: FileAnalysis, node: ast.AST) -> bool:
    """A ``.backward()`` (or ``torch.autograd.backward``) runs after ``node`` in its function's frame."""
    here = pos(node)
    return any(pos(c) > here and (is_backward(c) or f.qualname(c.func) == "torch.autograd.backward")
               for c in f.calls_in(f.function_scope(node)))


def enclosing_function(f: FileAnalysis, node: ast.AST) -> ast.AST | None:
    for anc in f.ancestors(node):
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return anc
    return None


def rate_limited(test: ast.AST) -> bool:
    return any(_is_modulo(n) or _names_memory(n) for n in ast.walk(test))


def _is_modulo(node: ast.AST) -> bool:
    """``a % b``: every k-th step."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)


def _names_memory(node: ast.AST) -> bool:
    """A name or attribute chain whose last part is about memory (``low_memory``, ``cfg.memory``)."""
    return isinstance(node, (ast.Name, ast.Attribute)) and "memory" in (dotted(node) or "").rsplit(".", 1)[-1]


def is_backward(node: ast.AST) -> bool:
    """``x.backward(...)``: a call of a method named backward (a loss's, a tensor's)."""
    return called_method(node) == "backward"


def is_step_loop(f: FileAnalysis, loop: ast.AST) -> bool:
    """A loop whose iterations are training steps: it iterates a loader, or its own body
    (not a nested loop) calls backward() or optimizer.step()."""
    if isinstance(loop, (ast.For, ast.AsyncFor)) and element_is_batch(f, loop):
        return True
    return any(is_backward(node) for node in walk_local(loop, into_loops=False))


def unwrap_iterable(f: FileAnalysis, it: ast.AST) -> ast.AST:
    """``loader`` for ``enumerate(loader)``, ``tqdm(loader)``, ``iter(loader)``."""
    while isinstance(it, ast.Call) and it.args and (
            _called_function(it) in ("enumerate", "tqdm", "iter") or f.qualname(it.func) in TQDM):
        it = it.args[0]
    return it


def element_is_batch(f: FileAnalysis, loop: ast.AST) -> bool:
    it = unwrap_iterable(f, loop.iter)
    k = f.kind(it)
    return (k is not None and k.cat == "loader") or (k is None and f.looks_like_loader(it))


COMPAT_ERRORS = frozenset({"AttributeError", "ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def catches_compat(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    if caught is None:
        return True
    return any(dotted(e) in COMPAT_ERRORS for e in (caught.elts if isinstance(caught, ast.Tuple) else [caught]))


def version_guarded(f: FileAnalysis, node: ast.AST) -> bool:
    """Compatibility code for old torch versions: under a ``hasattr``/``getattr``/version
    test (either branch: the other one holds the new spelling), or in a ``try`` whose
    handler catches the AttributeError/ImportError that the new versions raise."""
    child = node
    for anc in f.ancestors(node):
        if _guards_compat(anc, child):
            return True
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            break
        child = anc
    return False


def _guards_compat(anc: ast.AST, child: ast.AST) -> bool:
    """``anc`` makes its part ``child`` compatibility code: a branch of a compat test, the body of a
    ``try`` that catches compat errors, or such a handler."""
    if isinstance(anc, (ast.If, ast.IfExp)):
        return child is not anc.test and _compat_test(anc.test)
    if isinstance(anc, ast.Try):
        return child in anc.body and any(catches_compat(h) for h in anc.handlers)
    return isinstance(anc, ast.ExceptHandler) and catches_compat(anc)  # the fallback after the new spelling failed


def _compat_test(test: ast.AST) -> bool:
    """``test`` asks ``hasattr``/``getattr`` or reads a name about a version."""
    for n in ast.walk(test):
        if _called_function(n) in ("hasattr", "getattr"):
            return True
        if "version" in _identifier(n).lower():
            return True
    return False


def _identifier(node: ast.AST) -> str:
    """The name a Name reads or an Attribute picks; "" for other nodes."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def dataloaders(f: FileAnalysis) -> list[tuple[ast.Call, list[ast.AST]]]:
    """Every DataLoader(...) call with the loops that iterate it: by the loader object the
    loop's iterable is known to be, or by the same variable / attribute name."""
    if "loaders" not in f.memo:
        f.memo["loaders"] = _find_dataloaders(f)
    return f.memo["loaders"]


def _find_dataloaders(f: FileAnalysis) -> list[tuple[ast.Call, list[ast.AST]]]:
    loops = f.nodes[ast.For] + f.nodes[ast.AsyncFor]
    out = []
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) != DATALOADER:
            continue
        names = {dotted(t) for t in _assignment_targets(f.parent.get(call))} - {None}
        out.append((call, [loop for loop in loops if _iterates(f, loop, call, names)]))
    return out


def _assignment_targets(stmt: ast.AST | None) -> list[ast.AST]:
    """The targets of ``stmt`` when it is an assignment (plain or annotated)."""
    if isinstance(stmt, ast.Assign):
        return stmt.targets
    return [stmt.target] if isinstance(stmt, ast.AnnAssign) else []


def _iterates(f: FileAnalysis, loop: ast.AST, call: ast.Call, names: set) -> bool:
    """``loop`` iterates the loader ``call`` builds: the call itself, a value known to be that
    loader, or a variable / attribute of one of ``names``; also through ``zip``, ``itertools.cycle`` /
    ``islice`` / ``chain`` / ``zip_longest`` (two loaders read in step are each iterated)."""
    for it in _iterables(f, loop.iter):
        k = f.kind(it)
        if it is call or (_category(k) == "loader" and k.ref is call) or dotted(it) in names:
            return True
    return False


_COMBINERS = frozenset({"zip", "itertools.cycle", "itertools.islice", "itertools.chain", "itertools.zip_longest"})


def _iterables(f: FileAnalysis, it: ast.AST) -> list[ast.AST]:
    """The iterables a loop's iterable reads, through enumerate/tqdm/iter and the combiners of
    :data:`_COMBINERS` (bounded: four levels)."""
    out, todo = [], [(it, 0)]
    while todo:
        node, depth = todo.pop()
        node = unwrap_iterable(f, node)
        name = f.qualname(node.func) if isinstance(node, ast.Call) else None
        if isinstance(node, ast.Call) and depth < 4 and (name in _COMBINERS or _called_function(node) == "zip"):
            todo.extend((a, depth + 1) for a in node.args if not isinstance(a, ast.Starred))
        else:
            out.append(node)
    return out


def moves_batch_to_cuda(f: FileAnalysis, loop: ast.AST) -> bool:
    batch = _names_in(loop.target)
    return any(root_name(node.func.value) in batch and _moves_to_cuda(f, node)
               for node in walk_local(loop) if called_method(node) in ("cuda", "to"))


def _names_in(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _moves_to_cuda(f: FileAnalysis, call: ast.Call) -> bool:
    """``x.cuda()``, or ``x.to(device)`` with a CUDA device."""
    if call.func.attr == "cuda":
        return True
    device = kwarg(call, "device", 0)
    return device is not None and is_cuda_device(f, device)


def is_cuda_device(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` names a CUDA device: a ``"cuda..."`` string (directly or in the expression
    the variable was assigned), or, when its value is not in the file, a variable called
    ``device``/``gpu``/``cuda`` in a file that uses CUDA."""
    value = f.binding_value(node)
    strings = _strings_in(value if value is not None else node)
    if strings:
        return any(s.startswith("cuda") for s in strings)
    return _named_like_device(f, node)


_DEVICE_NAME = re.compile(r"device|dev$|gpu|cuda", re.IGNORECASE)


def _named_like_device(f: FileAnalysis, node: ast.AST) -> bool:
    """A variable or attribute called ``device``/``gpu``/``cuda`` ... in a file that uses CUDA."""
    spelled = dotted(node)
    return spelled is not None and f.mentions_cuda and _DEVICE_NAME.search(spelled.rsplit(".", 1)[-1]) is not None


def _strings_in(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def optimizer_step(f: FileAnalysis, call: ast.Call) -> bool:
    """``optimizer.step()`` or ``scaler.step(optimizer)``."""
    if _category(f.kind(call.func.value)) == "optimizer":
        return True
    return bool(call.args) and _category(f.kind(call.args[0])) == "optimizer"


def ancestors_until(f: FileAnalysis, node: ast.AST, stop: ast.AST) -> Iterator[ast.AST]:
    for anc in f.ancestors(node):
        if anc is stop:
            return
        yield anc


def looks_like_model(f: FileAnalysis, node: ast.AST) -> bool:
    k = f.kind(node)
    if k is not None:
        return f.is_module_kind(k)
    # a model passed in, or a name that says so
    return _is_parameter(f, node) or (isinstance(node, ast.Name) and "model" in node.id.lower())


def _is_parameter(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` is a name that reads a parameter of its function."""
    b = f.lookup(node) if isinstance(node, ast.Name) else None
    return b is not None and b[1] == "param"


# ---- evidence for the step rules (TT126-TT132)


def exclusive_branches(f: FileAnalysis, a: ast.AST, b: ast.AST) -> bool:
    """``a`` and ``b`` never run in the same pass: they lie in different branches of one ``if``
    (or conditional expression), or in a ``try`` body and one of its handlers (or two handlers)."""
    la, lb = _branch_labels(f, a), _branch_labels(f, b)
    return any(anc in lb and _exclusive(label, lb[anc]) for anc, label in la.items())


def _branch_labels(f: FileAnalysis, node: ast.AST) -> dict:
    """Each ``if``/``try`` around ``node`` -> the branch of it that holds ``node``."""
    out, child = {}, node
    for anc in f.ancestors(node):
        if isinstance(anc, (ast.If, ast.IfExp, ast.Try, getattr(ast, "TryStar", ast.Try))):
            out[anc] = _branch_label(anc, child)
        child = anc
    return out


def _branch_label(anc: ast.AST, child: ast.AST) -> object:
    """Which branch of the ``if``/``try`` ``anc`` holds ``child``: "body", "orelse", a handler;
    "test" or "final" for parts that run whichever branch is taken."""
    if isinstance(anc, (ast.If, ast.IfExp)):
        return _if_branch(anc, child)
    if child in anc.finalbody:
        return "final"
    if child in anc.handlers:
        return anc.handlers.index(child)
    return "body"  # the try body and its else run together


def _if_branch(anc: ast.If | ast.IfExp, child: ast.AST) -> str:
    if child is anc.test:
        return "test"
    if child is anc.body or (isinstance(anc.body, list) and child in anc.body):
        return "body"
    return "orelse"


def _exclusive(a: object, b: object) -> bool:
    """Two branch labels of one ``if``/``try`` that never run in the same pass."""
    return a not in ("test", "final") and b not in ("test", "final") and a != b


# ---- FileAnalysis helpers: kinds


# methods whose result is a tensor of a known detail, whatever the receiver
_TENSOR_RESULTS = {**{m: Kind("tensor", act) for m, act in ACT_METHODS.items()},
                   "expand": Kind("tensor", "expanded"), "expand_as": Kind("tensor", "expanded")}
_PARAMETER_ATTRS = ("weight", "bias", "grad")
_PARAMETER_METHODS = {"parameters": "params", "buffers": "params", "named_parameters": "named_params",
                      "named_buffers": "named_params"}
# category -> (path to the element, its kind): a parameter of .parameters(), the value of a
# .named_parameters() pair, a row of a tensor
_ELEMENTS = {"params": ((), PARAM), "named_params": ((1,), PARAM), "tensor": ((), TENSOR)}


def _tensor_attribute_kind(rk: Kind | None, attr: str) -> Kind | None:
    """``x.weight``/``.bias``/``.grad`` of a module, a tensor or an unknown ``x`` (of kind ``rk``) is a
    parameter; ``.data``, ``.T``, ``.real`` ... of a tensor a tensor (a parameter's, a parameter)."""
    cat = _category(rk)
    if attr in _PARAMETER_ATTRS:
        return PARAM if cat in (None, "module", "self", "tensor") else None
    if cat == "tensor" and attr in ("data", "T", "mT", "H", "mH", "real", "imag"):
        return PARAM if rk.detail == "param" else TENSOR
    return None


def _element_of(k: Kind, path: tuple) -> Kind | None:
    """The kind of the element at ``path`` of one item of an iterable of kind ``k``."""
    if k.cat == "loader":
        return _batch_element(k, path)
    where, element = _ELEMENTS.get(k.cat, (None, None))
    return element if path == where else None


def _batch_element(loader: Kind, path: tuple) -> Kind:
    """The kind of the element at ``path`` of a batch of the DataLoader of kind ``loader``."""
    if path or (isinstance(loader.ref, ast.Call) and kwarg(loader.ref, "collate_fn", 6) is None):
        return BATCH  # an element of a batch, or a default-collated batch: tensors
    return Kind("batch")  # a whole batch from a custom collate: maybe an object with an in-place .to()


def _agreed_kind(kinds: list[Kind]) -> Kind | None:
    """The kind all of ``kinds`` share (the same object, or at least the same category and detail)."""
    if all(k.key() == kinds[0].key() for k in kinds):
        return kinds[0]
    if all((k.cat, k.detail) == (kinds[0].cat, kinds[0].detail) for k in kinds):
        return Kind(kinds[0].cat, kinds[0].detail)
    return None


def _tensor_method_kind(rk: Kind, method: str) -> Kind | None:
    """What ``t.method(...)`` gives for a tensor ``t`` of kind ``rk``: a tensor (a view keeps its
    activation), or None for a method returning a number, a shape, a storage."""
    if method in NON_TENSOR_METHODS:
        return None
    if method in VIEW_METHODS:
        return Kind("tensor", rk.detail if rk.detail in ACTS else None)
    return TENSOR


def _nn_object_kind(q: str, node: ast.Call) -> Kind | None:
    """The kind of an activation's output, a functional's result, a parameter, or a torch.nn layer or
    loss built by ``q(...)``."""
    last = q.rsplit(".", 1)[-1]
    if q in ACT_FUNCS:
        return Kind("tensor", ACT_FUNCS[q])
    if q.startswith("torch.nn.functional."):
        return LOSS if last in F_LOSSES else TENSOR
    if q in ("torch.nn.Parameter", "torch.nn.UninitializedParameter"):
        return PARAM
    if is_torch_nn_class(q):
        return Kind("lossfn" if last.endswith("Loss") else "module", q, node)
    return None


def _library_object_kind(q: str, node: ast.Call) -> Kind | None:
    """The kind of a data loader, device, optimizer, scheduler or torchvision model built by ``q(...)``."""
    if q == DATALOADER:
        return Kind("loader", q, node)
    if q == "torch.device":
        return Kind("device", None, node)
    if q.startswith("torch.optim."):
        return _optim_object_kind(q, node)
    if q.startswith("torchvision.models.") and q.rsplit(".", 1)[-1][:1].islower():
        return Kind("module", q, node)
    return None


def _optim_object_kind(q: str, node: ast.Call) -> Kind | None:
    """An optimizer (a class of ``torch.optim``) or a scheduler (of ``torch.optim.lr_scheduler``)."""
    if not q.rsplit(".", 1)[-1][:1].isupper():
        return None
    if q.count(".") == 2:
        return Kind("optimizer", q, node)
    return Kind("scheduler", q, node) if q.startswith("torch.optim.lr_scheduler.") else None


def _tensor_function_kind(q: str) -> Kind | None:
    """The kind of what a torch function ``q`` returns when it is a tensor (an expanded one for
    ``broadcast_to``)."""
    if q == "torch.broadcast_to":
        return Kind("tensor", "expanded")
    if _is_torch_tensor_function(q) or q.startswith(("torch.linalg.", "torch.fft.", "torch.special.")):
        return TENSOR
    return None


def _category(k: Kind | None) -> str | None:
    """``k.cat``, or None for an unknown kind."""
    return k.cat if k is not None else None


def _is_local_instance(k: Kind | None) -> bool:
    """``k`` is an instance of a class of this file: ``self``, or a local module."""
    cat = _category(k)
    return cat == "self" or (cat == "module" and k.detail == "local")


def _self_method_call(node: ast.AST | None) -> str | None:
    """``name`` of ``self.name(...)``; None for anything else."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_name(node.func.value, "self")):
        return node.func.attr
    return None


def _activation(k: Kind | None) -> str | None:
    """The activation a tensor of kind ``k`` comes from (its detail); None for anything but a tensor."""
    return k.detail if _category(k) == "tensor" else None


def _item_kind(k: Kind | None) -> Kind | None:
    """The kind of ``x[i]`` for ``x`` of kind ``k``: a batch's item is a tensor of the batch; a
    tensor's keeps its activation (or its being a batch)."""
    cat = _category(k)
    if cat == "batch":
        return BATCH
    if cat == "tensor":
        return Kind("tensor", k.detail if k.detail in ACTS or k.detail == "batch" else None)
    return None


def _sole_activation(acts: set[str | None]) -> str | None:
    """The activation when it is the one every ``return`` of a forward gives."""
    act = next(iter(acts)) if len(acts) == 1 else None
    return act if act in ACTS else None


def _same_kind(a: Kind | None, b: Kind | None) -> Kind | None:
    """``a`` when ``b`` is the same kind (both branches of a conditional expression agree)."""
    return a if a is not None and b is not None and a.key() == b.key() else None


def _is_module_base(q: str | None) -> bool:
    """A base class ``q`` that makes a subclass an nn.Module: an nn class, a LightningModule."""
    return q is not None and ((is_torch_nn_class(q) and q != "torch.nn.Parameter")
                              or q.rsplit(".", 1)[-1] == "LightningModule")


def _is_self_parameter(method: ast.AST, positional: list[ast.arg], name: str) -> bool:
    """``name`` is the first parameter of ``method`` (its ``self``: neither a staticmethod nor a classmethod)."""
    decorators = {dotted(d) for d in method.decorator_list}
    return bool(positional) and positional[0].arg == name and not decorators & {"staticmethod", "classmethod"}


def _takes_tensors(q: str | None) -> bool:
    """``q`` is a torch function on tensors: ``torch.<f>`` of :data:`TENSOR_FUNCS`, or a functional."""
    return q is not None and (_is_torch_tensor_function(q) or q.startswith("torch.nn.functional."))


def _is_torch_tensor_function(q: str) -> bool:
    """``q`` is ``torch.<f>`` for a top-level function that returns a tensor (``torch.zeros``, ``torch.cat``)."""
    return q.startswith("torch.") and q.count(".") == 1 and q.rsplit(".", 1)[-1] in TENSOR_FUNCS


def _is_nn_module_class(q: str | None) -> bool:
    """``q`` is a torch.nn layer class: not a loss, nor ``nn.Parameter``."""
    return q is not None and is_torch_nn_class(q) and not q.endswith("Loss") and q != "torch.nn.Parameter"


def _own_method(cls: ast.ClassDef, name: str) -> ast.AST | None:
    """The method ``name`` defined in the body of ``cls`` itself."""
    return next((stmt for stmt in cls.body
                 if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name), None)


def _calls_module_method_on(func: ast.AST, name: str) -> bool:
    """``func`` calls on ``name`` a method only modules have: ``name.eval()``, ``name.parameters()`` ..."""
    return any(called_method(node) in MODULE_ONLY_METHODS and is_name(node.func.value, name)
               for node in walk_local(func))


# ---- FileAnalysis helpers: gradient mode


_GRAD_MODE = {True: "on", False: "off"}


def _torch_grad_mode(q: str, call: ast.Call | None) -> str | None:
    """What ``torch.no_grad`` / ``inference_mode`` / ``enable_grad`` / ``set_grad_enabled(flag)`` (``q``,
    called as ``call`` if it is a call) does to autograd: 'off', 'on', or None when not shown."""
    if q in NO_GRAD:
        flag = _mode_flag(call) if q == "torch.inference_mode" else None
        return "on" if flag is False else "off"
    if q == "torch.enable_grad":
        return "on"
    if q == "torch.set_grad_enabled":
        return _GRAD_MODE.get(_mode_flag(call))
    return None


def _mode_flag(call: ast.Call | None) -> bool | None:
    """The literal ``mode`` a call such as ``inference_mode(False)`` passes; None when not a literal bool."""
    return _bool_value(kwarg(call, "mode", 0)) if call is not None else None


def _bool_value(node: ast.AST | None) -> bool | None:
    """The value of a ``True``/``False`` literal; None for anything else."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, bool) else None


def _wrapper_grad_mode(func: ast.AST) -> str | None:
    """A project's own wrapper (YOLOv5's @smart_inference_mode(), a no_grad_if_eval helper) says
    what it does in its name; the rules would otherwise see a training forward."""
    spelled = dotted(func)
    last = spelled.rsplit(".", 1)[-1].lower() if spelled else ""
    return "off" if "inference_mode" in last or "no_grad" in last else None


# ---- FileAnalysis helpers: indexing and names


def _imported_name(node: ast.Import | ast.ImportFrom, alias: ast.alias) -> tuple[str, str] | None:
    """The local name ``alias`` of an import binds and the qualified name it stands for; None for
    a relative or star import (nothing this analysis resolves)."""
    if isinstance(node, ast.Import):
        local = alias.asname or alias.name.split(".")[0]
        return local, alias.name if alias.asname else local
    return _imported_from(node, alias)


def _imported_from(node: ast.ImportFrom, alias: ast.alias) -> tuple[str, str] | None:
    if node.level == 0 and node.module and alias.name != "*":
        return alias.asname or alias.name, f"{node.module}.{alias.name}"
    return None


def _same_length_displays(target: ast.Tuple | ast.List, value: ast.AST | None) -> bool:
    """``a, b = x, y``: a tuple or list display of as many elements as the target, none starred."""
    return (isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
            and not any(isinstance(e, ast.Starred) for e in value.elts + target.elts))


def _last_before(binds: list, where: tuple[int, int]) -> tuple | None:
    """The last of ``binds`` (in source order) made at or before ``where``."""
    return next((b for b in reversed(binds) if b[0] <= where), None)


# ---- small predicates on nodes


def _called_function(node: ast.AST) -> str | None:
    """``name`` for a call of a bare name ``name(...)``; None for any other node."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id
    return None


def _is_called(func: ast.AST, parent: ast.AST | None) -> bool:
    """``parent`` (the parent node of ``func``) is the call of ``func``."""
    return isinstance(parent, ast.Call) and parent.func is func
