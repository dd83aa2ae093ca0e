"""`moeswarm bench wan` from end to end: the scenarios measured (wan_scenarios.py), the result kept as
JSON (`--out-json`) and as docs/bench.md with its plots (`--report`, report.py)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from moeswarm_bench.bench.report import table_lines, write_report
from moeswarm_bench.bench.wan_scenarios import run_wan

__all__ = ["run_wan_bench", "table_lines"]  # table_lines: the text the command prints


def run_wan_bench(model: str, quick: bool, scenarios: Collection[str] | None, command: str,
                  out_json: str | None = None, report: bool = False) -> dict:
    """{meta, rows} of `run_wan`, its meta naming `command`; written to `out_json` and, with `report`, to docs."""
    result = run_wan(model, quick=quick, scenarios=scenarios)
    result["meta"]["command"] = command
    if out_json:
        Path(out_json).write_text(json.dumps(result, indent=1) + "\n")
    if report:
        write_report(result)
    return result
