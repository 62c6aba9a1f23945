"""A pretrained network used inside a loss (a perceptual or feature-matching loss on VGG features) and left
trainable: every backward also computes gradients for its weights, which nothing uses (and which pile up in
``.grad``, since no optimizer of the run zeroes them); where the loss network is a submodule of the model,
``model.parameters()`` hands it to the optimizer, which then trains the loss to be small.
"""

from __future__ import annotations

import ast
import re
from typing import Iterator

from torch_tricks.doctor.analysis import FileAnalysis, called_method, dotted, is_backward, is_false, is_loss, kwarg
from torch_tricks.doctor.registry import StaticRule, static_rule
from torch_tricks.doctor.rules.frozen import freezings

_LOSS_CLASS = re.compile(r"loss|perceptual", re.IGNORECASE)
# what may be done to a loss network without training or freezing it
_HARMLESS = frozenset({"eval", "cuda", "to", "cpu", "half", "float", "load_state_dict"})
_MOVES = ("to", "cuda", "cpu", "eval", "half", "float")


@static_rule
class TrainableLossNetwork(StaticRule):
    id = "TT139"
    name = "trainable-loss-network"
    severity = "warning"
    source = "X (frozen modules); T10 (requires_grad = False on what is not trained)"
    message = ("a pretrained network computes a loss but is never frozen: each backward also computes gradients "
               "for its weights")
    explanation = ("A perceptual or feature-matching loss compares features of a fixed, pretrained network "
                   "(VGG ...). Its input needs a gradient; its weights do not. Left with requires_grad = True, "
                   "every backward also computes the weights' gradients (the weight half of the network's "
                   "backward, and a .grad as large as the network that no optimizer of the run zeroes, so it "
                   "keeps growing); where the network is a submodule of the trained model, model.parameters() "
                   "gives it to the optimizer, which then changes the features to make the loss small. Fix: "
                   "net.requires_grad_(False) where it is built (the gradient still reaches the input). "
                   "Reported for a class named *Loss / *Perceptual* that keeps a torchvision network built with "
                   "pretrained weights and never sets requires_grad, and for a loss whose two inputs are outputs "
                   "of the same network whose parameters the file neither freezes nor gives to an optimizer.")

    def check(self, f: FileAnalysis) -> Iterator[tuple[ast.AST, str]]:
        frozen = {name.rsplit(".", 1)[-1] for _, name in freezings(f)}
        yield from _loss_classes(f, frozen)
        if any(is_backward(n) for n in f.nodes[ast.Call]):
            yield from _compared_features(f, frozen)


def _loss_classes(f: FileAnalysis, frozen: set[str]) -> Iterator[tuple[ast.AST, str]]:
    """``self.net = vgg19(weights=...).features`` in a loss class that never touches requires_grad."""
    for cls in f.nodes[ast.ClassDef]:
        if not (_LOSS_CLASS.search(cls.name) and f.is_module_class(cls)) or _sets_requires_grad(cls):
            continue
        if frozen & ({cls.name} | _instances(f, cls.name)):
            continue
        for node in ast.walk(cls):
            net = _pretrained_attribute(f, node)
            if net is not None and net[0] not in frozen:
                yield node, (f"`self.{net[0]}` ({net[1]}, pretrained) computes the loss {cls.name} but is never "
                             f"frozen: each backward also computes gradients for its weights; call "
                             f"self.{net[0]}.requires_grad_(False) where it is built")


def _compared_features(f: FileAnalysis, frozen: set[str]) -> Iterator[tuple[ast.AST, str]]:
    """``loss(net(a), net(b).detach())`` with ``net`` a module the file neither freezes nor optimizes."""
    for call in f.nodes[ast.Call]:
        if len(call.args) < 2 or not _is_loss_call(f, call):
            continue
        first, second = (_network_call(f, a) for a in call.args[:2])
        if first is None or second is None or first[0] != second[0] or first[0] in frozen:
            continue
        net = first[0]
        grad = [c for c, detached in (first[1:], second[1:]) if not detached and not f.no_grad(c)]
        if grad and _constructed_module(f, grad[0].func) and _only_called(f, net):
            yield call, (f"`{net}` gives both inputs of this loss but its parameters are never frozen (nor "
                         f"optimized): each backward also computes gradients for its weights; call "
                         f"{net}.requires_grad_(False) where it is built")


def _sets_requires_grad(cls: ast.ClassDef) -> bool:
    """The class sets (or reads) requires_grad anywhere: it decides about freezing itself."""
    return any((isinstance(n, ast.Attribute) and n.attr in ("requires_grad", "requires_grad_"))
               or (isinstance(n, ast.keyword) and n.arg == "requires_grad") for n in ast.walk(cls))


def _instances(f: FileAnalysis, cls_name: str) -> set[str]:
    """The last part of every name or attribute assigned ``cls_name(...)``."""
    return {(dotted(t) or "").rsplit(".", 1)[-1] for node in f.nodes[ast.Assign]
            if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
            and node.value.func.id == cls_name for t in node.targets}


def _pretrained_attribute(f: FileAnalysis, node: ast.AST) -> tuple[str, str] | None:
    """(attribute, torchvision model) for ``self.attr = <expression built on a pretrained torchvision model>``."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
            and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == "self"):
        return None
    model = _pretrained_model(f, node.value)
    return (node.targets[0].attr, model) if model is not None else None


def _pretrained_model(f: FileAnalysis, expr: ast.AST, depth: int = 0) -> str | None:
    """The torchvision model built with pretrained weights that ``expr`` is built on (through the variables it
    reads, two assignments deep)."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Call) and _is_pretrained(f, n):
            return f.qualname(n.func).rsplit(".", 1)[-1]
        if isinstance(n, ast.Name) and depth < 2:
            value = f.binding_value(n)
            found = _pretrained_model(f, value, depth + 1) if value is not None else None
            if found is not None:
                return found
    return None


def _is_pretrained(f: FileAnalysis, call: ast.Call) -> bool:
    """``torchvision.models.<model>(pretrained=True)`` / ``(weights=<not None>)`` / ``(True)``."""
    if not (f.qualname(call.func) or "").startswith("torchvision.models."):
        return False
    weights = kwarg(call, "weights")
    pretrained = kwarg(call, "pretrained", 0)
    if weights is not None:
        return not (isinstance(weights, ast.Constant) and weights.value is None)
    return pretrained is not None and not is_false(pretrained) and not (
        isinstance(pretrained, ast.Constant) and pretrained.value is None)


def _is_loss_call(f: FileAnalysis, call: ast.Call) -> bool:
    q = f.qualname(call.func)
    if q is None:
        k = f.kind(call.func)
        return k is not None and k.cat == "lossfn"
    return is_loss(q)


def _network_call(f: FileAnalysis, arg: ast.AST, depth: int = 0) -> tuple[str, ast.Call, bool] | None:
    """(network, its call, detached) for a loss input ``net(x)``, ``net(x).detach()`` or a variable assigned
    one of them."""
    detached = False
    if called_method(arg) == "detach":
        arg, detached = arg.func.value, True
    if isinstance(arg, ast.Name) and depth < 2:
        value = f.binding_value(arg)
        found = _network_call(f, value, depth + 1) if value is not None else None
        return (found[0], found[1], found[2] or detached) if found is not None else None
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name) and arg.args:
        return arg.func.id, arg, detached
    return None


def _constructed_module(f: FileAnalysis, func: ast.Name) -> bool:
    """``func`` names an object built by calling a class or a torchvision model (``FeatureExtractor()``,
    ``vgg16(weights=...).features``), maybe moved (``.cuda()``): not a function or a loss."""
    k = f.kind(func)
    if k is not None and k.cat in ("lossfn", "func", "class"):
        return False
    value = f.binding_value(func)
    while isinstance(value, ast.Call) and called_method(value) in _MOVES:
        inner = value.func.value
        value = f.binding_value(inner) if isinstance(inner, ast.Name) and inner.id == func.id else inner
    if isinstance(value, ast.Attribute):  # vgg16(...).features
        value = value.value
    if not isinstance(value, ast.Call):
        return False
    q = f.qualname(value.func) or ""
    name = dotted(value.func) or ""
    return q.startswith("torchvision.models.") or name.rsplit(".", 1)[-1][:1].isupper()


def _only_called(f: FileAnalysis, net: str) -> bool:
    """The file only calls ``net``, moves it or loads weights into it: no ``net.parameters()`` (to an optimizer),
    and ``net`` is not handed to anything (a container, a model that may train it)."""
    for node in f.nodes[ast.Name]:
        if node.id != net or isinstance(node.ctx, ast.Store):
            continue
        parent = f.parent.get(node)
        if isinstance(parent, ast.Call) and parent.func is node:
            continue
        if isinstance(parent, ast.Attribute) and parent.attr in _HARMLESS:
            continue
        return False
    return True
