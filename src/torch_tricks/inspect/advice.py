"""One piece of design advice, its folding into patterns and its printing (what ``torch-tricks summary``
shows under the table).

Apart from :mod:`torch_tricks.inspect.advisor`, whose rules make the advice from a summary (and which
re-exports these names): the summary prints advice, so the two modules needed each other while this
lived in the advisor.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Advice", "group_advice", "advice_text"]


@dataclass
class Advice:
    """One finding of a rule on a module (or, after :func:`group_advice`, on a pattern of modules)."""

    rule: str  # G1..G4, T23
    severity: str  # "info" | "warn"
    module: str  # a module name; for a group, the pattern ("encoder.layer.*.attention")
    message: str
    count: int = 1  # modules this line stands for (group_advice)
    modules: list[str] = field(default_factory=list)  # for a group: the first few module names

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def group_advice(advice: list[Advice], keep: int = 3) -> list[Advice]:
    """One line per pattern: advice of the same rule, severity and message (numbers aside) on
    modules whose names differ only in their indices is folded into one :class:`Advice` whose
    ``module`` is the pattern (``encoder.layer.*.attention``), with ``count`` and the first
    ``keep`` module names; the first one's message stands for all. Order is kept."""
    groups: dict[tuple, Advice] = {}
    for a in advice:
        pattern = _module_pattern(a.module)
        key = (a.rule, a.severity, pattern, _NUMBER.sub("#", a.message))
        g = groups.get(key)
        if g is None:
            groups[key] = Advice(a.rule, a.severity, a.module, a.message, 1, [a.module])
        else:
            g.count += 1
            g.module = pattern
            if len(g.modules) < keep:
                g.modules.append(a.module)
    return list(groups.values())


def advice_text(advice: list[Advice], grouped: list[Advice] | None = None, shown_at_most: int = 12) -> str:
    """The advice lines ``torch-tricks summary`` prints: a heading, then one line per pattern of
    ``grouped`` (default: :func:`group_advice` of ``advice``) with its modules counted, the first
    ``shown_at_most`` of them, so a 12-layer model does not print 12 copies. Empty for no advice."""
    if not advice:
        return ""
    if grouped is None:
        grouped = group_advice(advice)
    shown = grouped[:shown_at_most]
    lines = [f"advice ({len(advice)} in {len(grouped)} pattern(s); ShuffleNetV2 G1-G4, tensor-core dims T23):"]
    lines += [_advice_line(a) for a in shown]
    if len(grouped) > len(shown):
        lines.append(f"  ... {len(grouped) - len(shown)} more (use --json for all)")
    return "\n".join(lines)


def _advice_line(a: Advice) -> str:
    where = ""
    if a.count > 1:
        where = f" (x{a.count}: {', '.join(a.modules)}{', ...' if a.count > len(a.modules) else ''})"
    return f"  [{a.rule} {a.severity}] {a.module}{where}: {a.message}"


_INDEX = re.compile(r"(?:(?<=^)|(?<=\.))\d+(?=\.|$)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _module_pattern(module: str) -> str:
    """``encoder.layer.3.attention`` -> ``encoder.layer.*.attention``; the model line stays as is."""
    return _INDEX.sub("*", module) if module != "(model)" else module
