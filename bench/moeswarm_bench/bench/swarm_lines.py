"""What `moeswarm bench swarm` prints without --json: per N, a line per join and per kill, the
stream's line, then issue 59's targets."""

from __future__ import annotations


def table_lines(result: dict) -> list[str]:
    """What the command prints: per N, a line per join and per kill, the stream, the targets."""
    lines = [f"model {result['model']['name']}: {result['model']['experts']} experts x {result['model']['moe_layers']} "
             f"MoE layers, {result['model']['expert_bytes']} bytes per expert; host {result['host']['cpu']} "
             f"({result['host']['cpu_count']} CPUs, load {result['host']['load_1min']['mean']:.1f})"]
    for run in result["runs"]:
        lines.append(f"{run['joiners']} joiners, {run['experts_each']} experts each:")
        for j in run["joins"]:
            lines.append(f"  join {j['joiner']}: share {j['share_s']:.1f} s, fetched {j['fetched_s']:.1f} s, serving "
                         f"{j['announced_s']:.1f} s; {j['fetched_bytes']} bytes for a share of {j['share_bytes']} "
                         f"({j['fetched_over_share']:.3f}x)")
        for e in run["kills"]:
            r = e["rejoin"]
            lines.append(f"  kill {e['kill']} ({e['joiner']}): dropped after {e['dropped_s']:.1f} s, fewest holders "
                         f"{e['after_kill']['fewest']} (alive {e['alive_fewest_after_kill']}); rejoined serving "
                         f"{r['announced_s']:.1f} s after its start ({'reused its slice' if r['reused'] else str(r['slice_bytes']) + ' bytes fetched'}); "
                         f"coverage {'back after ' + format(e['restored_s'], '.1f') + ' s' if e['restored'] else 'NOT back'} "
                         f"(fewest {e['after_rejoin']['fewest']}); {e['moves']} moves; stream "
                         f"{_rate(e['tokens_per_s'])} tokens/s, longest pause {e['longest_pause_s']:.2f} s")
        s = run["stream"]
        rates = ", ".join(f"{name} {_rate(w['tokens_per_s'])}" for name, w in s["windows"].items())
        lines.append(f"  stream: {s['tokens']} tokens in {s['segments']} segments, {s['segments_equal']} equal to the "
                     f"local run; tokens/s {rates}; {len(s['failures'])} failed segments; rebalancing moves "
                     f"{run['moves']}; resilience {s['resilience']}")
    lines += [f"target ({t['joiners']} joiners): {t['target']}: {t['measured']} ({'met' if t['met'] else 'NOT met'})"
              for t in result["targets"]]
    return lines


def _rate(value) -> str:
    return "-" if value is None else f"{value:.1f}"
