"""`moeswarm bench real` from end to end: the shapes measured (real_measure.py), docs/bench-real.md
written (real_report.py)."""

from __future__ import annotations

from pathlib import Path

from moeswarm.errors import MoeSwarmError
from moeswarm_bench.bench.real_build import DEFAULT_CACHE
from moeswarm_bench.bench.real_measure import run_bench_real
from moeswarm_bench.bench.real_report import table_lines, write_report
from moeswarm_bench.bench.real_shapes import DEFAULT_SHAPES

__all__ = ["run_real", "table_lines"]  # table_lines: the text the command prints


def run_real(shapes: tuple[str, ...] | None, cache_dir: str | None, threads: int, repeats: int, quick: bool,
             report: bool = False) -> dict:
    """{meta, rows} of `run_bench_real` (default shapes and cache when None), its meta naming the command."""
    if quick and shapes:
        raise MoeSwarmError("--quick measures its own tiny model: give --shapes or --quick, not both")
    shapes = shapes or DEFAULT_SHAPES
    cache = Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE
    result = run_bench_real(shapes, cache, threads, repeats, quick)
    flags = ["--quick" if quick else f"--shapes {','.join(shapes)}", f"--threads {threads}", f"--repeats {repeats}"]
    result["meta"]["command"] = " ".join(["moeswarm bench real", *flags])
    if report:
        write_report(result)
    return result
