"""Plain-text tables and human-readable numbers for the CLI (no dependency needed)."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["si", "human_bytes", "table", "shape_str"]


def si(n: float | None, unit: str = "") -> str:
    """``4_089_184_256 -> '4.09 G'`` (decimal prefixes, as MACs/FLOPs are quoted)."""
    if n is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip() if float(n).is_integer() else f"{n:.2f} {unit}".rstrip()


def human_bytes(n: float | None) -> str:
    """Binary prefixes: ``1536 -> '1.5 KiB'``."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for factor, prefix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= factor:
            return f"{sign}{n / factor:.1f} {prefix}"
    return f"{sign}{n:.0f} B"


def shape_str(shapes: Any) -> str:
    """Compact shapes: ``(1, 64, 56, 56)`` -> ``[1, 64, 56, 56]``; nested outputs kept nested."""
    if shapes is None:
        return "-"
    if isinstance(shapes, dict):
        return "{" + ", ".join(f"{k}: {shape_str(v)}" for k, v in shapes.items()) + "}"
    if not isinstance(shapes, (tuple, list)):
        return str(shapes)
    if all(isinstance(d, int) for d in shapes):
        return "[" + ", ".join(map(str, shapes)) + "]"
    return "(" + ", ".join(shape_str(s) for s in shapes) + ")"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A fixed-width table; ``align`` has one ``l``/``r`` per column (default: first left)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = _widths(headers, cells)
    align = align or "l" + "r" * (len(headers) - 1)

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(list(headers)), rule, *(fmt(r) for r in cells)])


def _widths(headers: Sequence[str], cells: list[list[str]]) -> list[int]:
    """Each column's width: its widest cell, header included."""
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    return widths
