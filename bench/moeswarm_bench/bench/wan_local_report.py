"""The local-experts and overlap section of docs/bench.md: tables, a plot, the words around them.

Rows come from `moeswarm bench wan --scenarios local` (bench/wan_local.py); with none of them in
a result, every function here returns nothing.
"""

from __future__ import annotations

from pathlib import Path

from moeswarm_bench.bench import markdown


def _of(rows: list[dict], scenario: str) -> list[dict]:
    return [r for r in rows if r["scenario"] == scenario]


def markdown_table(headers: list[str], lines: list[list]) -> str:
    return markdown.markdown_table(headers, lines, booleans=("on", "off"))


def tables(rows: list[dict]) -> dict[str, str]:
    local, overlap, curve = _of(rows, "local"), _of(rows, "overlap"), _of(rows, "local_curve")
    if not local and not overlap:
        return {}
    out = {}
    if local:
        out["local"] = markdown_table(
            ["experts local", "per layer", "trip share", "round trips/step", "step ms", "steps/s", "vs 0 % local"],
            [[f"{r['local_percent']} %", r["local_experts_per_layer"], r["trip_share"], r["round_trips_per_step"],
              1e3 * r["step_s"], r["steps_per_s"], r["speedup_vs_none_local"]] for r in local])
    if curve:
        out["local_curve"] = markdown_table(
            ["experts local"] + [f"{r['local_percent']} %" for r in curve],
            [["trip share"] + [r["trip_share"] for r in curve]])
    if overlap:
        out["overlap"] = markdown_table(
            ["RTT ms", "experts local", "shared expert during the trip", "step ms", "steps/s", "gain (off / on)",
             "most gain (shared expert's time hidden)"],
            [[r["rtt_ms"], f"{r['local_percent']} %", r["overlap"], 1e3 * r["step_s"], r["steps_per_s"],
              r["gain_vs_no_overlap"] if r["overlap"] else None, r.get("most_gain") if r["overlap"] else None]
             for r in overlap])
    large = _of(rows, "overlap_large")
    if large:
        out["overlap_large"] = markdown_table(
            ["RTT ms", "shared expert during the trip", "step ms", "steps/s", "gain (off / on)",
             "most gain (shared expert's time hidden)"],
            [[r["rtt_ms"], r["overlap"], 1e3 * r["step_s"], r["steps_per_s"],
              r["gain_vs_no_overlap"] if r["overlap"] else None, r["most_gain"] if r["overlap"] else None]
             for r in large])
    return out


def plots(rows: list[dict], out_dir: Path) -> list[str]:
    local, curve = _of(rows, "local"), _of(rows, "local_curve")
    if not local:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    if curve:
        axes[0].plot([r["local_percent"] for r in curve], [r["trip_share"] for r in curve], "o-", label="offline (local decode)")
    axes[0].plot([r["local_percent"] for r in local], [r["trip_share"] for r in local], "s", label="measured (80 ms run)")
    axes[0].set_xlabel("% of each layer's experts on the backbone (hottest by profile)")
    axes[0].set_ylabel("share of decode (token, layer) pairs that travel")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    axes[1].bar([f"{r['local_percent']} %" for r in local], [r["steps_per_s"] for r in local])
    axes[1].set_ylabel("decode steps/s at 80 ms")
    axes[1].set_xlabel("experts local")
    figure.suptitle("Hot experts on the backbone")
    figure.tight_layout()
    name = "local_experts.png"
    figure.savefig(out_dir / name, dpi=110)
    plt.close(figure)
    return [name]


def section(result: dict) -> str:
    """Markdown appended to docs/bench.md ("" without local rows)."""
    rows, meta = result["rows"], result["meta"]
    found = tables(rows)
    if not found:
        return ""
    local = _of(rows, "local")
    command = meta.get("runs", {}).get("local", meta.get("command", "moeswarm bench wan"))
    lines = ["", "## e. Hot experts on the backbone, and the shared expert during the trip", "",
             f"Measured by `{command}` (add `--report` to rewrite this section; the other sections' rows stay). "
             "Timings on the shared 2-core machine are noisy (see Setup); the trip shares are not: they are counts.", ""]
    if local:
        first = local[0]
        lines += [
            f"`--local-experts P%` holds each MoE layer's hottest experts (the most routing weight in a profile of "
            f"{first['calibration_prompts']} bundled prompts, the measured prompt left out) in the backbone. A layer's "
            f"trip is skipped only when every routed expert of the step's rows is local; otherwise only the rows with a "
            f"remote expert travel. All 4 workers at {first['rtt_ms']:g} ms, exact f32, greedy decode after a "
            f"{first['prompt_tokens']}-token prefill; bit-identical to local eager in every row (tests/test_local_experts.py).",
            "", found["local"], ""]
        doubled = [r for r in local if r["speedup_vs_none_local"] >= 2]
        lines += ["Holding experts pays only once a decode row's whole top-k tends to be local: "
                  + (f"steps/s at {first['rtt_ms']:g} ms first double at {doubled[0]['local_percent']} % local "
                     f"({doubled[0]['steps_per_s']:.3g} against {first['steps_per_s']:.3g}), with that share of every "
                     f"layer's expert weights in the backbone's memory; below it the trip share barely moves."
                     if doubled else "no measured share doubles the steps/s."), ""]
    if "local_curve" in found:
        lines += ["The same share with no network, for every tenth: the routing of a local greedy decode "
                  f"({_of(rows, 'local_curve')[0]['decode_steps']} steps) against each layer's hottest experts:", "",
                  found["local_curve"], ""]
    if local:
        lines += ["![local experts](bench/local_experts.png)", ""]
    if "overlap" in found:
        bound = _of(rows, "overlap")[0].get("shared_expert_ms_per_step")
        cost = (f"One decode row through every block's shared expert takes {bound:.3g} ms, measured alone. Overlap "
                f"hides, per layer, at most the shorter of the shared expert's time and the trip's (the layer call with "
                f"overlap off): \"most gain\" is the step time off over the step time off less that. "
                if bound is not None else "")
        lines += ["The shared expert computed while the layer's trip is in flight (model/overlap.py), against "
                  "computed where the block calls it; on and off take turns step by step on the same swarm, bit-identical "
                  "either way (tests/test_overlap.py). " + cost + "Measured gains within a few percent of 1 are noise.",
                  "", found["overlap"], ""]
    if "overlap_large" in found:
        large = _of(rows, "overlap_large")[0]
        shape = large["model_shape"]
        lines += [f"The bundled model's shared expert is tiny. With a real one (Qwen1.5-MoE-A2.7B's: hidden "
                  f"{shape['hidden_size']}, shared expert {shape['shared_expert_intermediate_size']} wide, f32) in a "
                  f"random {large['moe_layers']}-layer qwen2_moe on 2 workers behind the same links, one row through "
                  f"its shared experts takes "
                  f"{large['shared_expert_ms_per_step']:.3g} ms per step here, alone:", "", found["overlap_large"], "",
                  "Over a long trip the backbone waits on the network, and the shared expert fills that wait: the "
                  "measured gain follows the bound. Over a 1 ms link the trip is mostly the workers' own compute, which "
                  "here runs on the same 2 cores as the backbone (and the other jobs on the machine): computing the "
                  "shared expert meanwhile takes the same cores, so little or nothing is hidden. With workers on other "
                  "machines, their compute would overlap the shared expert's too, and the LAN gain approach its bound.",
                  ""]
    return "\n".join(lines)
