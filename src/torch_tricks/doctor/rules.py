"""The doctor's rule registry: every pitfall has a stable id, a message and a fix.

Static rules (``TT1xx``) are found by reading source with :mod:`ast`; runtime rules
(``TT2xx``) by running one training step of a live model. Both kinds live in one
registry so ``torch-tricks doctor --list`` and ``--explain`` cover everything, and so a
``# noqa: TT101`` or a ``[tool.torch-tricks.doctor]`` ignore names the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch_tricks.errors import UserError

__all__ = ["Rule", "Finding", "SEVERITIES", "register_rule", "get_rule", "list_rules", "severity_rank"]

SEVERITIES = ("info", "warning", "error")  # ascending


def severity_rank(severity: str) -> int:
    """0 for info, 1 for warning, 2 for error; a :class:`UserError` otherwise."""
    try:
        return SEVERITIES.index(severity)
    except ValueError:
        raise UserError(f"unknown severity {severity!r}: use one of {', '.join(SEVERITIES)}") from None


@dataclass(frozen=True)
class Rule:
    """One pitfall the doctor knows."""

    id: str  # "TT101"
    name: str  # kebab-case short name: "module-in-plain-list"
    message: str  # one line, shown with each finding
    explanation: str  # why it is wrong and how to fix it (a few lines)
    severity: str  # "info" | "warning" | "error"
    source: str  # catalogue id and seed passage: "X3; seeds/003 Pytorch 使用陷阱"
    kind: str = "static"  # "static" | "runtime"


@dataclass
class Finding:
    """One occurrence of a rule: where (file/line/col for static, module/param for runtime) and what."""

    rule: str  # rule id
    message: str  # the rule's message, possibly made specific ("layer 'fc2' gets no gradient")
    path: str = ""
    line: int = 0
    col: int = 0
    severity: str = ""  # filled from the rule when empty
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.severity:
            self.severity = get_rule(self.rule).severity

    def as_dict(self) -> dict:
        return {"rule": self.rule, "message": self.message, "path": self.path, "line": self.line,
                "col": self.col, "severity": self.severity, **({"extra": self.extra} if self.extra else {})}


_RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    """Add ``rule`` to the registry (ids are unique) and return it."""
    if rule.id in _RULES:
        raise ValueError(f"doctor rule {rule.id} is registered twice")
    if rule.severity not in SEVERITIES:
        raise ValueError(f"rule {rule.id}: severity must be one of {SEVERITIES}")
    if rule.kind not in ("static", "runtime"):
        raise ValueError(f"rule {rule.id}: kind must be static or runtime")
    _RULES[rule.id] = rule
    return rule


def _load_all() -> None:
    # Importing the declarations registers the rules (the runtime checker, which imports torch, is not needed).
    import torch_tricks.doctor.runtime_rules  # noqa: F401
    import torch_tricks.doctor.static  # noqa: F401


def get_rule(rule_id: str) -> Rule:
    """The rule ``rule_id`` (case-insensitive); a :class:`UserError` naming the choices if unknown."""
    _load_all()
    try:
        return _RULES[rule_id.upper()]
    except KeyError:
        raise UserError(f"unknown doctor rule {rule_id!r}: `torch-tricks doctor --list` shows "
                        f"the {len(_RULES)} rules") from None


def list_rules(kind: str | None = None) -> list[Rule]:
    """Every rule (of ``kind``), sorted by id."""
    _load_all()
    return sorted((r for r in _RULES.values() if kind is None or r.kind == kind), key=lambda r: r.id)
