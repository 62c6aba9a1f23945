"""A backbone frozen with ``requires_grad = False`` but never put in eval mode, while the model around it trains:
its BatchNorm layers keep normalising with each batch's statistics and overwriting their running ones, so the
"frozen" features drift (the runtime doctor's TT216 finds the same on the live model).
"""

from __future__ import annotations

import ast
from typing import Iterator

from torch_tricks.doctor.analysis import FileAnalysis, called_method, dotted, is_backward, is_false, kwarg
from torch_tricks.doctor.registry import StaticRule, static_rule

# torchvision families built with BatchNorm (their plain-named constructors); vgg only as *_bn
_BN_FAMILIES = ("resnet", "resnext", "wide_resnet", "densenet", "mobilenet", "efficientnet", "regnet", "inception",
                "googlenet", "mnasnet", "shufflenet")


@static_rule
class FrozenInTrainMode(StaticRule):
    id = "TT138"
    name = "frozen-backbone-in-train-mode"
    severity = "warning"
    source = "X (frozen modules); T10; seeds/001 基本操作 check list (用 eval(): a module's mode is set by eval())"
    message = ("a BatchNorm backbone is frozen with requires_grad = False but never put in eval(): while the model "
               "trains, its BatchNorm statistics keep changing")
    explanation = ("requires_grad = False stops a module's weights, not its BatchNorm running statistics: in train "
                   "mode (model.train() sets every submodule) each forward normalises with the batch's statistics "
                   "and moves the running ones toward the new data, so the frozen features drift from those the "
                   "backbone was trained with. Fix: backbone.eval() after every model.train() (or override train() "
                   "to keep it in eval). Reported where the file freezes a module it built with BatchNorm (a "
                   "torchvision ResNet, DenseNet, MobileNet, EfficientNet ..., a *_bn VGG, or a class of the file "
                   "with a BatchNorm layer), trains (a backward), and never calls eval() on it.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        if not any(is_backward(n) for n in f.nodes[ast.Call]):
            return
        # by the last part of the name: `backbone` frozen, then `model.backbone.eval()`
        evaluated = {(dotted(c.func.value) or "").rsplit(".", 1)[-1] for c in f.nodes[ast.Call]
                     if called_method(c) == "eval"}
        for node, name in freezings(f):
            if name.rsplit(".", 1)[-1] in evaluated or not _has_batchnorm(f, name):
                continue
            yield node, (f"`{name}` is frozen (requires_grad = False) but never put in eval(): while the model "
                         f"trains, its BatchNorm statistics keep changing; call {name}.eval() after model.train()")


def freezings(f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
    """(statement, module) for ``for p in m.parameters(): p.requires_grad = False`` and ``m.requires_grad_(False)``."""
    for loop in f.nodes[ast.For]:
        it = loop.iter
        if (called_method(it) == "parameters" and isinstance(loop.target, ast.Name)
                and any(_sets_requires_grad_false(s, loop.target.id) for s in loop.body)):
            name = dotted(it.func.value)
            if name:
                yield loop, name
    for call in f.nodes[ast.Call]:
        if called_method(call) == "requires_grad_" and is_false(kwarg(call, "requires_grad", 0)):
            name = dotted(call.func.value)
            if name:
                yield call, name


def _sets_requires_grad_false(stmt: ast.AST, var: str) -> bool:
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
            and stmt.targets[0].attr == "requires_grad" and dotted(stmt.targets[0].value) == var
            and is_false(stmt.value))


def _has_batchnorm(f: FileAnalysis, name: str) -> bool:
    """The module ``name`` was built (in this file) by a torchvision family with BatchNorm, or by a class of this
    file that creates a BatchNorm layer."""
    value = _built_from(f, name)
    if not isinstance(value, ast.Call):
        return False
    q = f.qualname(value.func) or ""
    model = q.rsplit(".", 1)[-1]
    if q.startswith("torchvision.models."):
        return model.startswith(_BN_FAMILIES) or model.endswith("_bn")
    cls = next((c for c in f.nodes[ast.ClassDef] if isinstance(value.func, ast.Name) and c.name == value.func.id), None)
    return cls is not None and any((f.qualname(n.func) or "").startswith("torch.nn.BatchNorm")
                                   for n in ast.walk(cls) if isinstance(n, ast.Call))


def _built_from(f: FileAnalysis, name: str) -> ast.AST | None:
    """The value last assigned to the variable or attribute ``name`` (``backbone = resnet50(...)``,
    ``self.backbone = ...``), through ``.to(...)`` / ``.cuda()``."""
    found = None
    for node in f.nodes[ast.Assign]:
        if any(dotted(t) == name for t in node.targets):
            found = node.value
    while isinstance(found, ast.Call) and called_method(found) in ("to", "cuda", "train"):
        found = found.func.value
    return found
