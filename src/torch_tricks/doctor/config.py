"""``[tool.torch-tricks.doctor]`` settings from the nearest ``pyproject.toml``.

A project records once which doctor rules it wants (``select``/``ignore``), which
severity fails CI (``fail-on``) and which paths to skip (``exclude``), so every run of
``torch-tricks doctor`` — local or in CI — judges the code the same way::

    [tool.torch-tricks.doctor]
    select = ["TT1"]            # rule ids or prefixes; default: every rule
    ignore = ["TT121"]
    fail-on = "error"          # info | warning | error; default: warning
    exclude = ["build", "tests/fixtures/*"]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from torch_tricks.doctor.registry import SEVERITIES, check_rule_codes
from torch_tricks.errors import UserError

__all__ = ["DoctorConfig", "load_config", "TABLE"]

TABLE = "[tool.torch-tricks.doctor]"
_KEYS = ("select", "ignore", "fail-on", "exclude")


@dataclass(frozen=True)
class DoctorConfig:
    """What a project asks of the doctor; the defaults check everything and fail on warnings."""

    select: tuple[str, ...] | None = None  # rule ids or id prefixes; None = all
    ignore: tuple[str, ...] = ()
    fail_on: str = "warning"
    exclude: tuple[str, ...] = ()  # glob patterns, relative to the pyproject's folder
    path: Path | None = None  # the pyproject.toml read, if any

    @property
    def root(self) -> Path:
        """The folder ``exclude`` patterns are relative to."""
        return self.path.parent if self.path is not None else Path.cwd()


def load_config(start: Path | str) -> DoctorConfig:
    """The doctor settings of the nearest ``pyproject.toml`` at or above ``start``.

    The nearest ``pyproject.toml`` marks the project: if it has no doctor table the
    defaults apply (no search further up). A key, value or rule id that is not
    understood is a :class:`UserError` naming the file, so a typo never silently
    switches a check off.
    """
    start = Path(start).resolve()
    folder = start if start.is_dir() else start.parent
    for candidate in (folder, *folder.parents):
        pyproject = candidate / "pyproject.toml"
        if pyproject.is_file():
            return _parse(pyproject)
    return DoctorConfig()


def _parse(pyproject: Path) -> DoctorConfig:
    table = _read_toml(pyproject).get("tool", {}).get("torch-tricks", {}).get("doctor")
    if table is None:
        return DoctorConfig(path=pyproject)
    where = f"{TABLE} in {pyproject}"
    _check_keys(table, where)
    select = table.get("select")
    if select is not None:
        select = check_rule_codes(_strings(select, "select", where), f"select of {where}")
    ignore = check_rule_codes(_strings(table.get("ignore", []), "ignore", where), f"ignore of {where}")
    fail_on = table.get("fail-on", "warning")
    if fail_on not in SEVERITIES:
        raise UserError(f"fail-on = {fail_on!r} in {where}: use one of {', '.join(SEVERITIES)}")
    exclude = _strings(table.get("exclude", []), "exclude", where)
    return DoctorConfig(select=select, ignore=ignore, fail_on=fail_on, exclude=exclude, path=pyproject)


def _read_toml(pyproject: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{pyproject}: cannot read it as TOML ({str(exc).splitlines()[0]}): fix the file") from None


def _check_keys(table, where: str) -> None:
    """``table`` is a table of known keys, else a :class:`UserError`."""
    if not isinstance(table, dict):
        raise UserError(f"{where} must be a table of keys ({', '.join(_KEYS)})")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise UserError(f"unknown key {unknown[0]!r} in {where}: use {', '.join(_KEYS)}")


def _strings(value, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{key} in {where} must be a list of strings, e.g. {key} = [\"TT101\"]")
    return tuple(value)
