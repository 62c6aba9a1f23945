"""Doctor: find the classic PyTorch pitfalls in code (static, :mod:`ast`) and in a running model."""

from torch_tricks.doctor import rules as _rules  # noqa: F401  (registers every rule)
from torch_tricks.doctor.registry import Finding, Rule, findings_count, get_rule, list_rules, register_rule

__all__ = ["Finding", "Rule", "findings_count", "get_rule", "list_rules", "register_rule"]
