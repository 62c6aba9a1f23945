"""The static doctor: every corpus file gives exactly its ``# expect:`` findings, and the
machinery around the rules (noqa, select/ignore, config, SARIF, exit codes) behaves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from torch_tricks.doctor import get_rule, list_rules
from torch_tricks.doctor.config import DoctorConfig, load_config
from torch_tricks.doctor.registry import Finding
from torch_tricks.doctor.static import (LintResult, check_rule_codes, exit_code, format_text, lint_paths,
                                        lint_source, static_rules, to_sarif)
from torch_tricks.errors import UserError

CORPUS = Path(__file__).parent / "doctor_corpus"
SCHEMA = CORPUS / "sarif-schema-2.1.0.json"
_EXPECT = re.compile(r"#\s*expect:\s*(TT\d+(?:\s*,\s*TT\d+)*)")
_FILES = sorted(CORPUS.glob("*/pos_*.py")) + sorted(CORPUS.glob("*/neg_*.py"))


def expected(path: Path) -> set[tuple[str, int]]:
    """(rule, line) for every ``# expect:`` marker in ``path``."""
    out = set()
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in _EXPECT.finditer(line):
            out.update((code.strip(), lineno) for code in m.group(1).split(","))
    return out


# --------------------------------------------------------------------------- corpus


@pytest.mark.parametrize("path", _FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_file_gives_exactly_its_markers(path):
    found = {(f.rule, f.line) for f in lint_source(path.read_text(encoding="utf-8"), str(path), select=["hygiene"])}
    want = expected(path)
    if path.name.startswith("neg_"):
        assert not want, "negative files carry no markers"
        assert found == set(), f"false positives on correct code: {sorted(found)}"
    else:
        assert want, "a positive file needs # expect: markers"
        if path.parent.name.startswith("TT"):
            assert any(rule == path.parent.name for rule, _ in want), "positives of the folder's own rule"
        assert sorted(found - want) == [], "findings without a marker (false positives)"
        assert sorted(want - found) == [], "markers without a finding (missed)"


def test_every_static_rule_has_positives_and_negatives_in_the_corpus():
    rules = [r.id for r in static_rules()]
    assert rules == [r.id for r in list_rules("static")]
    for rid in rules:
        folder = CORPUS / rid
        assert sorted(folder.glob("pos_*.py")), f"{rid}: no positive corpus file"
        assert sorted(folder.glob("neg_*.py")), f"{rid}: no negative corpus file"
        markers = [m for p in folder.glob("pos_*.py") for m in expected(p) if m[0] == rid]
        assert len(markers) >= 2, f"{rid}: at least two phrasings"


def test_rules_are_documented_with_their_source_and_fix():
    for rule in static_rules():
        assert re.fullmatch(r"TT1\d\d", rule.id) and rule.kind == "static"
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name)
        assert re.search(r"\b(X|[TDP]\d+)\b", rule.source), f"{rule.id}: source names no catalogue id"
        assert "Fix" in rule.explanation or "Map:" in rule.explanation, f"{rule.id}: explanation gives no fix"
        assert "\n" not in rule.message



def test_torch_load_without_weights_only_says_what_the_file_shows_it_reads():
    """TT111 goes by the torch.save writing the same path or buffer (or the result handed to
    load_state_dict): the advice for a whole pickled module is the opposite of the one for state_dicts."""
    path = CORPUS / "TT111" / "pos_what_it_reads.py"
    messages = {f.line: f.message for f in lint_source(path.read_text(encoding="utf-8"), select=["TT111"])}
    for line, saved in ((12, 11), (17, 15)):  # a path string; a file opened by the same open(...) path
        assert messages[line].startswith(f"torch.load of a whole pickled module (model saved on line {saved}) fails "
                                         f"under weights_only=True, the default since torch 2.6: pass "
                                         f"weights_only=False for a trusted file, or save model.state_dict()")
    assert "of tensors/state_dicts (saved on line 21): pass weights_only=True" in messages[22]
    assert "of tensors/state_dicts (handed to load_state_dict on line 26): pass weights_only=True" in messages[26]
    assert "whose contents this code does not show: check what it holds" in messages[27]
    other = lint_source("import torch\nstate = {'model': net.state_dict()}\nstate['args'] = args\n"
                        "torch.save(state, p)\nx = torch.load(p, map_location='cpu')\n", select=["TT111"])
    assert [(f.line, f.message.split(":")[0]) for f in other] == [
        (5, "torch.load without weights_only of what torch.save stores on line 4 (state), not shown to be only "
            "tensors/state_dicts")]
    assert "weights_only=True" in get_rule("TT111").message and "2.6" in get_rule("TT111").message


# --------------------------------------------------------------------------- noqa, select, ignore

_TWO = "import torch\nx = torch.randn(3)\nx.cuda(){}\nstate = torch.load('f.pt'){}\n"


def _rules(findings):
    return sorted((f.rule, f.line) for f in findings)


def test_noqa_bare_silences_everything_on_its_line():
    found = _rules(lint_source(_TWO.format("", "  # noqa"), select=["hygiene"]))
    assert found == [("TT113", 3)]


def test_noqa_with_codes_silences_only_those():
    found = _rules(lint_source(_TWO.format("  # noqa: TT113", "  # noqa: TT110"), select=["hygiene"]))
    assert found == [("TT111", 4)]
    found = _rules(lint_source(_TWO.format("", "  # NOQA:TT110,TT111"), select=["hygiene"]))
    assert found == [("TT113", 3)]
    found = _rules(lint_source(_TWO.format("", "  # noqa: TT110 TT111"), select=["hygiene"]))
    assert found == [("TT113", 3)]


def test_noqa_for_other_tools_or_inside_strings_does_not_count():
    found = _rules(lint_source(_TWO.format("  # noqa: E501", ""), select=["hygiene"]))
    assert ("TT113", 3) in found
    src = "import torch\nx = torch.randn(3)\nx.cuda(); s = '# noqa'\n"
    assert _rules(lint_source(src)) == [("TT113", 3)]


def test_select_and_ignore_take_ids_and_prefixes():
    src = _TWO.format("", "")
    # TT110 and TT111 are hygiene rules, and nothing shows these loads matter: by default only TT113
    assert {f.rule for f in lint_source(src)} == {"TT113"}
    assert {f.rule for f in lint_source(src, select=["TT11"])} == {"TT113"}  # a prefix: the default set's
    assert {f.rule for f in lint_source(src, select=["tt110"])} == {"TT110"}  # an id: asked for, in full
    assert {f.rule for f in lint_source(src, select=["hygiene"])} == {"TT110", "TT111", "TT113"}
    assert {f.rule for f in lint_source(src, select=["TT11", "HYGIENE"])} == {"TT110", "TT111", "TT113"}
    assert {f.rule for f in lint_source(src, select=["hygiene"], ignore=["TT110", "TT113"])} == {"TT111"}
    assert lint_source(src, select=["TT1"], ignore=["TT1"]) == []


def test_unknown_rule_codes_are_user_errors():
    with pytest.raises(UserError, match="TT199"):
        lint_source("x = 1\n", select=["TT199"])
    with pytest.raises(UserError, match="E501"):
        check_rule_codes(["E501"], "ignore")
    assert check_rule_codes(["TT2"], "select") == ("TT2",)  # runtime rules are rules too


def test_columns_are_one_based_characters_and_text_is_flake8_style():
    src = "import torch\ns = '数据'; x = torch.randn(2); x.cuda()\n"
    (f,) = lint_source(src, path="a/b.py")
    assert (f.line, f.col) == (2, src.splitlines()[1].index("x.cuda") + 1)
    assert format_text([f]) == [f"a/b.py:2:{f.col}: TT113 {f.message}"]


def test_source_that_does_not_parse_raises_syntax_error():
    with pytest.raises(SyntaxError):
        lint_source("def f(:\n")


@pytest.mark.parametrize("src", ["", "# only a comment\n", "x = (\n" + "(" * 50 + ")" * 50 + "\n)\n",
                                 "async def f():\n    async with a as b:\n        [c async for c in b]\n",
                                 "match x:\n    case [a, *rest]:\n        pass\n",
                                 "def f(*, a, b=1, **kw):\n    global g\n    g = lambda y=a: y\n"])
def test_odd_but_valid_code_lints_without_crashing(src):
    assert lint_source(src) == []


# --------------------------------------------------------------------------- files and folders


def test_lint_paths_walks_folders_reports_unreadable_files_and_counts(tmp_path):
    (tmp_path / "good.py").write_text("import torch\nx = torch.randn(2)\nx.cuda()\n")
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    (tmp_path / "latin.py").write_bytes(b"x = '\xe9'\n")
    (tmp_path / "notes.txt").write_text("torch.load('x')\n")
    for skipped in (".venv", "__pycache__", ".git", "env_dir"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "bad.py").write_text("import torch\ntorch.load('x')\n")
    (tmp_path / "env_dir" / "pyvenv.cfg").write_text("home = /usr\n")
    calls = []
    result = lint_paths([tmp_path], progress=lambda done, total: calls.append((done, total)))
    assert isinstance(result, LintResult)
    assert result.files == 3 and calls == [(1, 3), (2, 3), (3, 3)]
    assert [(Path(f.path).name, f.rule) for f in result.findings] == [("good.py", "TT113")]
    reasons = dict((Path(p).name, r) for p, r in result.errors)
    assert set(reasons) == {"broken.py", "latin.py"}
    assert "does not parse" in reasons["broken.py"] and "line 1" in reasons["broken.py"]
    assert "utf-8" in reasons["latin.py"]
    assert all("\n" not in r for r in reasons.values()) and result.seconds >= 0


def test_lint_paths_honours_a_coding_cookie(tmp_path):
    path = tmp_path / "latin.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\nimport torch\ns = '\xe9'; x = torch.randn(2); x.cuda()\n")
    (f,) = lint_paths([path]).findings
    assert (f.rule, f.line, f.col) == ("TT113", 3, len("s = 'é'; x = torch.randn(2); ") + 1)


def test_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        lint_paths([tmp_path / "nope.py"])


# --------------------------------------------------------------------------- pyproject config


def _project(tmp_path, table: str) -> Path:
    (tmp_path / "pyproject.toml").write_text(f"[project]\nname = 'x'\n\n[tool.torch-tricks.doctor]\n{table}\n")
    pkg = tmp_path / "pkg"
    (pkg / "gen").mkdir(parents=True, exist_ok=True)
    (pkg / "a.py").write_text("import torch\nx = torch.randn(2)\nx.cuda()\nstate = torch.load('f')\n")
    (pkg / "gen" / "b.py").write_text("import torch\nstate = torch.load('f')\n")
    return pkg


def test_config_select_ignore_fail_on_exclude(tmp_path):
    pkg = _project(tmp_path, 'select = ["TT11", "hygiene"]\nignore = ["TT111"]\nfail-on = "error"\nexclude = ["gen"]')
    config = load_config(pkg / "a.py")
    assert config == DoctorConfig(select=("TT11", "HYGIENE"), ignore=("TT111",), fail_on="error", exclude=("gen",),
                                  path=tmp_path / "pyproject.toml")
    result = lint_paths([pkg], config=config)
    assert result.files == 1
    assert sorted(f.rule for f in result.findings) == ["TT110", "TT113"]  # TT110: the hygiene tier, asked for
    assert sorted(f.rule for f in lint_paths([pkg], select=["TT11"], config=config).findings) == ["TT113"]
    assert exit_code(result.findings, config.fail_on) == 1  # TT113 is an error
    # arguments given to lint_paths replace the config's lists
    assert {f.rule for f in lint_paths([pkg], select=["TT110"], config=config).findings} == {"TT110"}


def test_config_exclude_with_a_slash_is_relative_to_the_project(tmp_path):
    pkg = _project(tmp_path, 'exclude = ["pkg/gen/*"]')
    assert lint_paths([pkg], config=load_config(pkg)).files == 1
    pkg = _project(tmp_path, 'exclude = ["other/gen/*"]')
    assert lint_paths([pkg], config=load_config(pkg)).files == 2


def test_config_defaults_without_a_table_or_a_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert load_config(tmp_path) == DoctorConfig(path=tmp_path / "pyproject.toml")
    assert DoctorConfig().select is None and DoctorConfig().fail_on == "warning"


@pytest.mark.parametrize("table, message", [
    ('select = ["TT999"]', "unknown doctor rule 'TT999'"),
    ('ignore = "TT101"', "must be a list of strings"),
    ('fail-on = "fatal"', "fail-on = 'fatal'"),
    ('exclud = ["x"]', "unknown key 'exclud'"),
])
def test_bad_config_is_a_user_error_naming_the_file(tmp_path, table, message):
    _project(tmp_path, table)
    with pytest.raises(UserError, match=re.escape(message)) as info:
        load_config(tmp_path)
    assert "pyproject.toml" in str(info.value)


def test_config_that_is_not_toml_is_a_user_error(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.torch-tricks.doctor\nselect = [\n")
    with pytest.raises(UserError, match="TOML"):
        load_config(tmp_path)


# --------------------------------------------------------------------------- SARIF and exit codes


def test_sarif_output_validates_against_the_sarif_2_1_0_schema():
    jsonschema = pytest.importorskip("jsonschema")
    result = lint_paths([CORPUS / "mixed" / "pos_mnist_example.py", CORPUS / "TT113"])
    log = to_sarif(result.findings, static_rules())
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft4Validator.check_schema(schema)
    jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker()).validate(log)
    json.dumps(log)  # serialisable as it stands

    run = log["runs"][0]
    assert log["version"] == "2.1.0" and run["tool"]["driver"]["name"] == "torch-tricks"
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [r.id for r in static_rules()]
    levels = {r["id"]: r["defaultConfiguration"]["level"] for r in rules}
    assert {levels["TT113"], levels["TT103"], levels["TT120"]} == {"error", "warning", "note"}
    assert len(run["results"]) == len(result.findings)
    for res, f in zip(run["results"], result.findings):
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"] == f.rule
        region = res["locations"][0]["physicalLocation"]["region"]
        assert (region["startLine"], region["startColumn"]) == (f.line, f.col)
        assert res["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].endswith(Path(f.path).name)


def test_sarif_handles_findings_without_a_location_and_unlisted_rules():
    jsonschema = pytest.importorskip("jsonschema")
    findings = [Finding(rule="TT113", message="m", path="dir with space/a.py", line=3, col=1),
                Finding(rule="TT101", message="runtime-style, no file", extra={"module": "fc"})]
    log = to_sarif(findings, [])
    jsonschema.Draft4Validator(json.loads(SCHEMA.read_text(encoding="utf-8"))).validate(log)
    results = log["runs"][0]["results"]
    assert results[0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "dir%20with%20space/a.py"
    assert "locations" not in results[1] and results[1]["properties"] == {"module": "fc"}


def test_exit_code_fails_at_or_above_the_threshold():
    info = Finding(rule="TT120", message="m", path="a.py", line=1, col=1)
    warning = Finding(rule="TT103", message="m", path="a.py", line=1, col=1)
    error = Finding(rule="TT113", message="m", path="a.py", line=1, col=1)
    assert (info.severity, warning.severity, error.severity) == ("info", "warning", "error")
    assert exit_code([]) == 0
    assert exit_code([info]) == 0 and exit_code([info], "info") == 1
    assert exit_code([warning]) == 1 and exit_code([warning], "error") == 0
    assert exit_code([error], "error") == 1
    with pytest.raises(UserError):
        exit_code([error], "fatal")


def test_clock_reads_lint_in_time_linear_in_their_number():
    """TT112 pairs consecutive clock reads; its analysis was quadratic in them (30,000 reads in one function:
    over 10 minutes). Four times the reads must take well under the 16 times a quadratic analysis takes
    (a ratio measured side by side, best of three each); benchmarks/doctor_corpus.py times the 30,000."""
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from doctor_corpus import clock_function

    def best(reads: int) -> tuple[float, int]:
        import gc

        source, times = clock_function(reads), []
        for _ in range(3):
            gc.collect()
            gc.disable()  # the collector's passes over a large tree are not the analysis's own cost
            try:
                t0 = time.perf_counter()
                n = len(lint_source(source, "clocks.py", select=["TT112"]))
                times.append(time.perf_counter() - t0)
            finally:
                gc.enable()
        return min(times), n

    small, n_small = best(1000)
    large, n_large = best(4000)
    assert (n_small, n_large) == (999, 3999)  # every consecutive pair times launches only: each one found
    assert large / small < 8, (small, large)


def test_no_top_level_name_of_the_static_doctor_is_defined_twice():
    """A second ``def`` of a helper silently replaces the first for every rule that calls it (a new rule's
    ``_is_module`` once turned TT101's negatives into findings); a helper named like one it imports from the
    analysis hides the shared one. Checked in every module of the analysis, the driver and every rule module."""
    import ast
    from collections import Counter

    import torch_tricks.doctor.analysis as analysis
    import torch_tricks.doctor.static as static

    package = Path(analysis.__file__).parent  # doctor/analysis/, a package of modules by job
    files = [*sorted(package.glob("*.py")), Path(static.__file__), *sorted((package.parent / "rules").glob("*.py"))]
    assert len(files) >= 18
    for file in files:
        tree = ast.parse(file.read_text(encoding="utf-8"))
        names = Counter(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
        names.update(t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name))
        names.update(a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names)
        assert [name for name, count in names.items() if count > 1] == [], file.name


def test_every_static_rule_is_one_registered_class_in_a_family_module():
    """The rules live in ``doctor/rules/<family>.py``, one :class:`StaticRule` subclass each, registered once."""
    import inspect

    from torch_tricks.doctor.registry import StaticRule, static_checks

    checks = static_checks()
    assert sorted(checks) == [r.id for r in list_rules("static")]
    families = {rid: inspect.getmodule(type(c)).__name__ for rid, c in checks.items()}
    assert all(isinstance(c, StaticRule) for c in checks.values())
    assert all(m.startswith("torch_tricks.doctor.rules.") for m in families.values()), families
    assert len(set(families.values())) >= 6
