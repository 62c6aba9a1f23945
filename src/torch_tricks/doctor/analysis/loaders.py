"""DataLoaders and the batches they feed: which loops read each loader, and what goes to CUDA.

:func:`dataloaders` pairs each ``DataLoader(...)`` of the file with the loops that iterate it
(directly, through a variable or attribute, through ``zip``/``itertools``); :func:`moves_batch_to_cuda`
and :func:`is_cuda_device` tell whether a loop moves its batch to a CUDA device. The loader rules
(pinned memory, workers, ``set_epoch``) ask them.
"""

from __future__ import annotations

import ast
import re

from torch_tricks.doctor.analysis.file import FileAnalysis
from torch_tricks.doctor.analysis.kind import _category
from torch_tricks.doctor.analysis.loops import unwrap_iterable
from torch_tricks.doctor.analysis.syntax import _called_function, called_method, dotted, kwarg, root_name, walk_local
from torch_tricks.doctor.analysis.vocab import DATALOADER


def dataloaders(f: FileAnalysis) -> list[tuple[ast.Call, list[ast.AST]]]:
    """Every DataLoader(...) call with the loops that iterate it: by the loader object the
    loop's iterable is known to be, or by the same variable / attribute name."""
    if "loaders" not in f.memo:
        f.memo["loaders"] = _find_dataloaders(f)
    return f.memo["loaders"]


def moves_batch_to_cuda(f: FileAnalysis, loop: ast.AST) -> bool:
    batch = _names_in(loop.target)
    return any(root_name(node.func.value) in batch and _moves_to_cuda(f, node)
               for node in walk_local(loop) if called_method(node) in ("cuda", "to"))


def is_cuda_device(f: FileAnalysis, node: ast.AST) -> bool:
    """``node`` names a CUDA device: a ``"cuda..."`` string (directly or in the expression
    the variable was assigned), or, when its value is not in the file, a variable called
    ``device``/``gpu``/``cuda`` in a file that uses CUDA."""
    value = f.binding_value(node)
    strings = _strings_in(value if value is not None else node)
    if strings:
        return any(s.startswith("cuda") for s in strings)
    return _named_like_device(f, node)


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


def _names_in(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _moves_to_cuda(f: FileAnalysis, call: ast.Call) -> bool:
    """``x.cuda()``, or ``x.to(device)`` with a CUDA device."""
    if call.func.attr == "cuda":
        return True
    device = kwarg(call, "device", 0)
    return device is not None and is_cuda_device(f, device)


_DEVICE_NAME = re.compile(r"device|dev$|gpu|cuda", re.IGNORECASE)


def _named_like_device(f: FileAnalysis, node: ast.AST) -> bool:
    """A variable or attribute called ``device``/``gpu``/``cuda`` ... in a file that uses CUDA."""
    spelled = dotted(node)
    return spelled is not None and f.mentions_cuda and _DEVICE_NAME.search(spelled.rsplit(".", 1)[-1]) is not None


def _strings_in(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
