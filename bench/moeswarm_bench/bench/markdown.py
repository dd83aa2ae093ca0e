"""Markdown for the benchmark pages (docs/bench.md and its sections): tables, and pages whose
hand-written notes survive a new report."""

from __future__ import annotations

from pathlib import Path

# What follows this line in a report's page is written by hand (runs on other hosts, what was tried):
# `write_page` keeps it when a new report replaces the rest.
NOTES = "<!-- notes: written by hand, kept by --report -->"


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


def write_page(path: Path, text: str) -> Path:
    """Write a report's page: `text`, then the hand-written part of the page already there (from
    NOTES on), if it has one."""
    old = path.read_text() if path.is_file() else ""
    _, marker, notes = old.partition(NOTES)
    path.write_text(text.rstrip("\n") + "\n" + (f"\n{marker}{notes}" if marker else ""))
    return path
