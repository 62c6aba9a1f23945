"""`torch-tricks doctor`: --list / --explain, linting paths (text like ruff, --json, --format
sarif), exit codes (0 clean, 1 findings at or above --fail-on, 2 bad usage), # noqa, the
pyproject.toml table, and the runtime mode (--model ... --input ...)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from torch_tricks.cli import main
from torch_tricks.doctor import list_rules

CORPUS = Path(__file__).parent / "doctor_corpus"
SCHEMA = CORPUS / "sarif-schema-2.1.0.json"
MIXED_POS = CORPUS / "mixed" / "pos_mnist_example.py"
MIXED_NEG = CORPUS / "mixed" / "neg_mnist_example.py"
_EXPECT = re.compile(r"#\s*expect:\s*(TT\d+(?:\s*,\s*TT\d+)*)")
_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<rule>TT\d{3}) (?P<message>\S.*)$")

INFO_ONLY = "import torch\nstate = torch.load('w.pt', weights_only=True)\n"  # TT110 (info)
WARNING = "import torch\nstate = torch.load('w.pt', map_location='cpu')\n"  # TT111 (warning)
ERROR = "import torch\nx = torch.randn(3)\nx.cuda()\n"  # TT113 (error)


def run(capsys, *argv):
    """(exit code, stdout, stderr) of `torch-tricks ARGV`, argparse's own exits included."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse rejects the arguments itself
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def markers(path: Path) -> set[tuple[str, int]]:
    return {(code.strip(), n) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in _EXPECT.finditer(line) for code in m.group(1).split(",")}


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def validate_sarif(log: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker()).validate(log)


# --------------------------------------------------------------------------- --list, --explain


def test_list_prints_every_rule_static_and_runtime(capsys):
    code, out, _ = run(capsys, "doctor", "--list")
    assert code == 0
    ids = re.findall(r"^(TT\d{3})\s", out, re.MULTILINE)
    assert ids == [r.id for r in list_rules()]
    assert {"TT101", "TT121", "TT201", "TT213"} <= set(ids)
    code, out, _ = run(capsys, "doctor", "--list", "--json")
    rules = json.loads(out)["rules"]
    assert code == 0 and [r["id"] for r in rules] == ids
    assert all(r["explanation"] and r["source"] and r["severity"] in ("info", "warning", "error") for r in rules)


def test_explain_gives_the_explanation_fix_source_and_how_to_silence(capsys):
    code, out, _ = run(capsys, "doctor", "--explain", "tt101")  # ids are case-insensitive
    assert code == 0
    assert out.startswith("TT101 module-in-plain-container (static, error, default tier)")
    assert "nn.ModuleList" in out and "Fix:" in out and "Source:" in out
    assert "# noqa: TT101" in out and "[tool.torch-tricks.doctor]" in out
    assert "seeds/" not in out  # internal source notes stay in rule.source, not in what users read
    code, out, _ = run(capsys, "doctor", "--explain", "TT110")  # a rule whose source names tricks: linked to the docs
    assert code == 0 and "T20, T26" in out and "docs/tricks.md#t20" in out and "seeds/" not in out
    code, out, _ = run(capsys, "doctor", "--explain", "TT207", "--json")
    (rule,) = json.loads(out)["rules"]
    assert code == 0 and rule["id"] == "TT207" and rule["kind"] == "runtime"


# --------------------------------------------------------------------------- linting paths


def test_text_output_is_one_ruff_style_line_per_finding(capsys):
    code, out, err = run(capsys, "doctor", MIXED_POS, "--select", "hygiene")  # its markers are of both tiers
    lines = out.splitlines()
    assert lines and all(_LINE.match(line) for line in lines), lines
    parsed = [_LINE.match(line) for line in lines]
    assert {m["path"] for m in parsed} == {str(MIXED_POS)}
    assert {(m["rule"], int(m["line"])) for m in parsed} == markers(MIXED_POS)
    assert all(int(m["col"]) >= 1 for m in parsed)
    assert code == 1  # errors and warnings among them, default --fail-on warning
    assert f"{len(lines)} findings" in err and "in 1 file(s)" in err


def test_correct_code_gives_no_findings_and_exit_0(capsys):
    code, out, err = run(capsys, "doctor", MIXED_NEG, CORPUS / "TT117" / "neg_accumulate.py")
    assert (code, out) == (0, "")
    assert "no findings in 2 file(s)" in err


def test_a_folder_is_walked(capsys):
    code, out, _ = run(capsys, "doctor", CORPUS / "TT113")
    found = {(Path(m["path"]).name, m["rule"], int(m["line"])) for m in map(_LINE.match, out.splitlines())}
    want = {(p.name, r, n) for p in (CORPUS / "TT113").glob("pos_*.py") for r, n in markers(p)}
    assert code == 1 and found == want


@pytest.mark.parametrize("source, fail_on, expected", [
    (INFO_ONLY, None, 0), (INFO_ONLY, "info", 1),
    (WARNING, None, 1), (WARNING, "warning", 1), (WARNING, "error", 0), (WARNING, "info", 1),
    (ERROR, None, 1), (ERROR, "error", 1),
    ("import torch\nx = torch.zeros(2)\n", "info", 0),
])
def test_exit_code_is_1_at_or_above_fail_on_else_0(capsys, tmp_path, source, fail_on, expected):
    path = write(tmp_path, "m.py", source)
    code, out, _ = run(capsys, "doctor", path, "--select", "hygiene", *(["--fail-on", fail_on] if fail_on else []))
    assert code == expected
    clean = source.endswith("torch.zeros(2)\n")
    assert (out == "") == clean  # findings are printed whatever the threshold


@pytest.mark.parametrize("argv, needle", [
    ([], "nothing to check"),
    (["missing.py"], "no such file or folder"),
    (["{ok}", "missing_dir"], "no such file or folder"),
    (["--select", "TT999", "{ok}"], "unknown doctor rule 'TT999'"),
    (["--ignore", "E501", "{ok}"], "unknown doctor rule 'E501'"),
    (["--select", ",", "{ok}"], "--select needs rule ids"),
    (["--explain", "TT999"], "unknown doctor rule 'TT999'"),
    (["--list", "{ok}"], "stand alone"),
    (["--json", "--format", "sarif", "{ok}"], "choose one"),
    (["--model", "resnet18", "{ok}"], "not both"),
    (["--input", "3x8x8", "{ok}"], "--input goes with --model"),
    (["--model", "no_such_model"], "unknown model 'no_such_model'"),
    (["--model", "mlp", "--weight-decay", "0.1"], "--weight-decay goes with --optimizer"),
])
def test_bad_usage_exits_2_with_one_line(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "ok.py", "x = 1\n")
    code, out, err = run(capsys, "doctor", *[a.format(ok="ok.py") for a in argv])
    assert code == 2
    assert out == ""
    assert err.startswith("torch-tricks: error: ") and needle in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["--fail-on", "fatal"], ["--format", "xml"], ["--loss", "hinge"]])
def test_arguments_argparse_rejects_exit_2(capsys, argv):
    code, _, err = run(capsys, "doctor", *argv, MIXED_NEG)
    assert code == 2 and "invalid choice" in err


def test_unparseable_files_are_reported_the_run_goes_on_and_it_fails(capsys, tmp_path):
    write(tmp_path, "broken.py", "def f(:\n    pass\n")
    write(tmp_path, "bad.py", ERROR)
    code, out, err = run(capsys, "doctor", tmp_path)
    assert code == 1 and out.count(": TT113 ") == 1
    assert "broken.py: not linted: does not parse" in err and "1 file(s) could not be read or parsed" in err
    for fail_on in ("info", "warning", "error"):  # a file the doctor could not check never passes CI
        code, out, err = run(capsys, "doctor", tmp_path / "broken.py", "--fail-on", fail_on)
        assert (code, out) == (1, "") and "does not parse" in err
    write(tmp_path, "fine.py", "x = 1\n")
    assert run(capsys, "doctor", tmp_path / "fine.py", "--fail-on", "error")[0] == 0


def test_noqa_silences_the_named_rule_on_its_line_only(capsys, tmp_path):
    path = write(tmp_path, "m.py", textwrap.dedent("""\
        import torch
        x = torch.randn(3)
        x.cuda()  # noqa: TT113
        x.cpu()  # noqa: TT110
        y = torch.load('f.pt')  # noqa
        z = torch.load('f.pt', weights_only=True)  # noqa: TT110, E501
    """))
    code, out, _ = run(capsys, "doctor", path)
    found = [(m["rule"], int(m["line"])) for m in map(_LINE.match, out.splitlines())]
    assert found == [("TT113", 4)]
    assert code == 1


def test_select_and_ignore_flags(capsys, tmp_path):
    path = write(tmp_path, "m.py", ERROR + "state = torch.load('f.pt')\n")  # TT113, TT110, TT111
    rules = lambda out: sorted(m["rule"] for m in map(_LINE.match, out.splitlines()))  # noqa: E731
    # TT110 and TT111 are hygiene rules and nothing shows this load matters: by default TT113 alone
    assert rules(run(capsys, "doctor", path)[1]) == ["TT113"]
    assert rules(run(capsys, "doctor", path, "--select", "TT11")[1]) == ["TT113"]
    assert rules(run(capsys, "doctor", path, "--select", "TT11,hygiene")[1]) == ["TT110", "TT111", "TT113"]
    assert rules(run(capsys, "doctor", path, "--select", "TT110,TT111")[1]) == ["TT110", "TT111"]  # by id: in full
    code, out, _ = run(capsys, "doctor", path, "--select", "hygiene", "--ignore", "TT113", "--ignore", "TT111")
    assert rules(out) == ["TT110"] and code == 0  # only an info finding is left
    assert run(capsys, "doctor", path, "--select", "TT2")[:2] == (0, "")  # runtime rules only: nothing static


# --------------------------------------------------------------------------- pyproject.toml


def _project(tmp_path: Path, table: str) -> Path:
    write(tmp_path, "pyproject.toml", f"[project]\nname = 'demo'\n\n[tool.torch-tricks.doctor]\n{table}\n")
    write(tmp_path, "src/train.py", ERROR + "state = torch.load('f.pt')\n")  # TT113 error, TT110, TT111
    write(tmp_path, "src/generated/old.py", "import torch\ntorch.set_deterministic(True)\n")  # TT118 error
    return tmp_path / "src"


def test_pyproject_table_selects_ignores_excludes_and_sets_fail_on(capsys, tmp_path):
    src = _project(tmp_path, 'ignore = ["TT113", "TT11"]\nexclude = ["generated"]\nfail-on = "error"')
    code, out, err = run(capsys, "doctor", src)
    assert (code, out) == (0, "") and "in 1 file(s)" in err  # everything ignored, generated/ excluded
    src = _project(tmp_path, 'select = ["TT11", "hygiene"]\nignore = ["TT113", "TT118"]\nfail-on = "error"')
    code, out, _ = run(capsys, "doctor", src)
    found = sorted((Path(m["path"]).name, m["rule"]) for m in map(_LINE.match, out.splitlines()))
    assert found == [("train.py", "TT110"), ("train.py", "TT111")]
    assert code == 0  # a warning, but the project fails only on errors
    assert run(capsys, "doctor", src, "--fail-on", "warning")[0] == 1  # the flag wins over the config
    code, out, _ = run(capsys, "doctor", src, "--select", "TT113,TT118", "--ignore", "TT110")  # flags replace lists
    assert {m["rule"] for m in map(_LINE.match, out.splitlines())} == {"TT113", "TT118"} and code == 1


def test_bad_pyproject_table_exits_2_naming_the_file(capsys, tmp_path):
    src = _project(tmp_path, 'ignore = ["TT999"]')
    code, out, err = run(capsys, "doctor", src)
    assert code == 2 and out == ""
    assert "TT999" in err and "pyproject.toml" in err


# --------------------------------------------------------------------------- --json and --format sarif


def test_json_output(capsys, tmp_path):
    write(tmp_path, "broken.py", "def f(:\n")
    bad = write(tmp_path, "bad.py", ERROR)
    code, out, _ = run(capsys, "doctor", tmp_path, "--json")
    data = json.loads(out)
    assert code == data["exit_code"] == 1
    assert data["files"] == 2 and data["fail_on"] == "warning"
    (finding,) = data["findings"]
    assert finding == {"rule": "TT113", "message": finding["message"], "path": str(bad), "line": 3, "col": 1,
                       "severity": "error"}
    (unreadable,) = data["unreadable"]
    assert unreadable["path"].endswith("broken.py") and "does not parse" in unreadable["reason"]
    again = json.loads(run(capsys, "doctor", tmp_path, "--format", "json")[1])  # --json is --format json
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in data.items() if k != "seconds"}


def test_sarif_output_validates_against_the_schema(capsys, tmp_path):
    write(tmp_path, "broken.py", "def f(:\n")
    code, out, _ = run(capsys, "doctor", MIXED_POS, CORPUS / "TT104", tmp_path, "--format", "sarif", "--select",
                       "hygiene")
    log = json.loads(out)
    validate_sarif(log)
    assert code == 1
    run_ = log["runs"][0]
    rules = run_["tool"]["driver"]["rules"]
    want = markers(MIXED_POS) | {(r, n) for p in (CORPUS / "TT104").glob("pos_*.py") for r, n in markers(p)}
    assert len(run_["results"]) == len(want)
    for res in run_["results"]:
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"]
        assert res["level"] in ("note", "warning", "error")
        region = res["locations"][0]["physicalLocation"]["region"]
        assert region["startLine"] >= 1 and region["startColumn"] >= 1
    (note,) = run_["invocations"][0]["toolExecutionNotifications"]
    assert run_["invocations"][0]["executionSuccessful"] is True
    assert note["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].endswith("broken.py")
    # a clean run is a valid log with no results, and exit 0
    code, out, _ = run(capsys, "doctor", MIXED_NEG, "--format", "sarif")
    log = json.loads(out)
    validate_sarif(log)
    assert code == 0 and log["runs"][0]["results"] == [] and "invocations" not in log["runs"][0]


# --------------------------------------------------------------------------- runtime mode (--model)

BUGGY = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Buggy(nn.Module):
    """A plain-list block, an unused layer and a log-softmax head."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.blocks = [nn.Linear(32, 32)]
        self.unused = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        for block in self.blocks:
            x = torch.relu(block(x))
        return F.log_softmax(self.head(x), dim=1)


def build():
    return Buggy()
'''


@pytest.fixture
def buggy(tmp_path, monkeypatch):
    write(tmp_path, "doctor_buggy_net.py", BUGGY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return "doctor_buggy_net:build"


def test_runtime_reports_plain_list_unused_layer_and_log_softmax_head(capsys, buggy):
    code, out, _ = run(capsys, "doctor", "--model", buggy, "--input", "16", "--steps", "1")
    assert code == 1
    found = re.findall(r"^(TT2\d\d) +(\w+) +(\S+): ", out, re.MULTILINE)
    assert sorted((r, p) for r, _, p in found) == [("TT201", "unused"), ("TT203", "blocks"), ("TT207", "(model)")]
    assert "3 findings (1 error, 2 warnings)" in out
    code, out, _ = run(capsys, "doctor", "--model", buggy, "--input", "16", "--steps", "1", "--json")
    data = json.loads(out)
    assert code == data["exit_code"] == 1 and data["loss_fn"] == "cross-entropy"
    assert {(f["rule"], f["path"]) for f in data["findings"]} == {
        ("TT201", "unused"), ("TT203", "blocks"), ("TT207", "(model)")}
    assert data["parameters_without_grad"] == ["unused.weight", "unused.bias"]


def test_runtime_sarif_fail_on_and_ignore(capsys, buggy):
    code, out, _ = run(capsys, "doctor", "--model", buggy, "--input", "16", "--steps", "1", "--format", "sarif")
    log = json.loads(out)
    validate_sarif(log)
    assert code == 1 and sorted(r["ruleId"] for r in log["runs"][0]["results"]) == ["TT201", "TT203", "TT207"]
    where = {r["ruleId"]: r["locations"] for r in log["runs"][0]["results"]}
    assert where["TT203"] == [{"logicalLocations": [{"fullyQualifiedName": "blocks", "kind": "module"}]}]
    assert all("physicalLocation" not in loc for locs in where.values() for loc in locs)  # modules, not files
    base = ("doctor", "--model", buggy, "--input", "16", "--steps", "1")
    assert run(capsys, *base, "--ignore", "TT203", "--fail-on", "error")[0] == 0  # only warnings left
    code, out, _ = run(capsys, *base, "--ignore", "TT2")
    assert code == 0 and "no findings" in out


def test_runtime_honours_the_pyproject_table_of_the_current_folder(capsys, buggy, tmp_path):
    write(tmp_path, "pyproject.toml", '[tool.torch-tricks.doctor]\nignore = ["TT201", "TT207"]\nfail-on = "error"\n')
    code, out, _ = run(capsys, "doctor", "--model", buggy, "--input", "16", "--steps", "1")
    assert code == 1 and re.findall(r"^(TT2\d\d) ", out, re.MULTILINE) == ["TT203"]


def test_runtime_wrong_input_is_one_line_exit_2(capsys, buggy):
    code, out, err = run(capsys, "doctor", "--model", buggy, "--input", "3x4")
    assert code == 2 and out == ""
    assert "fc1" in err and len(err.strip().splitlines()) == 1


def test_runtime_on_builtin_resnet18_with_a_proper_loss_reports_nothing(capsys):
    code, out, _ = run(capsys, "doctor", "--model", "resnet18", "--input", "3x32x32", "--steps", "2",
                       "--optimizer", "adamw", "--weight-decay", "0.05", "--json")
    data = json.loads(out)
    assert code == 0 and data["exit_code"] == 0
    assert data["findings"] == [] and data["ok"] and data["completed"]
    assert data["memory"] is not None and data["memory"]["leaking"] is False  # the growth check ran
    assert data["target"].startswith("generated class indices (8,)") and data["loss_fn"] == "cross-entropy"


# -- named inputs and the shared --loss names (issue 13) --------------------------------------------

BERT = ("--model", "hf:bert", "--hf-config",
        "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,vocab_size=100")


def test_runtime_on_a_transformers_model_with_named_inputs(capsys, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    named = ("--input", "input_ids=long:12:100", "--input", "attention_mask=ones:12")
    code, out, err = run(capsys, "doctor", *BERT, *named, "--steps", "1", "--json")
    data = json.loads(out)
    assert code == data["exit_code"] and data["completed"], err
    assert data["inputs"] == "input_ids=(8, 12) int64, attention_mask=(8, 12) int64"
    assert data["loss_fn"] == "cross-entropy" and data["target"].startswith("generated next-token targets (8, 12)")
    assert not [f for f in data["findings"] if f["rule"] in ("TT207", "TT210")]
    code, out, _ = run(capsys, "doctor", *BERT, *named, "--steps", "1", "--loss", "nll")
    assert code == 1 and re.search(r"^TT207 +error +cls\.predictions\.decoder: NLLLoss gets raw logits", out, re.M)
    assert "loss (nll) " in out
    code, out, err = run(capsys, "doctor", *BERT, "--input", "input_ids=long:12:100", "--input", "mask=ones:12")
    assert code == 2 and out == "" and "forward takes no input named 'mask'" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("loss, shown", [("auto", "cross-entropy"), ("ce", "cross-entropy"),
                                         ("cross-entropy", "cross-entropy"), ("none", "none")])
def test_runtime_loss_names_shared_with_the_other_commands(capsys, buggy, loss, shown):
    code, out, _ = run(capsys, "doctor", "--model", buggy, "--input", "16", "--steps", "1", "--loss", loss, "--json")
    data = json.loads(out)
    assert data["loss_fn"] == shown and data["completed"]
    assert ("TT207" in {f["rule"] for f in data["findings"]}) == (shown == "cross-entropy")


def test_static_linting_list_and_explain_do_not_import_torch(tmp_path):
    """Reading code needs no torch (1 s of a 1.4 s start-up): the parser, the static rules and the runtime
    rules' declarations load without it."""
    import subprocess
    import sys

    write(tmp_path, "bad.py", ERROR)
    probe = ("import sys, contextlib, io\nfrom torch_tricks.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
             f"    codes = [main(['doctor', {str(tmp_path)!r}]), main(['doctor', '--list']),"
             " main(['doctor', '--explain', 'TT201']), main(['doctor', '--select', 'TT2', "
             f"{str(tmp_path)!r}])]\n"
             "print(codes, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[1,", "0,", "0,", "0]", "False"], r.stdout


def test_pre_commit_hooks_run_the_doctor_as_pre_commit_would(tmp_path):
    """Each hook of .pre-commit-hooks.yaml is what pre-commit runs: its entry, split on spaces, plus the
    staged file names; a finding at the hook's level fails it, clean files pass."""
    import shlex
    import shutil
    import subprocess
    import sys

    import yaml

    hooks = {h["id"]: h for h in yaml.safe_load((Path(__file__).parent.parent / ".pre-commit-hooks.yaml").read_text())}
    assert set(hooks) == {"torch-tricks-doctor", "torch-tricks-doctor-errors"}
    exe = shutil.which("torch-tricks") or str(Path(sys.executable).parent / "torch-tricks")
    bad, fine = write(tmp_path, "bad.py", ERROR), write(tmp_path, "fine.py", "x = 1\n")
    for hook in hooks.values():
        assert hook["language"] == "system" and hook["types"] == ["python"]
        argv = shlex.split(hook["entry"])
        assert argv[0] == "torch-tricks"
        run_ = lambda *files: subprocess.run([exe, *argv[1:], *map(str, files)], capture_output=True, text=True)
        assert run_(bad, fine).returncode == 1  # TT113 is an error: both hooks fail
        assert run_(fine).returncode == 0


def test_the_printed_runtime_report_is_the_reports_to_text(capsys, buggy, monkeypatch):
    """A Python user gets the very text the CLI prints: RuntimeReport.to_text with the findings the CLI
    kept (after --ignore and the config) and the optimizer it named."""
    from torch_tricks.doctor import runtime
    from torch_tricks.doctor.static import filter_findings

    made, real = [], runtime.check_model
    monkeypatch.setattr(runtime, "check_model", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    code, out, _ = run(capsys, "doctor", "--model", buggy, "--input", "16", "--steps", "1", "--ignore", "TT201")
    assert code == 1 and "2 findings (1 error, 1 warning)" in out
    assert out == made[-1].to_text(buggy, None, filter_findings(made[-1].findings, ignore=["TT201"])) + "\n"
    code, out, _ = run(capsys, "doctor", "--model", buggy, "--input", "16", "--steps", "1", "--optimizer", "adamw")
    assert code == 1 and "optimizer adamw" in out and out == made[-1].to_text(buggy, "adamw") + "\n"


def test_lint_summary_counts_findings_as_the_runtime_report_does(capsys, tmp_path):
    from torch_tricks.doctor.registry import findings_count
    from torch_tricks.doctor.static import lint_paths

    path = write(tmp_path, "mixed.py", ERROR + "state = torch.load('f.pt', map_location='cpu')\n")
    code, _, err = run(capsys, "doctor", path)
    assert code == 1
    assert err.startswith(findings_count(lint_paths([path]).findings) + " in 1 file(s), ")
