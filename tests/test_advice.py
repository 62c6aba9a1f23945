"""Advice folded into one line per pattern and printed (the lines under ``torch-tricks summary``'s table);
the advisor's rules that make it are tested in test_advisor.py."""

from __future__ import annotations

import torch_tricks.inspect.advisor as advisor
from torch_tricks.inspect.advice import Advice, advice_text, group_advice


def test_advice_text_folds_patterns_and_shows_at_most_n():
    advice = [Advice("T23", "warn", f"layer.{i}.fc", f"in_features={i + 9} is not a multiple of 8") for i in range(3)]
    advice += [Advice("G2", "info", f"conv{i}", "depthwise conv") for i in range(3)]
    text = advice_text(advice, shown_at_most=2)
    assert text.splitlines()[0].startswith("advice (6 in 4 pattern(s)")
    assert "  [T23 warn] layer.*.fc (x3: layer.0.fc, layer.1.fc, layer.2.fc): in_features=9" in text
    assert text.splitlines()[-1] == "  ... 2 more (use --json for all)"
    assert text == advice_text(advice, group_advice(advice), shown_at_most=2)
    assert advice_text([]) == ""


def test_the_advisor_hands_out_the_same_advice_names():
    """Moved here from the advisor, the names stay where callers import them from."""
    assert (advisor.Advice, advisor.advice_text, advisor.group_advice) == (Advice, advice_text, group_advice)
