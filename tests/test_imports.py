"""The package's import graph, read with ast (nothing imported): no circles among the modules (an
import inside a function counts: it is a circle of design that runs later), no top-level module
importing a package that imports it back, no feature package importing another's private name, and
``data`` below ``train``."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import torch_tricks

ROOT = Path(torch_tricks.__file__).parent


@functools.cache  # the tests below read the same files: parsed once
def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("torch_tricks",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@functools.cache
def _imports(path: Path) -> list[tuple[str, str | None, bool]]:
    """(imported module, imported name or None, at module level) for each import of our own modules."""
    modules = _modules()
    tree = _tree(path)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        top = id(node) not in in_function
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch_tricks"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub, None, top) if sub in modules else (node.module, alias.name, top))
        elif isinstance(node, ast.Import):
            out += [(a.name, None, top) for a in node.names if a.name.startswith("torch_tricks")]
    return out


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function."""
    return {m: {t for t, _, _ in _imports(p) if t in modules and t != m} for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk of ``graph`` meets, each from its first module back to it."""
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def _climbs(graph: dict[str, set[str]], top_level: set[str]) -> list[tuple[str, str]]:
    """(top-level module, the module it imports) where a module of that one's package imports it back."""
    users: dict[str, set[str]] = {}  # package -> the top-level modules its modules import
    for m, targets in graph.items():
        if m not in top_level:
            users.setdefault(_package(m), set()).update(targets & top_level)
    return sorted((m, t) for m in top_level for t in graph[m]
                  if t not in top_level and m in users.get(_package(t), set()))


def _is_top_level(module: str) -> bool:
    """A module of the top level (``torch_tricks.batches``), not a package's nor the package itself."""
    return module.count(".") == 1 and _modules()[module].name != "__init__.py"


def test_no_import_circles():
    """Imports inside functions count too: the one the advisor and the summary once had ran only when a
    summary printed its advice, yet each module needed the other."""
    assert _cycles(_graph(_modules())) == []


def test_no_top_level_module_imports_a_package_that_imports_it():
    """The top level is the lowest floor: a top-level module that imports ``train.speed`` while ``train.loop``
    imports it is a circle between floors, even where no two modules import each other."""
    modules = _modules()
    assert _climbs(_graph(modules), {m for m in modules if _is_top_level(m)}) == []


def test_the_checks_fail_on_a_planted_circle_and_climb():
    """The two checks above on made-up graphs: a circle through any import, a top-level module
    importing a package one of whose other modules imports it."""
    assert _cycles({"t.a.x": {"t.a.y"}, "t.a.y": {"t.a.x"}, "t.b": set()}) == [["t.a.x", "t.a.y", "t.a.x"]]
    climb = {"t.low": {"t.pkg.speed"}, "t.pkg.speed": set(), "t.pkg.loop": {"t.low"}}
    assert _cycles(climb) == [] and _climbs(climb, {"t.low"}) == [("t.low", "t.pkg.speed")]
    assert _climbs({**climb, "t.pkg.loop": set()}, {"t.low"}) == []


def test_no_feature_package_imports_a_private_name_of_another():
    modules = _modules()
    bad = [(m, t, name) for m, p in modules.items() for t, name, _ in _imports(p)
           if name and name.startswith("_") and not name.startswith("__") and _package(t) != _package(m)]
    assert bad == []


def test_data_does_not_import_train():
    modules = _modules()
    bad = [(m, t) for m, p in modules.items() if _package(m) == "data"
           for t, _, _ in _imports(p) if _package(t) == "train"]
    assert bad == []


def test_every_name_imported_from_the_package_exists():
    """An import inside a function runs only when the function does: a name moved or renamed in a
    refactor would surface there as an ImportError at run time (a tune's ranks failed so). Every
    ``from torch_tricks.X import name`` in the package, the tests and the benchmarks must resolve."""
    import importlib

    here = ROOT.parent.parent
    files = [*ROOT.rglob("*.py"), *(here / "tests").glob("**/*.py"), *(here / "benchmarks").glob("*.py")]
    missing = []
    for path in files:
        if "doctor_corpus" in path.parts or not path.is_file():
            continue
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0
                    and (node.module or "").startswith("torch_tricks")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, missing
