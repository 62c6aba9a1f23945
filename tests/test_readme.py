"""The README runs: every Python block is executed, every command line is checked.

A README that drifts from the code fails here. Python blocks run as written except for
the sizes in ``SMALL`` (a block's marker -> textual replacements), each of which must
still be found in the block, so a renamed size is a failure too, not a silent full-size
run. Shell lines: every ``torch-tricks`` line is parsed by the real argument parser (an
option the CLI lost is an error), the quick ones in ``RUN`` are run for real, and every
command's ``--help`` works; ``python benchmarks/*.py`` scripts, ``scripts/*.sh`` and
``pip`` extras named in the README exist.
"""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from torch_tricks.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)]


# marker found in a Python block -> (old, new) replacements that keep it quick on 2 cores
SMALL: dict[str, list[tuple[str, str]]] = {
    "tt.tune(": [("budget_s=120", "budget_s=4"), ("torch.randn(32, 3, 64, 64)", "torch.randn(16, 3, 32, 32)"),
                 ("(32,))", "(16,))")],
    "tt.memory_report(": [("torch.randn(8, 3, 224, 224)", "torch.randn(2, 3, 64, 64)"),
                    ("torch.randn(1, 3, 224, 224), warmup", "torch.randn(1, 3, 64, 64), warmup")],
    "tt.fit(": [("epochs=3", "epochs=1")],
    "pack_images(": [("range(64)", "range(6)"), ("(300, 400, 3)", "(120, 160, 3)"), ("resize=256", "resize=64"),
                     ("center_crop=224", "center_crop=48"), ("device_augment(224)", "device_augment(48)"),
                     ("ThreadLoader(ds, 32", "ThreadLoader(ds, 4")],
    "tt.optimize(": [('get_model("resnet18")', 'get_model("small_cnn")'), ("3, 64, 64", "1, 8, 8"),
                     ("batches=(1, 16)", "batches=(1, 2)"),
                     ("check_inputs=torch.randn(32,", "check_inputs=torch.randn(2,")],  # int8 compiles per batch size
}


def _python_blocks() -> list[tuple[str, str]]:
    out = []
    for i, code in enumerate(blocks("python")):
        marker = next((m for m in SMALL if m in code), None)
        out.append((f"block{i}-{marker or 'plain'}".replace("(", ""), code))
    return out


def test_the_readme_has_python_blocks_and_each_small_size_rule_matches_one():
    codes = [c for _, c in _python_blocks()]
    assert len(codes) >= 5
    for marker in SMALL:
        assert sum(marker in c for c in codes) == 1, f"README: no single Python block uses {marker!r}"


@pytest.mark.parametrize("code", [c for _, c in _python_blocks()], ids=[n for n, _ in _python_blocks()])
def test_python_block_runs(code, tmp_path, monkeypatch, capsys):
    for marker, rules in SMALL.items():
        if marker in code:
            for old, new in rules:
                assert old in code, f"README block with {marker!r} no longer contains {old!r}: update SMALL"
                code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<README.md block>", "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip(), "a README block should show its result"


# -- shell lines ---------------------------------------------------------------------------------

def _shell_lines() -> list[str]:
    """Lines of the bash blocks, and commands quoted inline in the prose (`torch-tricks ...`, `python ...`)."""
    lines = [m.group(1) for m in re.finditer(r"`((?:torch-tricks|python) [^`]+)`", README)]
    for block in blocks("bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment
            if line and not line.startswith("#"):
                lines.append(line)
    return [" ".join(line.split()) for line in lines]


def _cli_argv(line: str) -> list[str] | None:
    words = shlex.split(line.split("|")[0].split(">")[0])
    if words[0] == "torch-tricks":
        return words[1:]
    if words[0] == "torchrun" and "torch_tricks.cli" in words:
        return words[words.index("torch_tricks.cli") + 1:]
    return None


CLI_LINES = [line for line in _shell_lines() if _cli_argv(line) is not None]

# quick enough to run for real (a few seconds each on 2 cores); the rest are parsed and --help'd
RUN = {
    "torch-tricks models",
    "torch-tricks optimize --list-steps",
    "torch-tricks doctor --list",
    "torch-tricks doctor --explain TT101",
    "torch-tricks summary --model transformer --input long:128:1000 --batch 4",
    "torch-tricks graph --model mlp --out mlp.dot",
}


def test_every_readme_command_line_is_accounted_for():
    assert len(CLI_LINES) >= 20
    for line in RUN:
        assert line in CLI_LINES, f"README no longer has {line!r}: update RUN"
    others = [line for line in _shell_lines() if line not in CLI_LINES]
    for line in others:
        words = shlex.split(line)
        if words[0] == "bash":
            assert (ROOT / words[1]).is_file(), line
        elif words[0] == "python":
            assert (ROOT / words[1]).is_file(), line
        elif words[:2] == ["pip", "install"]:
            extras = re.findall(r"\[(\w[\w,]*)\]", line)
            defined = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            for e in ",".join(extras).split(","):
                assert not e or e in defined, f"README names the extra [{e}], pyproject.toml does not define it"
        else:
            pytest.fail(f"README shell line not checked by any test: {line!r}")


@pytest.mark.parametrize("line", CLI_LINES)
def test_readme_command_line_parses(line):
    argv = _cli_argv(line)
    if argv[-1] == "--help":
        return  # test_every_readme_command_has_help
    args = build_parser().parse_args(argv)  # argparse exits (fails the test) on an unknown option
    assert getattr(args, "func", None) is not None, line


@pytest.mark.parametrize("line", sorted(RUN))
def test_quick_readme_command_runs(line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(_cli_argv(line)) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() or any(tmp_path.iterdir())


@pytest.mark.parametrize("command", sorted({_cli_argv(line)[0] for line in CLI_LINES}))
def test_every_readme_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0 and command in capsys.readouterr().out


@pytest.mark.parametrize("script", sorted({line.split()[1] for line in _shell_lines()
                                           if line.startswith("python benchmarks/")}))
def test_readme_benchmark_scripts_answer_help(script, capsys, monkeypatch):
    """Each script loaded as a module (its main block not run) and its main asked for --help, in this process:
    a process per script would spend its time importing torch."""
    import runpy

    main_of_script = runpy.run_path(str(ROOT / script), run_name="readme_benchmark")["main"]
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exc:
        main_of_script()
    assert exc.value.code == 0 and "usage" in capsys.readouterr().out.lower()


def test_readme_doctor_config_block_is_read_by_the_doctor(tmp_path):
    from torch_tricks.doctor.config import load_config

    toml = next(b for b in blocks("toml") if "[tool.torch-tricks.doctor]" in b)
    (tmp_path / "pyproject.toml").write_text(toml)
    cfg = load_config(tmp_path)
    assert cfg.fail_on == "error" and "TT121" in cfg.ignore


def test_a_name_the_readme_uses_going_missing_fails_its_block(monkeypatch, tmp_path):
    import torch_tricks as tt

    code = next(c for c in blocks("python") if "tt.summary(" in c and "memory_report" not in c)
    exec(compile(code, "<README.md block>", "exec"), {})
    monkeypatch.delitem(tt._EXPORTS, "summary")
    monkeypatch.delitem(vars(tt), "summary", raising=False)
    with pytest.raises(AttributeError, match="summary"):
        exec(compile(code, "<README.md block>", "exec"), {})


def test_the_readme_lists_exactly_the_names_torch_tricks_exports():
    import torch_tricks as tt

    section = README[README.index("## One import"):]
    paragraph = section[section.index("`torch_tricks` gives the verbs"):section.index("\n\n", section.index("`torch_tricks` gives"))]
    listed = set(re.findall(r"`(\w+)`", paragraph)) - {"torch_tricks"}
    assert listed == set(tt.__all__) - {"__version__"}
