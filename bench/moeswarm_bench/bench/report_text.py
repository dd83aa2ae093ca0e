"""The words of docs/bench.md: setup, tables, and findings computed from the measured rows.

Every claim on the page is a number from the rows, so a re-run rewrites the verdicts with it.
"""

from __future__ import annotations


def _pct(new: float, old: float) -> float:
    return 100 * (new - old) / old


def _petals(rows: list[dict], rtt_ms: float, bandwidth_bps: float, wire: str) -> dict:
    return next(r for r in rows if r["scenario"] == "petals" and r["link"] == "wan" and r["rtt_ms"] == rtt_ms
                and r["bandwidth_bps"] == bandwidth_bps and r["wire"] == wire)


def findings(result: dict) -> list[str]:
    rows, meta = result["rows"], result["meta"]
    layers, out = meta["moe_layers"], []
    wires = sorted({r["wire"] for r in rows if r["scenario"] == "petals" and r["link"] == "wan"})
    fast, slow = (_petals(rows, rtt, 1e9, "exact-f32") for rtt in (1.0, 100.0))
    local = next(r for r in rows if r["scenario"] == "petals" and r["link"] == "local")
    holds = slow["overhead_ratio"] <= 1.25
    out.append(
        f"**Latency dominates: {'holds' if holds else 'does not hold'}.** Going from 1 ms to 100 ms RTT (exact f32, "
        f"1 gbit/s) takes decoding from {fast['steps_per_s']:.3g} to {slow['steps_per_s']:.3g} steps/s "
        f"({fast['steps_per_s'] / slow['steps_per_s']:.3g}x slower; Petals measured 1.24 -> 0.57, 2.2x, with far more "
        f"compute per step than this small model has). At 100 ms a step takes {1e3 * slow['step_s']:.0f} ms against "
        f"{slow['round_trips_ms']:.0f} ms of round trips ({layers} MoE layers x 100 ms): {slow['overhead_ratio']:.3f}x the "
        f"floor, so steps/s is within {100 * (slow['overhead_ratio'] - 1):.0f}% of 1 / (MoE layers x RTT). Local, with no "
        f"network, runs {local['steps_per_s']:.3g} steps/s.")
    changes = {(rtt, wire): _pct(_petals(rows, rtt, 1e8, wire)["steps_per_s"], _petals(rows, rtt, 1e9, wire)["steps_per_s"])
               for rtt in (1.0, 100.0) for wire in wires}
    worst = max(abs(v) for (rtt, _), v in changes.items() if rtt == 100.0)
    text = ", ".join(f"{v:+.1f}% ({wire}, {rtt:g} ms)" for (rtt, wire), v in changes.items())
    slow_cut = _petals(rows, 100.0, 1e8, "exact-f32")
    # What the cap itself should cost: each link carries ~1/workers of a layer's bytes, out then back.
    per_link_bytes = (slow["bytes_out_per_token_layer"] + slow["bytes_in_per_token_layer"]) / meta["workers"]
    link_ms = layers * per_link_bytes * 8 * (1 / 1e8 - 1 / 1e9) * 1e3
    out.append(
        "**A 10x bandwidth cut (1 gbit/s -> 100 mbit/s per link) changes steps/s by only a few percent: "
        + ("holds" if worst < 5 else "not in this run's numbers") + f"** (largest change at 100 ms: {worst:.1f}%). "
        f"Changes: {text}. In exact f32 a decode step moves {per_link_bytes:.0f} B per link per MoE layer (hidden size "
        f"{meta['hidden_size']}), so the cut should add {link_ms:.2f} ms to a {1e3 * slow['step_s']:.0f} ms step at "
        f"100 ms ({100 * link_ms / (1e3 * slow['step_s']):.2f}%), with the reduced wire or without it. Changes beyond "
        f"that are the shared machine's drift between configurations (the configurations are interleaved and every "
        f"other repeat reversed to spread it; the 1 ms rows, with steps ten times shorter, show it most). Where "
        f"bandwidth does show is the prefill ({slow['prompt_tokens']} tokens in one forward): {slow['prefill_s']:.3f} s "
        f"at 1 gbit/s, {slow_cut['prefill_s']:.3f} s at 100 mbit/s ({_pct(slow_cut['prefill_s'], slow['prefill_s']):+.0f}%, "
        f"exact f32, 100 ms, last repeat).")
    fanout = {(r["fanout"], r["tokens_per_step"]): r for r in rows if r["scenario"] == "fanout"}
    widths = sorted({width for _, width in fanout})
    if fanout:
        slopes = {w: (fanout["chain", w]["layer_call_ms"] - fanout["star", w]["layer_call_ms"])
                  / (fanout["chain", w]["expected_layer_ms"] - fanout["star", w]["expected_layer_ms"]) for w in widths}
        parts = [f"{name} at {w} token(s)/step: {r['layer_call_ms']:.1f} ms per layer call vs {r['expected_layer_ms']:.1f} ms "
                 f"expected (+{r['layer_call_ms'] - r['expected_layer_ms']:.1f} ms; {r['workers_per_call']:.2f} of "
                 f"{meta['workers']} workers reached)" for (name, w), r in fanout.items()]
        ok = all(abs(slope - 1) < 0.2 for slope in slopes.values())
        out.append(
            f"**Star time per layer tracks the max RTT, chain tracks the sum: {'holds' if ok else 'does not hold'}.** "
            f"The expected time of a layer call is the max (star) or the sum (chain) of the RTTs of the workers the call "
            f"actually reached (a token reaches only the workers holding its top-k experts; nominal 80 and 200 ms need "
            f"all 4). " + "; ".join(parts) + ". Chain minus star, measured over expected: "
            + ", ".join(f"{slopes[w]:.2f} at {w} token(s)/step" for w in widths)
            + ": the difference is the RTTs, while each call also pays a fixed cost on top (the workers' compute and the "
              "machinery, larger with more tokens).")
    verify = next((r for r in rows if r.get("prompt") == "verify-cost"), None)
    spec = [r for r in rows if r["scenario"] == "speculation" and r.get("speculate") and r["prompt"] != "verify-cost"]
    if verify and spec:
        parts = [f"{r['prompt']}: {r['tokens_per_step']:.2f} tokens/step ({r['accepted']}/{r['drafted']} drafts accepted), "
                 f"{r['speedup_vs_plain']:.2f}x plain decode" for r in spec]
        out.append(
            f"**Speculation at {verify['rtt_ms']:g} ms.** A {verify['speculate'] + 1}-token verify step took "
            f"{1e3 * verify['step_verify_s']:.0f} ms against {1e3 * verify['step_1_token_s']:.0f} ms for one token, so "
            f"the break-even is {verify['break_even_tokens_per_step']:.3f} tokens per step (the brief: ~1.15-1.2)"
            + (": with this model the verify step costs little extra because the round trips dominate, so almost any "
               "accepted draft is a win. " if verify["break_even_tokens_per_step"] < 1.1 else ". ") + "; ".join(parts) + ". Output tokens are identical with and without speculation "
            f"({'all' if all(r['tokens_match_plain'] for r in spec) else 'NOT all'} rows).")
    beyond = [r for r in rows if r.get("beyond_round_trips_ms") is not None]
    direct = next(r for r in rows if r["scenario"] == "petals" and r["link"] == "direct" and r["wire"] == "exact-f32")
    if beyond:
        high = [r for r in beyond if r["round_trip_ms"] >= 20]
        out.append(
            f"**The limit line.** Beyond its round trips a step spends {min(r['beyond_round_trips_ms'] for r in high):.1f}-"
            f"{max(r['beyond_round_trips_ms'] for r in high):.1f} ms at RTTs of 20 ms and more (overhead ratio "
            f"{min(r['overhead_ratio'] for r in high):.3f}-{max(r['overhead_ratio'] for r in high):.3f}): the backbone's own "
            f"forward, the workers' expert compute, framing and codecs, and the proxy's ~0.3-0.7 ms per crossing "
            f"(docs/wan.md). At 1 ms RTT the same fixed cost is several times the round trips, which is why the ratio "
            f"there is far above 1. Without any proxy (`direct`, loopback) a step takes {1e3 * direct['step_s']:.1f} ms "
            f"against {1e3 * local['step_s']:.1f} ms local: the remote machinery itself costs "
            f"{1e3 * (direct['step_s'] - local['step_s']) / layers:.1f} ms per MoE layer here, most of it waking "
            f"{meta['workers']} worker processes, the backbone and the proxy thread on {meta['cpu_count']} shared cores "
            f"(a bare PING to a worker over the same loopback took {direct['ping_ms']:.2f} ms).")
    return out


def render(result: dict, tables: dict[str, str]) -> str:
    meta = result["meta"]
    trained = "models/pymoe/hf" in meta["model"]
    model = ("the bundled trained model `models/pymoe/hf`" if trained else
             f"`{meta['model']}`, a tiny random {meta['model_type']} (the trained model was not there when this ran)")
    lines = [
        "# Benchmarks: decoding over emulated WAN links",
        "",
        f"Regenerate this page (tables, plots, `docs/bench/wan.json`): `{meta['command']}`. "
        "`moeswarm bench wan --json` prints the same rows as one JSON object `{\"meta\": ..., \"rows\": [...]}`; "
        "`python -m moeswarm_bench.bench.report docs/bench/wan.json` re-renders the page from saved rows.",
        "",
        "## Setup",
        "",
        f"- **Model**: {model}; {meta['model_type']}, {meta['moe_layers']} MoE layers, hidden size {meta['hidden_size']}.",
        f"- **Machine**: {meta['cpu_count']} CPU cores ({meta['cpu']}, {meta['platform']}), shared with other jobs "
        f"(load average {meta['load_average_before']} before, {meta['load_average_after']} after the run); Python "
        f"{meta['python']}, torch {meta['torch']} (CPU, 1 thread per process), transformers {meta['transformers']}. "
        f"Run on {meta['date']}, {meta['seconds']:.0f} s. Timings on a shared {meta['cpu_count']}-core machine are noisy: read "
        f"differences of a few percent as noise.",
        "- **Links are emulated**, not real: every worker sits behind its own moeswarm userspace WAN proxy "
        "(`bench/moeswarm_bench/wan/`, docs/wan.md), one link per worker with its own bandwidth cap per direction, no jitter, "
        "no loss. The proxies run in one asyncio thread of the backbone's process (`bench/moeswarm_bench/bench/wan_links.py`). "
        "The \"<5 ms\" rows are the proxy at **1 ms** RTT; `direct` rows connect to the workers on loopback with no proxy.",
        f"- **Workers**: {meta['workers']} `moeswarm worker` processes on this machine, experts split evenly; star "
        f"fan-out unless a row says chain. A step is one forward after a prefill of {meta['prompts']['non_repetitive']} "
        f"tokens; step time is the median over {meta['steps_per_config']} steps x {meta['repeats']} repeat(s), the "
        f"configurations interleaved. Wires: `exact-f32` (per-expert outputs, lossless, bit-identical to local) and "
        f"`wan-int8` (`moeswarm.wire.defaults.WAN`: partial sums, int8 blockwise both ways).",
        "- **Flags**: `--quick` (the smoke test's form) runs 3 steps x 1 repeat per configuration, 8-token forwards "
        "for star/chain and 8 new tokens for speculation; the full run 8 steps x 3 repeats, 16-token forwards and 24 "
        "new tokens. `--out-json FILE` saves the rows; `--model DIR` picks another model.",
        "",
        "## Findings",
        "",
        *[f"- {text}" for text in findings(result)],
        "",
        "## a. Steps/s by RTT and bandwidth (the Petals table)",
        "",
        tables["petals"],
        "",
        "![steps/s](bench/petals.png)",
        "",
        "## b. Star vs chain (links at 20/40/60/80 ms, exact f32)",
        "",
        tables["fanout"],
        "",
        "![star vs chain and the limit line](bench/fanout_limit.png)",
        "",
        f"## c. Speculation (n-gram prompt lookup, up to {meta['speculate']} drafts, all links at 80 ms)",
        "",
        f"Prompts: the most (`repetitive`) and least (`non_repetitive`) repetitive held-out code prompts of "
        f"models/pymoe/prompts.jsonl by their rep3 score ({meta['prompts']['repetitive']} and "
        f"{meta['prompts']['non_repetitive']} tokens), {meta['new_tokens']} new tokens each, greedy. tokens/step counts "
        f"the tokens after the prefill's. Break-even: the tokens per step at which a speculative step's time per token "
        f"equals a plain step's (speculative step time / plain step time).",
        "",
        tables["speculation"],
        "",
        "Verify cost, measured directly at a fixed context:",
        "",
        tables["verify"],
        "",
        "![speculation](bench/speculation.png)",
        "",
        "## d. The limit line",
        "",
        "For every networked row: overhead ratio = step time / (MoE layers that needed a remote trip x RTT), and what the "
        "step spends beyond those round trips. For star/chain rows the RTT is the expected time per layer (max or sum of "
        "the reached workers' RTTs).",
        "",
        tables["limit"],
        "",
    ]
    return "\n".join(lines)
