"""The stream's figures by window of time: tokens/s and the longest pause over a window, and the
stream's row for one N (before the first kill, through the churn, after the last rejoin's coverage
back; its failed segments, each with the coverage the live members had at that moment)."""

from __future__ import annotations

from moeswarm.discovery.follow import POLL_S
from moeswarm_bench.bench.swarm_coverage import alive_fewest

# A holder serving for less than this may not be in the backbone's pool yet: it reads the DHT every
# POLL_S, then dials and checks the HELLO. A failed call counts against the target only when every
# expert had a live holder through the whole lag before it.
FOLLOW_LAG_S = 2 * POLL_S
from moeswarm_bench.bench.swarm_model import Reference
from moeswarm_bench.bench.swarm_procs import Joiner


def stream_window(arrivals: list[tuple[float, int]], start: float, end: float) -> dict:
    """The stream's tokens/s over [start, end] and its longest wait for a token there."""
    tokens = [(t, n) for t, n in list(arrivals) if start < t <= end]
    produced = sum(n for _, n in tokens)
    times = [start] + [t for t, _ in tokens] + [end]
    return {"tokens": produced, "window_s": end - start, "tokens_per_s": produced / (end - start) if end > start else None,
            "longest_pause_s": max(b - a for a, b in zip(times, times[1:]))}


def stream_row(figures, spans: list[tuple[float, float]], joiners: list[Joiner], num_experts: int,
               reference: Reference, resilience: dict) -> dict:
    """The stream's figures: before the first kill, from it to the last rejoin's coverage back, and after."""
    first_token = figures.tokens[0][0] if figures.tokens else figures.started_at
    churn_start = spans[0][0] if spans else figures.stopped_at
    windows = {"before": stream_window(figures.tokens, first_token, churn_start)}
    if spans:
        windows["churn"] = stream_window(figures.tokens, churn_start, spans[-1][1])
        windows["after"] = stream_window(figures.tokens, spans[-1][1], figures.stopped_at)
    failures = [{"at_s": f.at - first_token, "segment": f.segment, "message": f.message,
                 "alive_fewest": alive_fewest(joiners, f.at, num_experts),
                 "alive_fewest_through_lag": _fewest_through(joiners, f.at, num_experts)} for f in figures.failures]
    return {"segment_tokens": len(reference.tokens), "segments": figures.segments, "segments_equal": figures.segments_equal,
            "last_partial_tokens": figures.last_partial, "last_partial_equal": figures.last_partial_equal,
            "first_difference": figures.first_difference, "logits_checked": figures.logits_checked,
            "logits_bit_identical": figures.logits_bit_identical,
            "tokens": sum(n for _, n in figures.tokens), "windows": windows, "failures": failures,
            "failures_while_covered": sum(f["alive_fewest_through_lag"] >= 1 for f in failures),
            "resilience": {k: v for k, v in resilience.items() if v}}


def _fewest_through(joiners: list[Joiner], when: float, num_experts: int, step_s: float = 0.25) -> int:
    """The least of `alive_fewest` over [when - FOLLOW_LAG_S, when], looked at every `step_s`."""
    looks = int(FOLLOW_LAG_S / step_s)
    return min(alive_fewest(joiners, when - i * step_s, num_experts) for i in range(looks + 1))
