"""The package's import graph, read with ast (nothing imported): no circles among the modules at
import time, no feature package importing another's private name, and ``data`` below ``train``."""

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


def test_no_import_circles_at_module_level():
    """Imports inside functions (optional dependencies, the CLI's start-up) are left out: they run later."""
    modules = _modules()
    graph = {m: {t for t, _, top in _imports(p) if top and t in modules} for m, p in modules.items()}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    assert cycles == []


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
