"""`moeswarm bench islands` from end to end: the runs (islands.py), the command they repeat, and
docs/bench-islands.md with its plot (islands_report.py)."""

from __future__ import annotations

from moeswarm_bench.bench.islands import run_islands
from moeswarm_bench.bench.islands_report import write_report


def run_islands_bench(rtts: tuple[float, ...], stages: tuple[int, ...], tokens: int, speculate: int,
                      report: bool = False) -> dict:
    """`run_islands`'s result with the command that repeats it; written to docs with `report`."""
    result = run_islands(rtts, stages, tokens, speculate)
    command = (f"moeswarm bench islands --rtts {','.join(f'{r:g}' for r in rtts)} "
               f"--stages {','.join(map(str, stages))} --tokens {tokens} --speculate {speculate}")
    result["command"] = command
    if report:
        write_report(result, command)
    return result


def table_lines(result: dict) -> list[str]:
    """The text the command prints: a line per run, then each target met or not."""
    lines = [f"{row['topology']:>11} rtt {row['rtt_ms']:>5g} ms drafts {row['speculate']}: "
             f"{row['ms_per_token']:8.0f} ms/token, {row['tokens_per_step']:.2f} tokens/step, "
             f"{row['one_way_trips_per_step']} one-way trips/step, tokens = local: {row['tokens_equal_local']}"
             for row in result["rows"]]
    lines += [f"{s['islands']:>11} rtt {s['rtt_ms']:>5g} ms drafts {s['speculate']}: {s['ratio']:.2f}x the "
              f"layer split's per-token time ({s['islands_ms']:.0f} against {s['split_ms']:.0f} ms)"
              for s in result.get("against_split", [])]
    return lines + [f"target: {target['target']}: {target['measured']:.3g} ({'met' if target['met'] else 'not met'})"
                    for target in result["targets"]]
