"""Issue 59's targets for one N of `moeswarm bench swarm`: each joiner fetches at most 1.1x its
share's bytes; no layer call fails for lack of a holder while at least one holder of every expert is
alive; the running stream's tokens stay bit-identical through every join and leave; and each kill's
coverage comes back to its level before the kill."""

from __future__ import annotations

FETCH_TARGET = 1.1


def targets(run: dict) -> list[dict]:
    """Issue 59's targets for one N."""
    count = run["joiners"]
    rows = run["joins"] + [e["rejoin"] for e in run["kills"]]
    worst = max((r["fetched_over_share"] for r in rows if not r["reused"]), default=0.0)
    stream = run["stream"]
    identical = (stream["segments"] > 0 and stream["segments_equal"] == stream["segments"]
                 and stream["last_partial_equal"] is not False and stream["logits_bit_identical"] is not False)
    return [
        {"joiners": count, "target": "each joiner fetches <= 1.1x its share's bytes", "measured": f"{worst:.3f}x (worst)",
         "met": worst <= FETCH_TARGET},
        {"joiners": count, "target": "no layer call fails while every expert has a live holder",
         "measured": f"{stream['failures_while_covered']} failed ({len(stream['failures'])} in all)",
         "met": stream["failures_while_covered"] == 0},
        {"joiners": count, "target": "the stream's tokens bit-identical through every join and leave",
         "measured": f"{stream['segments_equal']}/{stream['segments']} segments equal"
                     + ("" if stream["last_partial_equal"] is None else
                        f" (and the last, cut at {stream['last_partial_tokens']} tokens: "
                        f"{'equal' if stream['last_partial_equal'] else 'differs'})")
                     + ("" if stream["logits_bit_identical"] is None else
                        f", logits {'torch.equal' if stream['logits_bit_identical'] else 'differ'} at "
                        f"{stream['logits_checked']} positions"),
         "met": identical},
        {"joiners": count, "target": "coverage back to its level before each kill",
         "measured": f"{sum(e['restored'] for e in run['kills'])}/{len(run['kills'])} kills",
         "met": all(e["restored"] for e in run["kills"])},
    ]
