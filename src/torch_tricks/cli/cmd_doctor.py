"""``doctor``: the classic PyTorch pitfalls, in code (PATH...) or in a running model (--model).

Exit 0 when no finding is at or above ``--fail-on``, 1 when one is; bad usage is a
:class:`UserError` (2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from torch_tricks.cli.common import HF_CONFIG_HELP, INPUT_HELP, add_common, emit, load
from torch_tricks.errors import UserError


def add_commands(sub: Any) -> None:
    from torch_tricks._losses import LOSSES

    sp = sub.add_parser("doctor", help="find classic PyTorch pitfalls in code (PATH...) or a running model (--model)",
                        description="Static: lint PATH... (read with ast, never run), one `file:line:col: ID message` "
                                    "per finding. Runtime: --model runs training steps and reports what only a run "
                                    "shows. Exit 0: nothing at or above --fail-on; 1: findings at or above it; "
                                    "2: bad usage.")
    sp.add_argument("paths", nargs="*", metavar="PATH", help=".py files or folders to lint")
    sp.add_argument("--list", action="store_true", help="list every rule (static TT1xx, runtime TT2xx) and exit")
    sp.add_argument("--explain", metavar="ID", help="explain one rule: why it is a pitfall, the fix, its source")
    sp.add_argument("--select", action="append", metavar="IDS",
                    help="only these rules: ids or prefixes, comma-separated (e.g. TT1,TT207); hygiene adds that tier in "
                         "full (a rule named by id is reported in full too); replaces the config's")
    sp.add_argument("--ignore", action="append", metavar="IDS",
                    help="leave out these rules (ids or prefixes); replaces the config's")
    sp.add_argument("--fail-on", choices=["info", "warning", "error"],
                    help="exit 1 when a finding has this severity or higher (default: the config's fail-on, "
                         "else warning)")
    sp.add_argument("--format", dest="fmt", choices=["text", "json", "sarif"], default="text",
                    help="text (default), json, or sarif (SARIF 2.1.0, for code scanning in CI)")
    add_common(sp, json_help="same as --format json")
    sp.add_argument("--fix", action="store_true",
                    help="rewrite the findings whose fix is mechanical (TT102, TT108-TT111, TT113, TT118) in place, "
                         "then report what is left")
    sp.add_argument("--diff", action="store_true",
                    help="print the unified diff --fix would apply and write nothing (exit 1 if there is "
                         "anything to fix)")
    g = sp.add_argument_group("runtime check (--model)")
    g.add_argument("--model", help="built-in model name or package.module:factory: run training steps on it "
                                   "instead of linting files")
    g.add_argument("--input", action="append", metavar="[NAME=]SPEC", help=INPUT_HELP)
    g.add_argument("--hf-config", metavar="KEY=VALUE,...", help=HF_CONFIG_HELP)
    g.add_argument("--batch", type=int, default=8, help="batch size (default 8: BatchNorm wants 8 or more)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")
    g.add_argument("--loss", choices=[*LOSSES, "cross-entropy", "bce"], default="auto", metavar="KIND",
                   help=f"loss of the training step: {', '.join(LOSSES)}, or cross-entropy (= ce) and bce, a torch.nn "
                        "loss each (default auto: the model's own .loss, else cross-entropy; none: the mean of the "
                        "outputs)")
    g.add_argument("--optimizer", metavar="NAME",
                   help="build this optimizer (sgd, adam, adamw ...) the way torch-tricks train does, and check "
                        "its parameter groups too (default: plain SGD steps, groups not checked)")
    g.add_argument("--weight-decay", type=float, help="weight decay for --optimizer")
    g.add_argument("--steps", type=int, default=3,
                   help="training steps after the first, for the memory-growth check (default 3; 1 skips it)")
    sp.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    fmt = _format(args)
    select, ignore = _rule_codes(args.select, "--select"), _rule_codes(args.ignore, "--ignore")
    if args.list or args.explain:
        return _rules(args, fmt)
    if args.paths and args.model:
        raise UserError("give PATH... to lint code or --model to check a running model, not both")
    if args.model:
        return _doctor_model(args, fmt, select, ignore)
    return _doctor_paths(args, fmt, select, ignore)


# -- checks of the options ---------------------------------------------------------------------------

def _format(args: argparse.Namespace) -> str:
    """text, json or sarif, with the combinations that cannot work refused."""
    fmt = "json" if args.json else args.fmt
    if args.json and args.fmt == "sarif":
        raise UserError("--json and --format sarif: choose one")
    if args.fix or args.diff:
        _check_fix_options(args, fmt)
    return fmt


def _check_fix_options(args: argparse.Namespace, fmt: str) -> None:
    """--fix or --diff (not both) goes with PATH... and a format other than sarif."""
    flag = "--fix" if args.fix else "--diff"
    if args.fix and args.diff:
        raise UserError("--fix and --diff: choose one (--diff shows what --fix would write)")
    if args.model or fmt == "sarif":
        raise UserError(f"{flag} works on the files given as PATH...: not with "
                        f"{'--model' if args.model else '--format sarif'}")


def _rule_codes(values: list[str] | None, flag: str) -> tuple[str, ...] | None:
    """``--select TT1,TT207 --select TT3`` as checked rule codes; None when the flag is absent."""
    from torch_tricks.doctor.static import check_rule_codes

    if values is None:
        return None
    codes = _split_codes(values)
    if not codes:
        raise UserError(f"{flag} needs rule ids or prefixes, e.g. {flag} TT101,TT2")
    return check_rule_codes(codes, flag)


def _split_codes(values: list[str]) -> list[str]:
    """The codes of comma-separated lists, blanks dropped."""
    return [c.strip() for v in values for c in v.split(",") if c.strip()]


# -- --list and --explain ------------------------------------------------------------------------------

def _rules(args: argparse.Namespace, fmt: str) -> int:
    from torch_tricks.doctor import get_rule, list_rules

    _check_rules_options(args, fmt)
    rules = [get_rule(args.explain)] if args.explain else list_rules()
    if fmt == "json":
        print(json.dumps({"rules": [_rule_dict(r) for r in rules]}, indent=2, ensure_ascii=False))
    elif args.explain:
        print(_explain_text(rules[0]))
    else:
        print(_rules_table(rules))
    return 0


def _check_rules_options(args: argparse.Namespace, fmt: str) -> None:
    if args.paths or args.model or (args.list and args.explain):
        raise UserError("--list and --explain ID stand alone: run them without PATH or --model")
    if fmt == "sarif":
        raise UserError("--format sarif is for findings: use --json with --list / --explain")


def _rules_table(rules: list[Any]) -> str:
    from torch_tricks._format import table
    from torch_tricks.doctor.fix import FIXABLE

    return table(["id", "kind", "severity", "tier", "fix", "name", "message"],
                 [[r.id, r.kind, r.severity, r.tier, "yes" if r.id in FIXABLE else "", r.name, r.message] for r in rules],
                 "lllllll")


def _rule_dict(rule: Any) -> dict[str, Any]:
    from torch_tricks.doctor.fix import FIXABLE

    return {"id": rule.id, "name": rule.name, "kind": rule.kind, "severity": rule.severity, "tier": rule.tier,
            "tier_why": rule.tier_why, "message": rule.message, "explanation": rule.explanation,
            "source": rule.source, "fixable": rule.id in FIXABLE}


def _rule_source(rule: Any) -> str:
    """The rule's source for users: its catalogue ids and public references, linked to docs/tricks.md;
    the internal source notes (``seeds/...``, kept in ``rule.source``) are left out."""
    import re

    from torch_tricks._docs import doc_link

    parts = _public_sources(rule.source)
    ids = dict.fromkeys(re.findall(r"\b([TDIP]\d+)\b", "; ".join(parts)))
    links = [link for link in map(doc_link, ids) if link]
    text = f"Source: {'; '.join(parts) or rule.source.split(';')[0]}."
    return text + (f" See {', '.join(links)}." if links else "")


def _public_sources(source: str) -> list[str]:
    """The parts of a rule's ``source`` (``;``-separated) that are not internal ``seeds/...`` notes."""
    return [p.strip() for p in source.split(";") if p.strip() and not p.strip().startswith("seeds/")]


def _explain_text(rule: Any) -> str:
    import textwrap

    silence = _silence_text(rule)
    return "\n".join([f"{rule.id} {rule.name} ({rule.kind}, {rule.severity}, {rule.tier} tier)", "", rule.message, "",
                      textwrap.fill(rule.explanation, 88), "", textwrap.fill(_tier_text(rule), 88), "",
                      textwrap.fill(_rule_source(rule), 88), "", textwrap.fill(silence[0].upper() + silence[1:], 88)])


def _tier_text(rule: Any) -> str:
    """Which tier the rule is in, and why (a hygiene rule: where it still reports by default)."""
    if rule.tier == "hygiene":
        return (f"Tier: hygiene. {rule.tier_why[0].upper()}{rule.tier_why[1:]}. Every finding: --select hygiene (or "
                f"--select {rule.id}), or select = [\"hygiene\"] under [tool.torch-tricks.doctor].")
    return "Tier: default. Each finding is a bug or a clear slow-down where it fires."


def _silence_text(rule: Any) -> str:
    """How to fix the rule's findings automatically (when --fix can), or leave them out."""
    from torch_tricks.doctor.fix import FIXABLE

    silence = (f"Silence one line with `# noqa: {rule.id}`; " if rule.kind == "static" else "")
    silence += f"leave it out with --ignore {rule.id}, or ignore = [\"{rule.id}\"] under [tool.torch-tricks.doctor] " \
               "in pyproject.toml."
    if rule.id in FIXABLE:
        silence = "`torch-tricks doctor --fix` rewrites it where the file shows the fix is safe (--diff to preview). " \
                  + silence
    return silence


# -- PATH...: the static lint ----------------------------------------------------------------------------

def _doctor_paths(args: argparse.Namespace, fmt: str, select: Any, ignore: Any) -> int:
    _check_paths_options(args)
    groups = _project_groups(args.paths)
    failed: list[Any] = []  # files --fix could not write
    if args.fix or args.diff:
        fixed = _fix(args, groups, select, ignore)
        if args.diff:
            return _doctor_diff(fixed, fmt)
        failed = _report_fixes(fixed)
    lint = _lint(args, groups, select, ignore)
    lint["exit_code"] = max(lint["exit_code"], int(bool(failed)))
    _print_lint(lint, groups, fmt)
    return lint["exit_code"]


def _check_paths_options(args: argparse.Namespace) -> None:
    if args.input:
        raise UserError("--input goes with --model: name the model to run")
    if not args.paths:
        raise UserError("nothing to check: give PATH... (files or folders) to lint, --model NAME to check a "
                        "running model, or --list / --explain ID")


def _project_groups(paths: list[str]) -> dict[Any, tuple[Any, list[str]]]:
    """Each path with the settings of its own project (the nearest pyproject.toml), grouped by project."""
    from torch_tricks.doctor.static import load_config

    for p in paths:
        if not Path(p).exists():
            raise UserError(f"{p}: no such file or folder: give existing .py files or folders to lint")
    groups: dict[Any, tuple[Any, list[str]]] = {}
    for p in paths:
        config = load_config(p)
        groups.setdefault(config.path, (config, []))[1].append(p)
    return groups


def _fix(args: argparse.Namespace, groups: dict[Any, Any], select: Any, ignore: Any) -> list[Any]:
    from torch_tricks.doctor.fix import fix_paths

    return [ff for config, paths in groups.values()
            for ff in fix_paths(paths, select=select, ignore=ignore, config=config, write=args.fix)]


def _report_fixes(fixed: list[Any]) -> list[Any]:
    """Say on stderr what --fix wrote; the files it could not write (a file that cannot be read or
    parsed is reported by the lint that follows)."""
    failed = [ff for ff in fixed if ff.error and not ff.unreadable]
    for ff in fixed:
        line = _fix_report_line(ff, failed)
        if line is not None:
            print(line, file=sys.stderr)
    print(_written_summary(fixed), file=sys.stderr)
    return failed


def _written_summary(fixed: list[Any]) -> str:
    return (f"{_fixes_count(sum(ff.fixed for ff in fixed if ff.written))} applied to "
            f"{sum(ff.written for ff in fixed)} file(s)")


def _fix_report_line(ff: Any, failed: list[Any]) -> str | None:
    """What --fix did to one file; None when it had nothing to fix."""
    if ff in failed:
        return _not_fixed(ff)
    if ff.fixed or ff.unfixed:
        return f"{ff.path}: {_fixes_count(ff.fixed)} applied" + (
            f", {len(ff.unfixed)} not fixable there" if ff.unfixed else "")
    return None


def _not_fixed(ff: Any) -> str:
    return f"{ff.path}: not fixed: {ff.error}"


def _lint(args: argparse.Namespace, groups: dict[Any, Any], select: Any, ignore: Any) -> dict[str, Any]:
    """Every group linted under its own settings: findings, unreadable files, counts, the exit code."""
    from torch_tricks.doctor.static import lint_paths

    out: dict[str, Any] = {"findings": [], "unreadable": [], "files": 0, "seconds": 0.0, "exit_code": 0,
                           "hygiene_left_out": 0}
    for config, paths in groups.values():
        result = lint_paths(paths, select=select, ignore=ignore, config=config)
        out["findings"] += result.findings
        out["unreadable"] += result.errors
        out["files"] += result.files
        out["seconds"] += result.seconds
        out["hygiene_left_out"] += result.hygiene_left_out
        out["exit_code"] = max(out["exit_code"], _group_exit_code(result, args.fail_on or config.fail_on))
    out["fail_on"] = sorted({args.fail_on or c.fail_on for c, _ in groups.values()})
    return out


def _group_exit_code(result: Any, fail_on: str) -> int:
    from torch_tricks.doctor.static import exit_code

    code = exit_code(result.findings, fail_on)
    if result.errors:  # a file that cannot be read or parsed was not checked: an error under any --fail-on
        code = 1
    return code


def _print_lint(lint: dict[str, Any], groups: dict[Any, Any], fmt: str) -> None:
    from torch_tricks.doctor.static import static_rules, to_sarif

    findings, unreadable = lint["findings"], lint["unreadable"]
    if fmt == "sarif":
        print(json.dumps(to_sarif(findings, static_rules(), unreadable), indent=2, ensure_ascii=False))
    elif fmt == "json":
        print(json.dumps(_lint_json(lint, groups), indent=2, ensure_ascii=False))
    else:
        _print_lint_text(findings, unreadable, lint)


def _print_lint_text(findings: list[Any], unreadable: list[tuple[str, str]], lint: dict[str, Any]) -> None:
    """The findings on stdout, one a line; the unreadable files and a count on stderr."""
    from torch_tricks.doctor.registry import findings_count
    from torch_tricks.doctor.static import format_text

    for line in format_text(findings):
        print(line)
    for path, reason in unreadable:
        print(f"{path}: not linted: {reason}", file=sys.stderr)
    left = lint.get("hygiene_left_out", 0)
    print(f"{findings_count(findings)} in {lint['files']} file(s), {lint['seconds']:.2f} s"
          + (f"; {len(unreadable)} file(s) could not be read or parsed" if unreadable else "")
          + (f"; {left} more of the hygiene tier, not shown to matter here (--select hygiene shows them)"
             if left else ""), file=sys.stderr)


def _lint_json(lint: dict[str, Any], groups: dict[Any, Any]) -> dict[str, Any]:
    fail_on = lint["fail_on"]
    return {"findings": [f.to_dict() for f in lint["findings"]], "files": lint["files"],
            "unreadable": [{"path": p, "reason": r} for p, r in lint["unreadable"]],
            "seconds": round(lint["seconds"], 3), "fail_on": fail_on[0] if len(fail_on) == 1 else fail_on,
            "config": [str(c.path) for c, _ in groups.values() if c.path is not None],
            "hygiene_left_out": lint["hygiene_left_out"], "exit_code": lint["exit_code"]}


def _fixes_count(n: int) -> str:
    return f"{n} fix{'es' if n != 1 else ''}"


def _doctor_diff(fixed: list[Any], fmt: str) -> int:
    """--diff: what --fix would change, written nowhere. Exit 1 if anything would change or a file
    could not be fixed (read, parsed), else 0."""
    code = int(any(ff.diff or ff.error for ff in fixed))
    if fmt == "json":
        print(json.dumps(_diff_json(fixed, code), indent=2, ensure_ascii=False))
    else:
        _print_diff(fixed)
    return code


def _diff_json(fixed: list[Any], code: int) -> dict[str, Any]:
    return {"files": [ff.to_dict() for ff in fixed], "fixes": sum(ff.fixed for ff in fixed), "exit_code": code}


def _print_diff(fixed: list[Any]) -> None:
    """The diffs on stdout; the files that could not be fixed and a count on stderr."""
    for ff in fixed:
        sys.stdout.write(ff.diff)
    for ff in fixed:
        if ff.error:
            print(_not_fixed(ff), file=sys.stderr)
    print(_diff_summary(fixed), file=sys.stderr)


def _diff_summary(fixed: list[Any]) -> str:
    changed = sum(bool(ff.diff) for ff in fixed)
    if not changed:
        return "nothing to fix"
    return f"{_fixes_count(sum(ff.fixed for ff in fixed))} would be applied to {changed} file(s)"


# -- --model: the runtime check -------------------------------------------------------------------------

def _doctor_model(args: argparse.Namespace, fmt: str, select: Any, ignore: Any) -> int:
    from torch_tricks.doctor import list_rules
    from torch_tricks.doctor.runtime import check_model
    from torch_tricks.doctor.static import exit_code, filter_findings, load_config, to_sarif

    _check_model_options(args)
    config = load_config(Path.cwd())
    model, inputs = load(args)
    optimizer = _optimizer(args, model)
    report = check_model(model, inputs, args.loss, optimizer, steps=args.steps, device=args.device)
    findings = filter_findings(report.findings, config.select if select is None else select,
                               config.ignore if ignore is None else ignore)
    code = exit_code(findings, args.fail_on or config.fail_on)
    if fmt == "sarif":
        print(json.dumps(to_sarif(findings, list_rules("runtime")), indent=2, ensure_ascii=False))
        return code
    data = _model_data(args, report, findings, code)
    emit(argparse.Namespace(json=fmt == "json"), data, report.to_text(args.model, args.optimizer, findings))
    return code


def _model_data(args: argparse.Namespace, report: Any, findings: list[Any], code: int) -> dict[str, Any]:
    """The report of --model as JSON data, with the findings kept by --select/--ignore and the config."""
    data = {"model": args.model, "optimizer": args.optimizer, **report.to_dict()}  # loss_fn: the loss it used
    data["findings"] = [f.to_dict() for f in findings]  # after --select/--ignore and the config
    data["counts"] = _severity_counts(findings)
    data["ok"] = not (data["counts"]["error"] or data["counts"]["warning"])
    data["exit_code"] = code
    return data


def _check_model_options(args: argparse.Namespace) -> None:
    if args.steps < 1 or args.batch < 1:
        raise UserError("--steps and --batch must be >= 1")
    if args.weight_decay is not None and not args.optimizer:
        raise UserError("--weight-decay goes with --optimizer NAME")


def _optimizer(args: argparse.Namespace, model: Any) -> Any:
    """The optimizer --optimizer names, built for ``model`` as torch-tricks train builds it; None without it."""
    if not args.optimizer:
        return None
    from torch_tricks.train.optim import build_optimizer

    return build_optimizer(model, args.optimizer, weight_decay=args.weight_decay)


def _severity_counts(findings: list[Any]) -> dict[str, int]:
    return {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}

