"""What a tune was run on, as tricks.toml's ``[model]`` table, and reading it back.

Why: the recommendation holds for the model it was measured on, and every tune report
says "apply it with ``torch-tricks train --config tricks.toml``". That command must train
that model, or say what it lacks; it cannot if the file does not name it. So the tune
writes, after ``[train]`` (which is all ``load_config`` reads)::

    [model]
    spec = "hf:gpt2"                                   # --model
    hf_config = "n_layer=2,n_embd=64,n_head=2"         # --hf-config, as given
    input = ["input_ids=long:32:256"]                  # --input as given, or the model's default
    batch = 4                                          # the tuned batch
    loss = "ce"                                        # --loss, when not auto
    device = "cpu"

A tune from Python on a model object has no spec to record: its file says so in a
comment (:data:`NOT_RECORDED`), and ``train --config`` then asks for ``--model``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torch_tricks.errors import UserError, one_line

__all__ = ["MODEL_KEYS", "NOT_RECORDED", "model_record", "model_table", "read_model_record"]

MODEL_KEYS = {"spec": str, "hf_config": str, "input": list, "batch": int, "loss": str, "device": str}
NOT_RECORDED = "# [model] not recorded: "


def model_record(spec: str, *, hf_config: str | None = None, inputs: list[str] | str | None = None,
                 batch: int | None = None, loss: str | None = None, device: str | None = None) -> dict[str, Any]:
    """The ``[model]`` table of a tune run on ``spec``: the values given (``None`` left out; loss ``auto`` too,
    it is the default)."""
    values = {"spec": spec, "hf_config": hf_config, "input": [inputs] if isinstance(inputs, str) else inputs,
              "batch": batch, "loss": None if loss == "auto" else loss, "device": device}
    return {k: (list(v) if k == "input" else v) for k, v in values.items() if v is not None}


def model_table(record: dict[str, Any] | None, name: str = "the model") -> list[str]:
    """tricks.toml's lines for ``record`` (a blank line, then ``[model]``); without a record, one comment
    saying that none was recorded (``name``: what the tune called the model)."""
    if record is None:
        return ["", f"{NOT_RECORDED}tuned from Python on {name}, which this file cannot build; "
                    "torch-tricks train --config needs --model"]
    lines = ["", "# the model the tune measured: torch-tricks train --config builds it (--model overrides)",
             "[model]"]
    return lines + [f"{k} = {_toml(v)}" for k, v in record.items()]


def read_model_record(path: str | Path) -> dict[str, Any] | None:
    """The ``[model]`` table of a config file, checked; ``None`` where it has none.

    A tune file that records no model (:data:`NOT_RECORDED`) gives ``{}``: a model was
    tuned, but the file cannot say which. An unknown key or a value of the wrong type is a
    UserError (a key is never dropped unread).
    """
    p = Path(path)
    data = _parse(p)
    table = data.get("model") if isinstance(data, dict) else None
    if table is None:
        return {} if any(line.startswith(NOT_RECORDED) for line in p.read_text().splitlines()) else None
    if not isinstance(table, dict):
        raise UserError(f"config file {str(p)!r}: [model] must be a table of {', '.join(MODEL_KEYS)}")
    for key, value in table.items():
        _check(p, key, value)
    if "spec" not in table:
        raise UserError(f"config file {str(p)!r}: [model] has no spec: name the model (spec = \"hf:gpt2\", a "
                        "built-in name or package.module:factory), or give --model")
    return dict(table)


# -- internals -------------------------------------------------------------------------------------

def _parse(p: Path) -> Any:
    """The file's data; a one-line UserError for a file that is missing or does not parse."""
    if not p.is_file():
        raise UserError(f"config file {str(p)!r} not found")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text) or {}
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        return tomllib.loads(text)
    except ImportError:
        raise UserError("YAML configs need PyYAML: pip install pyyaml (or use a .toml file)") from None
    except Exception as exc:
        raise UserError(f"config file {str(p)!r} does not parse: {one_line(exc, 10_000)}") from None


def _check(p: Path, key: str, value: Any) -> None:
    kind = MODEL_KEYS.get(key)
    if kind is None:
        raise UserError(f"config file {str(p)!r}: [model] has no key {key!r}: it takes {', '.join(MODEL_KEYS)}")
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if key == "input":
        ok = ok and bool(value) and all(isinstance(v, str) for v in value)
    if key == "batch":
        ok = ok and value >= 1
    if not ok:
        want = "a list of input specs" if key == "input" else "a positive integer" if key == "batch" else "a string"
        raise UserError(f"config file {str(p)!r}: [model] {key} = {value!r} must be {want}")


def _toml(value: Any) -> str:
    """A TOML value: an int, a string or a list of strings (JSON's string escapes are TOML's, bar DEL)."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
