"""Markdown tables for the benchmark pages (docs/bench.md and its sections)."""

from __future__ import annotations


def cell(value, digits: int = 3, booleans: tuple[str, str] = ("yes", "no")) -> str:
    """One table cell: "-" for None, booleans as named, floats to `digits` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return booleans[0] if value else booleans[1]
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value)


def markdown_table(headers: list[str], lines: list[list], booleans: tuple[str, str] = ("yes", "no")) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(v, booleans=booleans) for v in line) + " |" for line in lines]
    return "\n".join(out)
