"""docs/tricks.md is generated from the trick registry and must be current (issue 17).

A trick registered without regenerating the document, or a stale document, fails here:
run ``python -m torch_tricks._docs`` to rewrite it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torch_tricks import _docs
from torch_tricks.registry import _TRICKS, list_tricks, register_trick

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / _docs.DOCS_PATH


def test_docs_tricks_md_is_the_generators_output():
    assert DOC.read_text(encoding="utf-8") == _docs.tricks_markdown(), \
        "docs/tricks.md is stale: run `python -m torch_tricks._docs`"


def test_every_registered_trick_and_id_is_documented():
    text = DOC.read_text(encoding="utf-8")
    tricks = list_tricks()
    assert len(tricks) > 30
    for t in tricks:
        assert f'<a id="{t.name}"></a>`{t.name}`' in text, t.name
        for cid in t.ids:
            assert f'<a id="{cid.lower()}"></a>{cid}' in text, cid
            assert f"[{cid}](#{cid.lower()})" in text, (t.name, cid)
        if t.measured_in:  # a benchmark a registration names exists and is linked
            assert (ROOT / t.measured_in).is_file() and f"(../{t.measured_in})" in text, t.name


def test_documented_ids_are_the_registrys():
    """doctor --explain links only ids the document explains, without importing torch."""
    assert _docs.DOCUMENTED_IDS == {cid for t in list_tricks() for cid in t.ids}
    assert _docs.doc_link("t1") == "docs/tricks.md#t1" and _docs.doc_link("T3") is None


def test_a_newly_registered_trick_makes_the_check_fail(tmp_path):
    list_tricks()  # load the real ones first
    register_trick("zz_dummy_trick", ids=("T99",), kind="train", trades="nothing, for a test")(lambda m: m)
    try:
        assert "zz_dummy_trick" in _docs.tricks_markdown()
        assert DOC.read_text(encoding="utf-8") != _docs.tricks_markdown()
        assert _docs.main(["--check", str(DOC)]) == 1
    finally:
        del _TRICKS["zz_dummy_trick"]
    assert _docs.main(["--check", str(DOC)]) == 0


def test_module_writes_and_checks_the_file(tmp_path):
    from torch_tricks._docs import main

    out = tmp_path / "tricks.md"
    assert main(["--check", str(out)]) == 1  # missing
    # the module as CI calls it (one process: the rest in this one)
    run = subprocess.run([sys.executable, "-m", "torch_tricks._docs", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert out.read_text(encoding="utf-8") == DOC.read_text(encoding="utf-8")
    assert main(["--check", str(out)]) == 0
