"""The doctor's rule registry: every pitfall has a stable id, a message and a fix.

Static rules (``TT1xx``) are found by reading source with :mod:`ast`; runtime rules
(``TT2xx``) by running one training step of a live model. Both kinds live in one
registry so ``torch-tricks doctor --list`` and ``--explain`` cover everything, and so a
``# noqa: TT101`` or a ``[tool.torch-tricks.doctor]`` ignore names the same ids.

The rules themselves live in :mod:`torch_tricks.doctor.rules`, one module per family; a
static rule is a :class:`StaticRule` subclass registered once by :func:`static_rule`. This
module imports none of them (the package ``torch_tricks.doctor`` loads them), so there is
no import circle between the registry and the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator

from torch_tricks.errors import UserError

__all__ = ["Rule", "Finding", "SEVERITIES", "TIERS", "HYGIENE", "StaticRule", "static_rule", "static_checks", "register_rule", "get_rule",
           "list_rules", "check_rule_codes", "severity_rank", "findings_count"]

SEVERITIES = ("info", "warning", "error")  # ascending
# Two tiers, like ruff's default set and its opt-in rules. "default": a finding is a bug or a clear slow-down where
# it fires. "hygiene": right in general, often harmless where it fires (a state_dict load that works under either
# weights_only default); such a rule reports by default only the findings its ``matters`` shows to matter there,
# and all of them with ``--select hygiene`` (or its id) or ``select = ["hygiene"]`` in pyproject.toml.
TIERS = ("default", "hygiene")
HYGIENE = "HYGIENE"  # the select code that asks for the hygiene tier in full


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
    tier: str = "default"  # "default": each finding a bug or a clear slow-down | "hygiene": see TIERS
    tier_why: str = ""  # hygiene: where one of its findings is still reported by default, and why the rest are not


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

    def to_dict(self) -> dict:
        return {"rule": self.rule, "message": self.message, "path": self.path, "line": self.line,
                "col": self.col, "severity": self.severity, **({"extra": self.extra} if self.extra else {})}

    as_dict = to_dict  # the earlier name; every result type of the package says to_dict


def findings_count(findings: Iterable[Finding]) -> str:
    """``"3 findings (1 error, 2 warnings)"``, or ``"no findings"``: the count line that the
    runtime report and the lint summary share."""
    from collections import Counter

    findings = list(findings)
    if not findings:
        return "no findings"
    by = Counter(f.severity for f in findings)
    parts = [_count(by[s], s) for s in ("error", "warning", "info") if by[s]]
    return f"{_count(len(findings), 'finding')} ({', '.join(parts)})"


def _count(n: int, noun: str) -> str:
    """``"1 error"``, ``"2 errors"``; ``info`` has no plural."""
    return f"{n} {noun}{'s' if n != 1 and noun != 'info' else ''}"


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


def get_rule(rule_id: str) -> Rule:
    """The rule ``rule_id`` (case-insensitive); a :class:`UserError` naming the choices if unknown."""
    try:
        return _RULES[rule_id.upper()]
    except KeyError:
        raise UserError(f"unknown doctor rule {rule_id!r}: `torch-tricks doctor --list` shows "
                        f"the {len(_RULES)} rules") from None


def list_rules(kind: str | None = None) -> list[Rule]:
    """Every rule (of ``kind``), sorted by id."""
    return sorted((r for r in _RULES.values() if kind is None or r.kind == kind), key=lambda r: r.id)


def check_rule_codes(codes: Iterable[str], where: str = "the rule list") -> tuple[str, ...]:
    """``codes`` upper-cased, each checked to name a rule or be a prefix of rule ids.

    An unknown code is a :class:`UserError` (``where`` says where it was written), so a
    typo in ``--select`` or a config never silently disables a check.
    """
    if isinstance(codes, str):
        codes = [codes]
    return tuple(_checked_code(code, where) for code in codes)


def _checked_code(code: str, where: str) -> str:
    c = code.strip().upper()
    if c == HYGIENE:
        return c
    if not c or not any(rid.startswith(c) for rid in _RULES):
        raise UserError(f"unknown doctor rule {code!r} in {where}: use ids such as TT101 or a "
                        f"prefix such as TT1 (`torch-tricks doctor --list` shows them)")
    return c


# --------------------------------------------------------------------------- static rules


class StaticRule:
    """A pitfall found by reading code: the class attributes describe it (they become its
    :class:`Rule`), :meth:`check` finds it in one analysed file."""

    id: ClassVar[str]
    name: ClassVar[str]
    severity: ClassVar[str]
    source: ClassVar[str]
    message: ClassVar[str]
    explanation: ClassVar[str]
    tier: ClassVar[str] = "default"
    tier_why: ClassVar[str] = ""

    def check(self, f: Any) -> Iterator[tuple[Any, str]]:
        """Yield ``(ast node, message)`` for each occurrence in ``f``, a
        :class:`torch_tricks.doctor.analysis.FileAnalysis`."""
        raise NotImplementedError

    def matters(self, f: Any, node: Any) -> bool:
        """A hygiene rule's finding at ``node`` that is shown to matter there, so it is reported by default."""
        return False


_STATIC: dict[str, StaticRule] = {}


def static_rule(cls: type[StaticRule]) -> type[StaticRule]:
    """Class decorator: register ``cls`` (its :class:`Rule` and one instance as its checker)."""
    if cls.tier not in TIERS or (cls.tier == "hygiene") != bool(cls.tier_why):
        raise ValueError(f"rule {cls.id}: tier must be one of {TIERS}, a hygiene rule saying why (tier_why)")
    register_rule(Rule(id=cls.id, name=cls.name, message=cls.message, explanation=cls.explanation,
                       severity=cls.severity, source=cls.source, kind="static", tier=cls.tier, tier_why=cls.tier_why))
    _STATIC[cls.id] = cls()
    return cls


def static_checks() -> dict[str, StaticRule]:
    """Rule id -> checker of every registered static rule."""
    return dict(_STATIC)
