"""docs/bench.md and its plots from a `moeswarm bench wan` result ({"meta": ..., "rows": [...]}).

    moeswarm bench wan --report                     # measure, then write docs/bench.md + docs/bench/*.png
    python -m moeswarm_bench.bench.report docs/bench/wan.json   # re-render from the saved rows
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moeswarm_bench.bench import report_text, wan_drafts_report, wan_local_report, wan_placement_report
from moeswarm_bench.bench.markdown import markdown_table
from moeswarm.bundled import REPO

DOCS = REPO / "docs"


def _of(rows: list[dict], scenario: str) -> list[dict]:
    return [r for r in rows if r["scenario"] == scenario]


def _bandwidth(bps: float | None) -> str:
    return "-" if bps is None else (f"{bps / 1e9:g} gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} mbit/s")


def tables(result: dict) -> dict[str, str]:
    """The report's tables, by name, in markdown."""
    rows = result["rows"]
    petals = markdown_table(
        ["link", "RTT ms", "bandwidth / link", "wire", "steps/s", "step ms", "ping ms", "prefill s", "B out/tok/layer", "B in/tok/layer"],
        [[r["link"], r["rtt_ms"], _bandwidth(r["bandwidth_bps"]), r["wire"], r["steps_per_s"], 1e3 * r["step_s"],
          r.get("ping_ms"), r["prefill_s"], r.get("bytes_out_per_token_layer"), r.get("bytes_in_per_token_layer")]
         for r in _of(rows, "petals")])
    fanout = markdown_table(
        ["fan-out", "tokens/step", "workers reached / layer", "ms per layer call", "expected ms (max or sum of reached RTTs)",
         "measured / expected", "nominal ms (80 or 200)", "step ms"],
        [[r["fanout"], r["tokens_per_step"], r["workers_per_call"], r["layer_call_ms"], r["expected_layer_ms"],
          r["layer_call_over_expected"], r["nominal_layer_ms"], 1e3 * r["step_s"]] for r in _of(rows, "fanout")])
    spec_rows = [r for r in _of(rows, "speculation") if r["prompt"] != "verify-cost"]
    speculation = markdown_table(
        ["prompt", "speculate", "tokens", "steps", "accepted/drafted", "tokens/step", "step ms", "decode tokens/s",
         "break-even tokens/step", "speed-up", "same tokens as plain"],
        [[r["prompt"], r["speculate"], r["new_tokens"], r["steps"], f"{r['accepted']}/{r['drafted']}", r["tokens_per_step"],
          1e3 * r["step_s"], r["decode_tokens_per_s"], r["break_even_tokens_per_step"] if r["speculate"] else None,
          r["speedup_vs_plain"], r["tokens_match_plain"]] for r in spec_rows])
    verify = markdown_table(
        ["forward", "step ms (median)"],
        [["1 token", 1e3 * r["step_1_token_s"]] for r in _of(rows, "speculation") if r["prompt"] == "verify-cost"]
        + [[f"{r['speculate'] + 1} tokens (verify)", 1e3 * r["step_verify_s"]] for r in rows if r.get("prompt") == "verify-cost"]
        + [["break-even tokens/step", r["break_even_tokens_per_step"]] for r in rows if r.get("prompt") == "verify-cost"])
    limit = markdown_table(
        ["scenario", "configuration", "remote layers/step", "round trip ms", "step ms", "layers x RTT ms", "overhead ratio", "beyond round trips ms"],
        [[r["scenario"], label(r), r["remote_layers_per_step"], r["round_trip_ms"], 1e3 * r["step_s"], r["round_trips_ms"],
          r["overhead_ratio"], r["beyond_round_trips_ms"]] for r in rows if r.get("overhead_ratio") is not None])
    return {"petals": petals, "fanout": fanout, "speculation": speculation, "verify": verify, "limit": limit}


def label(row: dict) -> str:
    if "label" in row:  # a registered scenario's rows name themselves
        return row["label"]
    if row["scenario"] == "petals":
        return f"{row['rtt_ms']:g} ms, {_bandwidth(row['bandwidth_bps'])}, {row['wire']}"
    if row["scenario"] == "fanout":
        return f"{row['fanout']}, {row['tokens_per_step']} tok/step"
    return f"{row['prompt']}, speculate={row['speculate']}"


def table_lines(result: dict) -> list[str]:
    """The text `moeswarm bench wan` prints: a line on the run, then every table under its heading."""
    meta = result["meta"]
    lines = [f"model {meta['model']} ({meta['model_type']}, {meta['moe_layers']} MoE layers), {meta['workers']} workers, "
             f"{meta['seconds']:.0f} s"]
    for named in (tables(result), wan_local_report.tables(result["rows"]), wan_drafts_report.tables(result["rows"]),
                  wan_placement_report.tables(result["rows"])):
        lines += [f"\n## {name}\n{table}" for name, table in named.items()]
    return lines


def plots(result: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, names = result["rows"], []
    out_dir.mkdir(parents=True, exist_ok=True)

    petals = [r for r in _of(rows, "petals") if r["link"] == "wan"]
    figure, axis = plt.subplots(figsize=(7.5, 4))
    groups = sorted({(r["rtt_ms"], -r["bandwidth_bps"]) for r in petals})
    wires = sorted({r["wire"] for r in petals})
    for offset, wire in enumerate(wires):
        values = [next(r["steps_per_s"] for r in petals if (r["rtt_ms"], -r["bandwidth_bps"]) == g and r["wire"] == wire) for g in groups]
        axis.bar([i + 0.38 * offset for i in range(len(groups))], values, 0.38, label=wire)
    for r in _of(rows, "petals"):
        if r["link"] != "wan":
            axis.axhline(r["steps_per_s"], ls="--" if r["link"] == "local" else ":", lw=1, color="grey" if r["link"] == "local" else "black")
            axis.annotate(f"{r['link']} {r['wire'] if r['link'] != 'local' else ''}", (len(groups) - 0.6, r["steps_per_s"]), fontsize=7)
    axis.set_xticks([i + 0.19 for i in range(len(groups))], [f"RTT {g[0]:g} ms\n{_bandwidth(-g[1])}" for g in groups])
    axis.set_yscale("log")
    axis.set_ylabel("decode steps/s (log)")
    axis.set_title("Decode steps/s over emulated links (4 workers, star)")
    axis.legend(fontsize=8)
    names.append(_save(figure, out_dir / "petals.png"))

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in _of(rows, "fanout"):
        marker = "o" if r["fanout"] == "star" else "s"
        axes[0].scatter(r["expected_layer_ms"], r["layer_call_ms"], marker=marker, label=f"{r['fanout']}, {r['tokens_per_step']} tok/step")
    top = max(max(r["expected_layer_ms"], r["layer_call_ms"]) for r in _of(rows, "fanout")) * 1.1
    axes[0].plot([0, top], [0, top], "k:", lw=1, label="measured = expected")
    axes[0].set_xlabel("expected ms per layer: max (star) / sum (chain) of reached RTTs")
    axes[0].set_ylabel("measured ms per MoE layer call")
    axes[0].set_title("Star vs chain, links 20/40/60/80 ms")
    axes[0].legend(fontsize=7)
    limit = [r for r in rows if r.get("round_trips_ms")]
    for scenario, marker in (("petals", "o"), ("fanout", "s"), ("speculation", "^")):
        points = [r for r in limit if r["scenario"] == scenario]
        axes[1].scatter([r["round_trips_ms"] for r in points], [1e3 * r["step_s"] for r in points], marker=marker, label=scenario)
    top = max(1e3 * r["step_s"] for r in limit) * 1.1
    axes[1].plot([0.1, top], [0.1, top], "k:", lw=1, label="step = layers x RTT")
    axes[1].set_xscale("log"), axes[1].set_yscale("log")
    axes[1].set_xlabel("remote MoE layers per step x RTT (ms)")
    axes[1].set_ylabel("measured ms per step")
    axes[1].set_title("The limit line")
    axes[1].legend(fontsize=7)
    names.append(_save(figure, out_dir / "fanout_limit.png"))

    spec = [r for r in _of(rows, "speculation") if r["prompt"] != "verify-cost"]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    prompts = list(dict.fromkeys(r["prompt"] for r in spec))
    for offset, speculate in enumerate(sorted({r["speculate"] for r in spec})):
        picked = [next(r for r in spec if r["prompt"] == p and r["speculate"] == speculate) for p in prompts]
        xs = [i + 0.38 * offset for i in range(len(prompts))]
        axes[0].bar(xs, [r["decode_tokens_per_s"] for r in picked], 0.38, label=f"speculate={speculate}")
        axes[1].bar(xs, [r["tokens_per_step"] for r in picked], 0.38, label=f"speculate={speculate}")
    for r in spec:
        if r["speculate"]:
            i = prompts.index(r["prompt"])
            axes[1].hlines(r["break_even_tokens_per_step"], i - 0.2, i + 0.6, colors="red", lw=2)
    axes[1].plot([], [], color="red", label="break-even (measured step costs)")
    for axis, ylabel in zip(axes, ("decode tokens/s", "tokens per step")):
        axis.set_xticks([i + 0.19 for i in range(len(prompts))], prompts)
        axis.set_ylabel(ylabel)
        axis.legend(fontsize=8, loc="lower center")
    figure.suptitle(f"n-gram prompt lookup at {spec[0]['rtt_ms']:g} ms RTT")
    names.append(_save(figure, out_dir / "speculation.png"))
    return names


def _save(figure, path: Path) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path.name


def write_report(result: dict, docs: Path = DOCS) -> Path:
    out_dir = docs / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    result = merged(result, out_dir / "wan.json")
    (out_dir / "wan.json").write_text(json.dumps(result, indent=1) + "\n")
    plots(result, out_dir)
    wan_local_report.plots(result["rows"], out_dir)
    wan_drafts_report.plots(result["rows"], out_dir)
    wan_placement_report.plots(result["rows"], out_dir)
    page = docs / "bench.md"
    page.write_text(report_text.render(result, tables(result)) + wan_local_report.section(result)
                    + wan_drafts_report.section(result["rows"]) + wan_placement_report.section(result["rows"]))
    return page


def merged(result: dict, saved: Path) -> dict:
    """A run of some scenarios (`--scenarios`) over the saved rows: its rows replace those of the
    scenarios it ran, the others' stay (each scenario's setup is in its own section)."""
    ran = set(result["meta"].get("scenarios") or ())
    if not saved.is_file() or not ran:
        return result
    old = json.loads(saved.read_text())
    kept = [r for r in old["rows"] if r.get("group", r["scenario"]) not in ran]
    if not kept:
        return result
    runs = {**old["meta"].get("runs", {}), **{name: result["meta"]["command"] for name in ran}}
    meta = {**old["meta"], "runs": runs, "scenarios": sorted({r.get("group", r["scenario"]) for r in kept} | ran)}
    return {"meta": meta, "rows": kept + result["rows"]}


if __name__ == "__main__":
    write_report(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else DOCS / "bench" / "wan.json").read_text()))
