"""Doctor findings as SARIF 2.1.0, the format code-scanning services (GitHub, GitLab,
Azure DevOps) and editors read, so pitfalls show up as annotations on the lines."""

from __future__ import annotations

from pathlib import PurePath, PurePosixPath, PureWindowsPath
from typing import Iterable
from urllib.parse import quote

from torch_tricks import __version__
from torch_tricks.doctor.registry import Finding, Rule, get_rule

__all__ = ["to_sarif", "SARIF_SCHEMA_URI"]

SARIF_SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
_LEVEL = {"info": "note", "warning": "warning", "error": "error"}


def to_sarif(findings: Iterable[Finding], rules: Iterable[Rule],
             unreadable: Iterable[tuple[str, str]] = ()) -> dict:
    """One SARIF run: ``rules`` as the driver's rule descriptors, ``findings`` as results.

    A finding whose rule is not among ``rules`` gets its descriptor added, so every
    ``ruleIndex`` resolves. Columns are 1-based and count characters
    (``columnKind: unicodeCodePoints``). Runtime findings have no file: they get a
    logical location instead (the module or parameter name); ``extra`` goes into the
    result's property bag. ``unreadable`` holds ``(path, reason)`` for files that could
    not be read or parsed: they become error notifications of the run's invocation (the
    run itself still succeeded).
    """
    findings = list(findings)
    rules, index = _with_rules_of(list(rules), findings)
    run = {
        "tool": {"driver": {"name": "torch-tricks", "version": __version__,
                            "rules": [_descriptor(r) for r in rules]}},
        "columnKind": "unicodeCodePoints",
        "results": [_result(f, index[f.rule]) for f in findings],
    }
    notes = [{"level": "error", "message": {"text": reason},
              "locations": [{"physicalLocation": {"artifactLocation": {"uri": _uri(path)}}}]}
             for path, reason in unreadable]
    if notes:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": notes}]
    return {"$schema": SARIF_SCHEMA_URI, "version": "2.1.0", "runs": [run]}


def _with_rules_of(rules: list[Rule], findings: list[Finding]) -> tuple[list[Rule], dict[str, int]]:
    """``rules`` plus the rule of each finding not among them, and each rule's index in that list."""
    index = {r.id: i for i, r in enumerate(rules)}
    for f in findings:
        if f.rule not in index:
            index[f.rule] = len(rules)
            rules.append(get_rule(f.rule))
    return rules, index


def _descriptor(rule: Rule) -> dict:
    return {
        "id": rule.id,
        "name": rule.name,
        "shortDescription": {"text": rule.message},
        "fullDescription": {"text": rule.explanation},
        "help": {"text": f"{rule.explanation}\n\nSource: {rule.source}",
                 "markdown": f"{rule.explanation}\n\n*Source: {rule.source}*"},
        "defaultConfiguration": {"level": _LEVEL[rule.severity]},
        "properties": {"tags": [rule.kind], "source": rule.source},
    }


def _result(finding: Finding, rule_index: int) -> dict:
    result = {"ruleId": finding.rule, "ruleIndex": rule_index, "level": _LEVEL[finding.severity],
              "message": {"text": finding.message}}
    if finding.path:
        result["locations"] = [_location(finding)]
    if finding.extra:
        result["properties"] = dict(finding.extra)
    return result


def _location(finding: Finding) -> dict:
    """Where a finding with a path is: a place in a file, or a part of the model for a runtime rule."""
    if get_rule(finding.rule).kind == "runtime":
        # a module or parameter of the model ("layer4", "fc.weight", "(model)"), not a file
        return {"logicalLocations": [{"fullyQualifiedName": finding.path, "kind": "module"}]}
    physical: dict = {"artifactLocation": {"uri": _uri(finding.path)}}
    if finding.line > 0:
        physical["region"] = {"startLine": finding.line, "startColumn": max(finding.col, 1)}
    return {"physicalLocation": physical}


def _uri(path: str) -> str:
    """A relative path as a relative URI reference (forward slashes, percent-escaped);
    an absolute one as a ``file://`` URI."""
    pure: PurePath = PureWindowsPath(path) if "\\" in path else PurePosixPath(path)
    if pure.is_absolute():
        return pure.as_uri()
    return quote(pure.as_posix(), safe="/")
