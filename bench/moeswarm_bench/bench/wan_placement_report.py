"""The placement section of docs/bench.md: a table, a plot, the words around them.

Rows come from `moeswarm bench wan --scenarios placement` (bench/wan_placement.py); with none of
them in a result, every function here returns nothing.
"""

from __future__ import annotations

from pathlib import Path

from moeswarm_bench.bench.markdown import markdown_table
from moeswarm.ids import format_ids

GOAL = -0.25  # the target: mean layer-call time at least 25 % lower than the contiguous split


def _rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["scenario"] == "placement"]


def tables(rows: list[dict]) -> dict[str, str]:
    found = _rows(rows)
    if not found:
        return {}
    return {"placement": markdown_table(
        ["placement", "replicas / layer", "expert slots / layer", "capacity / worker", "workers reached / token-layer",
         "ms per layer call", "vs contiguous", "expected ms (max reached RTT)", "calls reaching 80 ms",
         "simulated workers", "simulated ms", "decode step ms", "logits == contiguous"],
        [[r["placement"], r["replicas"], r["expert_slots_per_layer"], r["capacity"], r["workers_per_token_layer"],
          r["layer_call_ms"], f"{100 * r['layer_call_change']:+.1f} %", r["expected_layer_ms"],
          f"{100 * r['calls_reaching_farthest']:.0f} %", r["simulated_workers_per_token_layer"], r["simulated_layer_ms"],
          r["decode_step_ms"], r["logits_equal_contiguous"]] for r in found])}


def plots(rows: list[dict], out_dir: Path) -> list[str]:
    found = _rows(rows)
    if not found:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['placement']}\n{r['replicas']} replicas" for r in found]
    xs = range(len(found))
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar([x - 0.2 for x in xs], [r["layer_call_ms"] for r in found], 0.4, label="measured")
    axes[0].bar([x + 0.2 for x in xs], [r["expected_layer_ms"] for r in found], 0.4, label="max RTT of the workers reached")
    axes[0].plot(list(xs), [r["simulated_layer_ms"] for r in found], "k_", markersize=30, label="planner's simulation")
    axes[0].set_ylabel("ms per MoE layer call (decode)")
    axes[0].legend(fontsize=7)
    axes[1].bar(list(xs), [r["workers_per_token_layer"] for r in found], 0.5, label="measured")
    axes[1].plot(list(xs), [r["simulated_workers_per_token_layer"] for r in found], "k_", markersize=30,
                 label="planner's simulation")
    axes[1].set_ylabel("workers reached per token-layer")
    axes[1].legend(fontsize=7)
    for axis in axes:
        axis.set_xticks(list(xs), names, fontsize=8)
    figure.suptitle("Placement: links at " + "/".join(f"{v:g}" for v in found[0]["link_rtts_ms"]) + " ms, star")
    figure.tight_layout()
    name = "placement.png"
    figure.savefig(out_dir / name, dpi=110)
    plt.close(figure)
    return [name]


def finding(rows: list[dict]) -> str:
    """One sentence on the goal, with the numbers ("" without placement rows)."""
    found = _rows(rows)
    planned = [r for r in found if r["placement"] == "planned"]
    if not found or not planned:
        return ""
    base = found[0]
    parts = [f"{r['replicas']} replicas/layer ({r['expert_slots_per_layer']:g} expert slots vs {base['expert_slots_per_layer']:g}): "
             f"{r['layer_call_ms']:.1f} ms ({100 * r['layer_call_change']:+.1f} %), {r['workers_per_token_layer']:.2f} "
             f"workers reached" for r in planned]
    met = [r for r in planned if r["layer_call_change"] <= GOAL]
    verdict = (f"holds with {', '.join(str(r['replicas']) for r in met)} replicas per layer" if met
               else "does not hold in this run")
    return (f"**Planned placement vs contiguous split, mean layer-call time at least 25 % lower: {verdict}.** "
            f"Contiguous: {base['layer_call_ms']:.1f} ms per decode layer call, {base['workers_per_token_layer']:.2f} of "
            f"{len(base['link_rtts_ms'])} workers reached; planned with " + "; ".join(parts) + ".")


def section(rows: list[dict]) -> str:
    """Markdown appended to docs/bench.md ("" without placement rows)."""
    found = tables(rows)
    if not found:
        return ""
    placement = _rows(rows)
    first = placement[0]
    richest = max(placement, key=lambda r: r["replicas"])
    layer = min(int(key) for w in richest["plan"]["workers"] for key in w["experts"])
    held = "; ".join(f"{w['name']} ({w['rtt_ms']:g} ms): {format_ids(w['experts'].get(str(layer), []))}"
                     for w in richest["plan"]["workers"])
    lines = [
        "", "## g. Placement: hot experts near, co-selected experts together, replicas of the hottest", "",
        f"`moeswarm plan` (placement/planner.py) places each MoE layer's experts on workers by capacity and RTT from a "
        f"routing profile counted on {first['calibration_prompts']} bundled prompts (the measured ones left out): nearest "
        f"workers filled first; the experts left for the far workers chosen, from the farthest inwards, so that the "
        f"fewest tokens reach them (co-selected experts go together); the replica budget's copies to the hottest "
        f"experts, on the worker where they are most often chosen with what it alone serves. Per call the dispatcher "
        f"serves a replicated expert from the holder that keeps the call's slowest RTT lowest, preferring a worker the "
        f"call reaches anyway (placement/chooser.py). Workers at "
        + "/".join(f"{v:g}" for v in first["link_rtts_ms"]) + " ms (one WanProxy each), star, exact f32, greedy "
        f"decode of {first['decode_steps']} steps after prefills of {', '.join(map(str, first['prompt_tokens']))} "
        f"tokens; the contiguous split is the scenario runner's 4 workers, each planned placement 4 workers started "
        f"with `moeswarm worker --plan PLAN.json --plan-worker NAME`. Capacity per worker: ceil((E + replicas) / 4) "
        f"experts per layer, so total expert memory is E + the replica budget. \"Simulated\" is the planner's own "
        f"estimate (`moeswarm plan` prints it): decode rows drawn from the profile, RTTs only. "
        f"Regenerate: `moeswarm bench wan --scenarios placement --report`"
        + (f"; this run's load average {first['load_average'][0]} before, {first['load_average'][1]} after, on "
           f"cores shared with other jobs: measured ms carry that contention, the expected column does not."
           if first.get("load_average") else "."),
        "", finding(rows), "", found["placement"], "",
        f"Layer {layer} with {richest['replicas']} replicas: {held}.", "",
        "![placement](bench/placement.png)", ""]
    return "\n".join(lines)
