"""`moeswarm bench serve` from end to end: the model chosen (the bundled one, a given one, or 'real': the
OLMoE-shaped file of `bench real`), the load measured (serve_load.py), docs/serve.md written (serve_report.py)."""

from __future__ import annotations

from collections.abc import Callable

from moeswarm_bench.bench.serve_load import WORKERS, run_serve_bench, table_lines
from moeswarm_bench.bench.serve_report import write_serve_report

__all__ = ["run_serve", "table_lines"]  # table_lines: the text the command prints

REAL_WORKERS = 2  # the real-dimension file's experts on fewer, larger workers


def run_serve(model: str, workers: int | None, quick: bool, max_tokens: int | None, show: Callable[[dict], None],
              clients: tuple[int, ...] | None, speculate: tuple[int, ...], threads: int, groups: tuple[int, ...],
              command: str, report: bool = False) -> dict:
    """The serve benchmark's {prefix_cache, meta, rows}; `show` receives each row as it is measured."""
    if model == "real":
        from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
        from moeswarm_bench.bench.real_shapes import SHAPES

        model, workers = str(model_file(SHAPES["olmoe"], DEFAULT_CACHE)), workers or REAL_WORKERS
    result = run_serve_bench(model, quick, max_tokens, show, clients, speculate, threads, groups,
                             workers or WORKERS, command)
    if report:
        write_serve_report(result)
    return result
