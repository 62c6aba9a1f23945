"""How the report writes its figures and texts: the formatting shared by its views and files."""

from __future__ import annotations

import json
import math
from typing import Any

from torch_tricks._format import human_bytes
from torch_tricks.tuning.result import Result

# The ways to use a tune's result, shown in tricks.toml's header and report.md.
HOW_TO_APPLY = """\
use it: torch-tricks train --config tricks.toml     or     fit(model, data, config="tricks.toml")
or keep your own loop:
    tricks = torch_tricks.Tricks("tricks.toml")
    model, optimizer = tricks.prepare(model, optimizer)   # or tricks.prepare(model): the config's optimizer
    for batch in loader:
        batch = tricks.to_device(batch)                    # the config's device (auto: CUDA where there is one)
        with tricks.autocast():
            loss = model(**batch).loss                     # or loss_fn(model(x), y)
        tricks.backward(loss)
        tricks.step()
"""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _measured(x: float | None) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def _with_advice(text: str, advice: str) -> str:
    """``text`` and what would change it, unless the text says so already (a skip reason "...: raise it")."""
    said = advice in text or ("--budget-seconds" in advice and "--budget-seconds" in text and "raise" in text)
    return f"{text}; what would change it: {advice}" if advice and not said else text


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def _speedup(r: Result) -> str:
    if r.speedup is None:
        return ""
    return f"{r.speedup:.2f}x{_plus_minus(r.speedup_half_ci)}"


def _plus_minus(half: float | None) -> str:
    """' ±0.05' for a finite half-interval, else ''."""
    return f" ±{half:.2f}" if _finite_number(half) else ""


def _finite_number(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _fmt_s(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return ""
    return f"{s * 1e3:.1f} ms"


def _bytes(n: float | None) -> str:
    return human_bytes(n) if n is not None else ""


def _bound_text(r: Result) -> str:
    """', not at N' where a larger batch was run and did not fit, else ', larger not run'."""
    if r.max_batch_bound is not None:
        return f", not at {r.max_batch_bound}"
    return ", larger not run"

