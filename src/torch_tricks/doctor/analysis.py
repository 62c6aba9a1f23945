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
    if q.startswith("torch.nn.modules.") and len(parts) >= 4 and parts[-1][:1].isupper():
        return "torch.nn." + parts[-1]
    if q.startswith("torch.nn.parallel.") and parts[-1] in ("DataParallel", "DistributedDataParallel"):
        return "torch.nn." + parts[-1]
    if q.startswith("torch.utils.data.") and parts[-1] == "DataLoader":
        return DATALOADER
    if q.startswith("torch.optim.") and len(parts) == 4 and parts[-1][:1].isupper() \
            and parts[2] not in ("lr_scheduler", "swa_utils"):  # torch.optim.adamw.AdamW; a scheduler keeps its module
        return "torch.optim." + parts[-1]
    return RENAMED.get(q, q)


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
    if index is not None and len(call.args) > index and not any(
            isinstance(a, ast.Starred) for a in call.args[:index + 1]):
        return call.args[index]
    return None


def has_star_args(call: ast.Call) -> bool:
    return any(kw.arg is None for kw in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)


def number(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    return None


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
            children = []
            for name in node._fields:
                value = getattr(node, name, None)
                if isinstance(value, ast.AST):
                    children.append(value)
                elif isinstance(value, list):
                    children.extend(v for v in value if isinstance(v, ast.AST))
            for child in reversed(children):
                parent[child] = node
                stack.append((child, inner))
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
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(scope, target, node.value, end(node), node)
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
            if node.value is not None:
                self._bind(scope, node.target, node.value, end(node), node)
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name):
                self._add(scope, node.target.id, (end(node), "aug", node, None))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._bind_loop(scope, node.target, node, end(node.iter))
        elif isinstance(node, ast.comprehension):
            self._bind_loop(scope, node.target, node, (0, 0))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self._bind(scope, item.optional_vars, None, end(item.context_expr), node)
        elif isinstance(node, ast.ExceptHandler):
            if node.name:
                self._add(scope, node.name, (pos(node), "unknown", node, None))
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self._add(scope, t.id, (end(node), "unknown", node, None))

    def _record_definition(self, node: ast.AST, scope: ast.AST | None) -> None:
        """A function or class (its name, and the table it belongs in), or a function's parameters."""
        if isinstance(node, ast.arguments):
            func = self.parent.get(node)
            for arg in node.posonlyargs + node.args + node.kwonlyargs + [node.vararg, node.kwarg]:
                if arg is not None:
                    self._add(func, arg.arg, ((0, 0), "param", func, arg.arg))
            return
        self._add(scope, node.name, (pos(node), "def", node, None))
        if isinstance(node, ast.ClassDef):
            self.classes[node.name] = node
        elif not isinstance(self.parent.get(node), ast.ClassDef):
            self.plain_functions[node.name].append(node)

    def _record_import(self, node: ast.Import | ast.ImportFrom, scope: ast.AST | None) -> None:
        """The local names an import binds, and the qualified names they stand for."""
        for alias in node.names:
            if isinstance(node, ast.Import):
                local = alias.asname or alias.name.split(".")[0]
                self.aliases[local] = alias.name if alias.asname else local
            elif node.level == 0 and node.module and alias.name != "*":
                local = alias.asname or alias.name
                self.aliases[local] = f"{node.module}.{alias.name}"
            else:
                continue
            self._add(scope, local, (end(node), "import", node, None))

    def _add(self, scope, name: str, binding: tuple) -> None:
        self.bindings[scope][name].append(binding)

    def _bind(self, scope, target, value, pos, stmt, path: tuple = ()) -> None:
        if isinstance(target, ast.Name):
            self._add(scope, target.id, (pos, "value", value, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            if (not path and isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
                    and not any(isinstance(e, ast.Starred) for e in value.elts + target.elts)):
                for t, v in zip(target.elts, value.elts):
                    self._bind(scope, t, v, pos, stmt)
            else:
                for i, t in enumerate(target.elts):
                    self._bind(scope, t, value if not isinstance(t, ast.Starred) else None, pos, stmt, path + (i,))
        elif isinstance(target, ast.Starred):
            self._bind(scope, target.value, None, pos, stmt)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and value is not None:
            self._bind_self_attr(scope, target, value, path, stmt)

    def _bind_self_attr(self, scope, target: ast.Attribute, value: ast.AST, path: tuple, stmt: ast.AST) -> None:
        """``self.x = value`` in a method (``self`` its first parameter): recorded for the class."""
        method = scope if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        cls = self.parent.get(method) if method is not None else None
        args = method.args.posonlyargs + method.args.args if method is not None else []
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
        q = None
        spelled = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if spelled is not None:
            head, _, rest = spelled.partition(".")
            if head in self.aliases:
                q = canon(self.aliases[head] + ("." + rest if rest else ""))
        self._qualnames[node] = q
        return q

    @property
    def mentions_cuda(self) -> bool:
        """The file uses CUDA somewhere (``.cuda``, ``torch.cuda``, a ``"cuda..."`` device)."""
        if "cuda" not in self.memo:
            self.memo["cuda"] = any(n.attr == "cuda" for n in self.nodes[ast.Attribute]) or any(
                isinstance(n.value, str) and n.value.startswith("cuda") for n in self.nodes[ast.Constant])
        return self.memo["cuda"]

    # ---- names

    def lookup(self, node: ast.Name):
        """The binding of ``node`` where it is read: the latest one before it in its own
        function, else the last one in an enclosing function or the module."""
        name, where = node.id, pos(node)
        scope, own = self.scope_of.get(node), True
        while scope is not None:
            if isinstance(scope, ast.ClassDef) and not own:
                scope = self.scope_of.get(scope)
                continue
            if name in self.global_names.get(scope, ()):
                scope, own = self.tree, False
            binds = self.bindings.get(scope, {}).get(name)
            if binds:
                if not own:
                    return binds[-1]
                before = [b for b in binds if b[0] <= where]
                if before:
                    return before[-1]
                if not isinstance(scope, COMPS):
                    return None  # bound later in this function: a loop-carried value
            own = own and isinstance(scope, COMPS)
            scope = self.scope_of.get(scope)
        return None

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
            b = self.lookup(node)
            return self._binding_kind(b) if b is not None else None
        if isinstance(node, ast.Call):
            return self._call_kind(node)
        if isinstance(node, ast.Attribute):
            return self._attribute_kind(node)
        if isinstance(node, ast.Subscript):
            k = self.kind(node.value)
            if k is not None and k.cat == "batch":
                return BATCH
            if k is not None and k.cat == "tensor":
                return Kind("tensor", k.detail if k.detail in ACTS or k.detail == "batch" else None)
            return None
        if isinstance(node, ast.BinOp):
            for side in (node.left, node.right):
                k = self.kind(side)
                if k is not None and k.cat == "tensor":
                    return TENSOR
            return None
        if isinstance(node, ast.IfExp):
            a, b = self.kind(node.body), self.kind(node.orelse)
            return a if a is not None and b is not None and a.key() == b.key() else None
        return None

    def _binding_kind(self, b) -> Kind | None:
        _, how, a, extra = b
        if how == "value":
            k = self.kind(a)
            if extra and k is not None:  # unpacking: elements of a tensor (torch.max, chunk) are tensors
                return TENSOR if k.cat == "tensor" else None
            return k
        if how == "for":
            return self._element_kind(a.iter, extra)
        if how == "aug":
            return self.kind(a.target) if self.lookup(a.target) is not b else None
        if how == "param":
            return self._param_kind(a, extra)
        if how == "def":
            return Kind("class", ref=a) if isinstance(a, ast.ClassDef) else Kind("func", ref=a)
        return None

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
            fn = self.qualname(it.func) or (it.func.id if isinstance(it.func, ast.Name) else None)
            if fn == "enumerate":
                if not path or path[0] != 1:
                    return None
                path, it = path[1:], it.args[0]
            elif fn in TQDM or fn in ("iter", "tqdm"):
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
            decorators = {dotted(d) for d in func.decorator_list}
            if positional and positional[0].arg == name and not decorators & {"staticmethod", "classmethod"}:
                return Kind("self", ref=cls)
            return self.module_by_use(func, name)
        if len(self.plain_functions.get(func.name, ())) != 1:
            return self.module_by_use(func, name)
        return self._kind_passed_in(func, name, positional)

    def _kind_passed_in(self, func: ast.AST, name: str, positional: list[ast.arg]) -> Kind | None:
        """The kind every call of the plain function ``func`` in this file passes as its parameter
        ``name``; :meth:`module_by_use` when none of them shows a kind (or there is no call)."""
        index = next((i for i, a in enumerate(positional) if a.arg == name), None)
        kinds = []
        for call in self.calls_by_name.get(func.name, ()):
            arg = kwarg(call, name, index)
            if arg is None:
                return None
            kinds.append(self.kind(arg))
        if not kinds or any(k is None for k in kinds):
            return self.module_by_use(func, name) if all(k is None for k in kinds) else None
        return _agreed_kind(kinds)

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
        found = False
        for use in self.uses.get(self.function_scope(node), {}).get(node.id, ()):
            if self.lookup(use) is not binding:
                continue
            parent = self.parent.get(use)
            if isinstance(parent, ast.Attribute) and parent.value is use:
                call = self.parent.get(parent)
                if parent.attr in ("shape", "ndim") or (parent.attr in SHAPE_METHODS and isinstance(call, ast.Call)
                                                         and call.func is parent):
                    found = True
            elif isinstance(parent, ast.Call) and use in parent.args:
                q = self.qualname(parent.func)
                found = q is not None and ((q.startswith("torch.") and q.count(".") == 1
                                            and q.rsplit(".", 1)[-1] in TENSOR_FUNCS)
                                           or q.startswith("torch.nn.functional."))
            if found:
                break
        self.memo[key] = found
        return found

    def module_by_use(self, func: ast.AST, name: str) -> Kind | None:
        """``Kind("module")`` if parameter ``name`` of ``func`` is shown to be an nn.Module by
        the function itself: annotated ``nn.Module`` (or an nn class), or the receiver of a
        method only modules have (``.eval()``, ``.parameters()``, ``.named_modules()`` ...)
        while the name is never rebound. None otherwise."""
        key = ("module_by_use", func, name)
        if key in self.memo:
            return self.memo[key]
        found = None
        args = func.args.posonlyargs + func.args.args + func.args.kwonlyargs
        arg = next((a for a in args if a.arg == name), None)
        if arg is not None:
            q = self.qualname(arg.annotation) if arg.annotation is not None else None
            if q is not None and is_torch_nn_class(q) and not q.endswith("Loss") and q != "torch.nn.Parameter":
                found = Kind("module", q)
            elif not any(b[1] != "param" for b in self.bindings.get(func, {}).get(name, ())):
                for node in walk_local(func):
                    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr in MODULE_ONLY_METHODS and isinstance(node.func.value, ast.Name)
                            and node.func.value.id == name):
                        found = Kind("module")
                        break
        self.memo[key] = found
        return found

    def _attribute_kind(self, node: ast.Attribute) -> Kind | None:
        if self.qualname(node) is not None:
            return None  # a module-level name such as torch.float16
        rk = self.kind(node.value)
        if node.attr in ("weight", "bias", "grad"):
            return PARAM if rk is None or rk.cat in ("module", "self", "tensor") else None
        if rk is None:
            return None
        if rk.cat == "tensor" and node.attr in ("data", "T", "mT", "H", "mH", "real", "imag"):
            return PARAM if rk.detail == "param" else TENSOR
        if rk.cat == "self" or (rk.cat == "module" and rk.detail == "local"):
            return self._self_attr_kind(rk.ref, node.attr)
        return None

    def _self_attr_kind(self, cls, attr: str, seen=None) -> Kind | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        entries = self.self_attrs.get(cls, {}).get(attr)
        if entries:
            kinds = []
            for value, path, _ in entries:
                k = self.kind(value)
                kinds.append((TENSOR if k is not None and k.cat == "tensor" else None) if path else k)
            if kinds[0] is not None and all(k is not None and k.key() == kinds[0].key() for k in kinds):
                return kinds[0]
            return None
        seen = (seen or set()) | {cls}
        for base in self.local_bases(cls):
            if base not in seen:
                k = self._self_attr_kind(base, attr, seen)
                if k is not None:
                    return k
        return None

    def _call_kind(self, node: ast.Call) -> Kind | None:
        func = node.func
        q = self.qualname(func)
        if q is not None:
            return self.constructor_kind(q, node)
        if isinstance(func, ast.Attribute):
            m = func.attr
            if m in ACT_METHODS:
                return Kind("tensor", ACT_METHODS[m])
            if m in ("expand", "expand_as"):
                return Kind("tensor", "expanded")
            rk = self.kind(func.value)
            if (rk is None or rk.cat in ("module", "self")) and m in _PARAMETER_METHODS:
                return Kind(_PARAMETER_METHODS[m])
            if rk is not None and rk.cat == "tensor":
                return _tensor_method_kind(rk, m)
            if rk is not None and rk.cat in ("module", "lossfn", "self") and m in MODULE_SELF_METHODS:
                return self._module_itself(rk)
        return self._callable_result_kind(func)

    def _module_itself(self, k: Kind) -> Kind | None:
        """What ``module.to(...)`` / ``.train()`` / ``.cuda()`` returns: the module (of a local class for ``self``)."""
        if k.cat in ("module", "lossfn"):
            return k
        return Kind("module", "local", k.ref) if self.is_module_class(k.ref) else None

    def _callable_result_kind(self, func: ast.AST) -> Kind | None:
        """What calling the object ``func`` gives: a loss function's loss, a module's output, a local
        module class's instance."""
        fk = self.kind(func)  # a callable object: a loss, a module (self.fc, model.encoder), a class
        if fk is None:
            return None
        if fk.cat == "lossfn":
            return LOSS
        if fk.cat == "class":
            return Kind("module", "local", fk.ref) if self.is_module_class(fk.ref) else None
        if fk.cat == "module" and fk.detail in RNN_MODULES:
            return None  # (output, state): output is a PackedSequence when the input was packed
        if fk.cat == "module" or (fk.cat == "self" and self.is_module_class(fk.ref)):
            return Kind("tensor", self.output_activation(fk))
        return None

    def constructor_kind(self, q: str, node: ast.Call) -> Kind | None:
        last = q.rsplit(".", 1)[-1]
        if q in WRAPPERS and node.args:  # DataParallel(model), DDP(model), torch.compile(model) call model
            k = self.kind(node.args[0])
            return k if k is not None and k.cat == "module" else None
        if q in ACT_FUNCS:
            return Kind("tensor", ACT_FUNCS[q])
        if q.startswith("torch.nn.functional."):
            return LOSS if last in F_LOSSES else TENSOR
        if q in ("torch.nn.Parameter", "torch.nn.UninitializedParameter"):
            return PARAM
        if is_torch_nn_class(q):
            return Kind("lossfn" if last.endswith("Loss") else "module", q, node)
        return _library_object_kind(q, node) or _tensor_function_kind(q)

    def output_activation(self, k: Kind) -> str | None:
        """``softmax``/``log_softmax``/``sigmoid`` if calling this module returns that."""
        if k.cat == "self" or (k.cat == "module" and k.detail == "local"):
            return self.forward_activation(k.ref)
        if k.cat == "module":
            if k.detail in ACT_MODULES:
                return ACT_MODULES[k.detail]
            if k.detail == "torch.nn.Sequential" and isinstance(k.ref, ast.Call) and k.ref.args:
                last = self.kind(k.ref.args[-1])
                if last is not None and last.cat == "module" and last is not k:
                    return self.output_activation(last)
        return None

    def forward_activation(self, cls) -> str | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        key = ("fwd", cls)
        if key not in self.memo:
            self.memo[key] = None
            forward = self.method(cls, "forward")
            acts = set()
            if forward is not None:
                for node in walk_local(forward):
                    if isinstance(node, ast.Return):
                        k = self.kind(node.value) if node.value is not None else None
                        acts.add(k.detail if k is not None and k.cat == "tensor" else None)
            if len(acts) == 1 and next(iter(acts)) in ACTS:
                self.memo[key] = acts.pop()
        return self.memo[key]

    def method(self, cls: ast.ClassDef, name: str, seen=None):
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return stmt
        seen = (seen or set()) | {cls}
        for base in self.local_bases(cls):
            if base not in seen:
                found = self.method(base, name, seen)
                if found is not None:
                    return found
        return None

    def local_bases(self, cls: ast.ClassDef) -> list[ast.ClassDef]:
        return [self.classes[b.id] for b in cls.bases
                if isinstance(b, ast.Name) and b.id in self.classes and self.classes[b.id] is not cls]

    def is_module_class(self, cls) -> bool:
        """``cls`` derives from torch.nn.Module (directly, through an nn class, a Lightning
        module, or another class of this file)."""
        if not isinstance(cls, ast.ClassDef):
            return False
        key = ("module", cls)
        if key not in self.memo:
            self.memo[key] = False
            found = False
            for base in cls.bases:
                q = self.qualname(base)
                if q is not None and ((is_torch_nn_class(q) and q != "torch.nn.Parameter")
                                      or q.rsplit(".", 1)[-1] == "LightningModule"):
                    found = True
            found = found or any(self.is_module_class(b) for b in self.local_bases(cls))
            self.memo[key] = found
        return self.memo[key]

    # ---- gradient mode

    def _grad_mode(self, expr: ast.AST) -> str | None:
        """'off' if ``with expr:`` / ``@expr`` disables autograd, 'on' if it enables it."""
        call = expr if isinstance(expr, ast.Call) else None
        q = self.qualname(call.func if call is not None else expr)
        if q in NO_GRAD:
            flag = kwarg(call, "mode", 0) if call is not None and q == "torch.inference_mode" else None
            return "on" if isinstance(flag, ast.Constant) and flag.value is False else "off"
        if q == "torch.enable_grad":
            return "on"
        if q == "torch.set_grad_enabled" and call is not None:
            flag = kwarg(call, "mode", 0)
            if isinstance(flag, ast.Constant) and isinstance(flag.value, bool):
                return "on" if flag.value else "off"
        if q is None or not q.startswith("torch."):
            # A project's own wrapper (YOLOv5's @smart_inference_mode(), a no_grad_if_eval helper) says
            # what it does in its name; the rules would otherwise see a training forward.
            spelled = dotted(call.func if call is not None else expr)
            last = spelled.rsplit(".", 1)[-1].lower() if spelled else ""
            if "inference_mode" in last or "no_grad" in last:
                return "off"
        return None

    def no_grad(self, node: ast.AST) -> bool:
        """``node`` runs with autograd off: inside ``with torch.no_grad()`` (or
        inference_mode / set_grad_enabled(False)) in its function, under a decorated
        function, or after a ``torch.set_grad_enabled(False)`` statement."""
        inside = True
        child = node
        for anc in self.ancestors(node):
            if inside and isinstance(anc, (ast.With, ast.AsyncWith)) and child in anc.body:
                for item in anc.items:
                    mode = self._grad_mode(item.context_expr)
                    if mode is not None:
                        return mode == "off"
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for deco in anc.decorator_list:
                    mode = self._grad_mode(deco)
                    if mode is not None:
                        return mode == "off"
                if inside and self._grad_disabled_before(anc, node):
                    return True
                inside = False
            child = anc
        return inside and self._grad_disabled_before(self.tree, node)

    def _grad_disabled_before(self, scope: ast.AST, node: ast.AST) -> bool:
        state = None
        for stmt in walk_local(scope):
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and pos(stmt) < pos(node):
                q = self.qualname(stmt.value.func)
                if q == "torch.set_grad_enabled":
                    state = self._grad_mode(stmt.value)
        return state == "off"

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
        for call in self.calls_in(scope):
            q = self.qualname(call.func)
            if is_backward(call):
                exprs = [call.func.value]
            elif q in ("torch.autograd.backward", "torch.autograd.grad"):
                exprs = list(call.args[:1])
            else:
                continue
            for expr in exprs:
                for n in [expr, *ast.walk(expr)]:
                    if isinstance(n, ast.Name):
                        if n.id == name:
                            return True
                        value = self.binding_value(n)
                        if value is not None and any(isinstance(v, ast.Name) and v.id == name for v in ast.walk(value)):
                            return True
        return False


def forward_before(f: FileAnalysis, node: ast.AST) -> bool:
    """A module or loss is called before ``node`` in its function's frame (a graph may exist): a module
    of this file or torch.nn, or a callable passed in as a parameter (a model given to a train step)."""
    here = pos(node)
    for c in f.calls_in(f.function_scope(node)):
        if pos(c) >= here:
            return False
        k = f.kind(c.func)
        if k is not None and (k.cat in ("module", "lossfn") or (k.cat == "self" and f.is_module_class(k.ref))):
            return True
        b = f.lookup(c.func) if isinstance(c.func, ast.Name) else None
        if b is not None and b[1] == "param":
            return True
    return False


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
    for n in ast.walk(test):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod):
            return True
        if isinstance(n, (ast.Name, ast.Attribute)) and "memory" in (dotted(n) or "").rsplit(".", 1)[-1]:
            return True
    return False


def is_backward(node: ast.AST) -> bool:
    """``x.backward(...)``: a call of a method named backward (a loss's, a tensor's)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"


def is_step_loop(f: FileAnalysis, loop: ast.AST) -> bool:
    """A loop whose iterations are training steps: it iterates a loader, or its own body
    (not a nested loop) calls backward() or optimizer.step()."""
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        if element_is_batch(f, loop):
            return True
    for node in walk_local(loop, into_loops=False):
        if is_backward(node):
            return True
    return False


def unwrap_iterable(f: FileAnalysis, it: ast.AST) -> ast.AST:
    """``loader`` for ``enumerate(loader)``, ``tqdm(loader)``, ``iter(loader)``."""
    while isinstance(it, ast.Call) and it.args and (
            (isinstance(it.func, ast.Name) and it.func.id in ("enumerate", "tqdm", "iter"))
            or f.qualname(it.func) in TQDM):
        it = it.args[0]
    return it


def element_is_batch(f: FileAnalysis, loop: ast.AST) -> bool:
    it = loop.iter
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
    def compat_test(test: ast.AST) -> bool:
        for n in ast.walk(test):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr"):
                return True
            name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else ""
            if "version" in name.lower():
                return True
        return False

    child = node
    for anc in f.ancestors(node):
        if isinstance(anc, (ast.If, ast.IfExp)) and child is not anc.test and compat_test(anc.test):
            return True
        if isinstance(anc, ast.Try) and child in anc.body and any(catches_compat(h) for h in anc.handlers):
            return True
        if isinstance(anc, ast.ExceptHandler) and catches_compat(anc):
            return True  # the fallback after the new spelling failed
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            break
        child = anc
    return False


def dataloaders(f: FileAnalysis) -> list[tuple[ast.Call, list[ast.AST]]]:
    """Every DataLoader(...) call with the loops that iterate it: by the loader object the
    loop's iterable is known to be, or by the same variable / attribute name."""
    if "loaders" in f.memo:
        return f.memo["loaders"]
    loops = f.nodes[ast.For] + f.nodes[ast.AsyncFor]
    out = []
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) != DATALOADER:
            continue
        parent = f.parent.get(call)
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target] if isinstance(
            parent, ast.AnnAssign) else []
        names = {dotted(t) for t in targets} - {None}
        found = []
        for loop in loops:
            it = unwrap_iterable(f, loop.iter)
            k = f.kind(it)
            if it is call or (k is not None and k.cat == "loader" and k.ref is call) or dotted(it) in names:
                found.append(loop)
        out.append((call, found))
    f.memo["loaders"] = out
    return out


def moves_batch_to_cuda(f: FileAnalysis, loop: ast.AST) -> bool:
    batch = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    for node in walk_local(loop):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and root_name(node.func.value) in batch):
            continue
        if node.func.attr == "cuda":
            return True
        if node.func.attr == "to":
            device = kwarg(node, "device", 0)
            if device is not None and is_cuda_device(f, device):
                return True
    return False


def is_cuda_device(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` names a CUDA device: a ``"cuda..."`` string (directly or in the expression
    the variable was assigned), or, when its value is not in the file, a variable called
    ``device``/``gpu``/``cuda`` in a file that uses CUDA."""
    value = f.binding_value(node) if isinstance(node, ast.Name) else None
    strings = [n.value for n in ast.walk(value if value is not None else node)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if strings:
        return any(s.startswith("cuda") for s in strings)
    spelled = dotted(node)
    return (spelled is not None and f.mentions_cuda
            and re.search(r"device|dev$|gpu|cuda", spelled.rsplit(".", 1)[-1], re.IGNORECASE) is not None)


def optimizer_step(f: FileAnalysis, call: ast.Call) -> bool:
    """``optimizer.step()`` or ``scaler.step(optimizer)``."""
    k = f.kind(call.func.value)
    if k is not None and k.cat == "optimizer":
        return True
    return bool(call.args) and (f.kind(call.args[0]) or Kind("?")).cat == "optimizer"


def ancestors_until(f: FileAnalysis, node: ast.AST, stop: ast.AST) -> Iterator[ast.AST]:
    for anc in f.ancestors(node):
        if anc is stop:
            return
        yield anc


def looks_like_model(f: FileAnalysis, node: ast.AST) -> bool:
    k = f.kind(node)
    if k is not None:
        return k.cat == "module" or (k.cat == "self" and f.is_module_class(k.ref))
    b = f.lookup(node) if isinstance(node, ast.Name) else None  # a model passed in, or a name that says so
    return (b is not None and b[1] == "param") or (isinstance(node, ast.Name) and "model" in node.id.lower())


# ---- evidence for the step rules (TT126-TT132)


def _branch_label(anc: ast.AST, child: ast.AST) -> object:
    """Which branch of the ``if``/``try`` ``anc`` holds ``child``: "body", "orelse", a handler;
    "test" or "final" for parts that run whichever branch is taken."""
    if isinstance(anc, (ast.If, ast.IfExp)):
        if child is anc.test:
            return "test"
        if child is anc.body or (isinstance(anc.body, list) and child in anc.body):
            return "body"
        return "orelse"
    if child in anc.finalbody:
        return "final"
    if child in anc.handlers:
        return anc.handlers.index(child)
    return "body"  # the try body and its else run together


def exclusive_branches(f: FileAnalysis, a: ast.AST, b: ast.AST) -> bool:
    """``a`` and ``b`` never run in the same pass: they lie in different branches of one ``if``
    (or conditional expression), or in a ``try`` body and one of its handlers (or two handlers)."""
    def labels(node: ast.AST) -> dict:
        out, child = {}, node
        for anc in f.ancestors(node):
            if isinstance(anc, (ast.If, ast.IfExp, ast.Try, getattr(ast, "TryStar", ast.Try))):
                out[anc] = _branch_label(anc, child)
            child = anc
        return out

    la, lb = labels(a), labels(b)
    return any(anc in lb and label not in ("test", "final") and lb[anc] not in ("test", "final") and label != lb[anc]
               for anc, label in la.items())


_PARAMETER_METHODS = {"parameters": "params", "buffers": "params", "named_parameters": "named_params",
                      "named_buffers": "named_params"}


def _element_of(k: Kind, path: tuple) -> Kind | None:
    """The kind of the element at ``path`` of one item of an iterable of kind ``k``."""
    if k.cat == "loader":
        if path or (isinstance(k.ref, ast.Call) and kwarg(k.ref, "collate_fn", 6) is None):
            return BATCH  # an element of a batch, or a default-collated batch: tensors
        return Kind("batch")  # a whole batch from a custom collate: maybe an object with an in-place .to()
    if k.cat == "params":
        return PARAM if not path else None
    if k.cat == "named_params":
        return PARAM if path == (1,) else None
    if k.cat == "tensor" and not path:
        return TENSOR
    return None


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


def _library_object_kind(q: str, node: ast.Call) -> Kind | None:
    """The kind of a data loader, device, optimizer, scheduler or torchvision model built by ``q(...)``."""
    last = q.rsplit(".", 1)[-1]
    if q == DATALOADER:
        return Kind("loader", q, node)
    if q == "torch.device":
        return Kind("device", None, node)
    if q.startswith("torch.optim.") and q.count(".") == 2 and last[:1].isupper():
        return Kind("optimizer", q, node)
    if q.startswith("torch.optim.lr_scheduler.") and last[:1].isupper():
        return Kind("scheduler", q, node)
    if q.startswith("torchvision.models.") and last[:1].islower():
        return Kind("module", q, node)
    return None


def _tensor_function_kind(q: str) -> Kind | None:
    """The kind of what a torch function ``q`` returns when it is a tensor (an expanded one for
    ``broadcast_to``)."""
    last = q.rsplit(".", 1)[-1]
    if q == "torch.broadcast_to":
        return Kind("tensor", "expanded")
    if (q.startswith("torch.") and q.count(".") == 1 and last in TENSOR_FUNCS) or \
            q.startswith(("torch.linalg.", "torch.fft.", "torch.special.")):
        return TENSOR
    return None
