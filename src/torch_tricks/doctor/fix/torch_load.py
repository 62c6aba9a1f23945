"""TT110 / TT111 ``torch.load`` without ``map_location`` / ``weights_only``: add
``map_location="cpu"`` / ``weights_only=True`` (both in one edit when both are missing). Not
``map_location`` when ``*args`` may already pass it. ``weights_only=True`` only where the file
shows that what the load reads is tensors or state_dicts (a ``torch.save`` of a state_dict, a
tensor, or a dict of them and numbers to the same path or buffer; or the result handed to
``load_state_dict``: :func:`~torch_tricks.doctor.rules.serialization.loaded_checkpoint`): a
whole pickled module or another object fails to load with it, and a file of unknown contents
may (the default since torch 2.6 refuses them too; the finding says what to pass instead). Not
when a ``pickle_module`` is given (torch refuses the pair). Loaded tensors then land on the CPU.
"""

from __future__ import annotations

import ast

from torch_tricks.doctor import Finding
from torch_tricks.doctor.analysis import dotted
from torch_tricks.doctor.fix.base import _Fix, _NotFixable
from torch_tricks.doctor.fix.doc import _Doc
from torch_tricks.doctor.fix.edits import _insertion, _kw, _value
from torch_tricks.doctor.rules.serialization import MODULE, OBJECT, WEIGHTS, Checkpoint, loaded_checkpoint


_LOAD_RULES = ("TT110", "TT111")


def _group_loads(doc: _Doc, findings: list[Finding]) -> tuple[dict[int, tuple[ast.Call, list[Finding]]],
                                                                 dict[int, str]]:
    """The ``torch.load`` findings grouped by the call they are about (one edit fixes both), and
    the reasons of those with no call at their position."""
    loads: dict[int, tuple[ast.Call, list[Finding]]] = {}
    reasons = {}
    for f in findings:
        if f.rule not in _LOAD_RULES:
            continue
        call = doc.call_at(f)
        if call is None:
            reasons[id(f)] = "not fixable here: no call to rewrite at this position"
        else:
            loads.setdefault(id(call), (call, []))[1].append(f)
    return loads, reasons


def _plan_loads(doc: _Doc, loads: dict[int, tuple[ast.Call, list[Finding]]]) -> tuple[list[_Fix], dict[int, str]]:
    """The fix of each ``torch.load`` call, and why its findings that are not fixed are not."""
    fixes, reasons = [], {}
    for call, group in loads.values():
        fix, why = _fix_load(doc, call, group)
        if fix is not None:
            fixes.append(fix)
        reasons.update({id(f): f"not fixable here: {why[f.rule]}" for f in group if f.rule in why})
    return fixes, reasons


def _fix_load(doc: _Doc, call: ast.Call, group: list[Finding]) -> tuple[_Fix | None, dict[str, str]]:
    """One edit adding what ``call`` lacks (``map_location``, ``weights_only`` or both), and the
    rules it cannot fix there, with why."""
    rules = {f.rule for f in group}
    add, why = _load_additions(doc, call, rules)
    if not add:
        return None, why
    text = ", ".join(f"{k}={v}" for _, k, v in add)
    try:
        edit = _insertion(doc, call, text)
    except _NotFixable as exc:
        return None, {r: str(exc) for r in rules}

    def mutate(m: dict) -> None:
        m[id(call)].keywords.extend(ast.keyword(arg=k, value=_value(v)) for _, k, v in add)
    return _Fix(tuple(r for r, _, _ in add), call.lineno, f"{dotted(call.func)}(...): added {text}", [edit],
                mutate), why


def _load_additions(doc: _Doc, call: ast.Call, rules: set[str]) -> tuple[list[tuple[str, str, str]],
                                                                          dict[str, str]]:
    """(rule, keyword, value) to add to the ``torch.load`` ``call`` for each of ``rules`` it can fix, and
    why it cannot fix the others."""
    add, why = [], {}
    for rule, keyword, value, blocker in _LOAD_FIXES:
        if rule not in rules:
            continue
        reason = blocker(doc, call)
        if reason is not None:
            why[rule] = reason
        else:
            add.append((rule, keyword, value))
    return add, why


def _map_location_blocker(doc: _Doc, call: ast.Call) -> str | None:
    """Why ``map_location`` cannot be added to this ``torch.load`` call; None if it can."""
    if any(isinstance(a, ast.Starred) for a in call.args) or _kw(call, "map_location") or len(call.args) > 1:
        return "*args may already pass map_location"
    return None


def _weights_only_blocker(doc: _Doc, call: ast.Call) -> str | None:
    """Why ``weights_only=True`` cannot be added to this ``torch.load`` call; None if it can: the file
    shows that the call reads tensors or state_dicts."""
    if _custom_pickle(call):
        return "a pickle_module is given, which weights_only=True refuses"
    if _kw(call, "weights_only") or any(k.arg is None for k in call.keywords):
        return "**kwargs may already pass weights_only"
    return _checkpoint_blocker(loaded_checkpoint(doc.analysis(), call))


def _checkpoint_blocker(c: Checkpoint) -> str | None:
    """Why ``weights_only=True`` may break a load of ``c``; None for tensors and state_dicts."""
    if c.holds == WEIGHTS:
        return None
    if c.holds == MODULE:
        return (f"it loads a whole pickled module ({c.saved} saved on line {c.line}), which weights_only=True "
                f"refuses: pass weights_only=False for a trusted file, or save {c.saved}.state_dict()")
    if c.holds == OBJECT:
        return (f"what torch.save stores on line {c.line} ({c.saved}) is not shown to be only tensors/state_dicts, "
                f"which weights_only=True needs")
    return ("the file does not show what the checkpoint holds (no torch.save to it here, no load_state_dict of "
            "the result), and weights_only=True refuses pickled objects: check it and pass weights_only by hand")


def _custom_pickle(call: ast.Call) -> bool:
    """The ``torch.load`` ``call`` passes a ``pickle_module`` (other than None)."""
    pickle = _pickle_module(call)
    return pickle is not None and not (isinstance(pickle, ast.Constant) and pickle.value is None)


def _pickle_module(call: ast.Call) -> ast.AST | None:
    """The ``pickle_module`` argument of a ``torch.load`` call (the third positional one)."""
    pickle = _kw(call, "pickle_module")
    if pickle is not None:
        return pickle.value
    return call.args[2] if len(call.args) > 2 else None


#: (rule, the keyword its fix adds to torch.load, the value, why it may not be added there)
_LOAD_FIXES = (("TT110", "map_location", '"cpu"', _map_location_blocker),
               ("TT111", "weights_only", "True", _weights_only_blocker))
