"""docs/bench-drafters.md: `moeswarm bench drafters --rtts ... --report`'s page, from its result."""

from __future__ import annotations

from pathlib import Path

from moeswarm_bench.bench.drafters_wan import table_lines

PAGE = Path("docs/bench-drafters.md")


def write_report(result: dict, host: str, page: Path = PAGE) -> Path:
    meta = result["meta"]
    rows = result["rows"]
    lines = [
        "# Speculation sized by the network: `moeswarm bench drafters --rtts`",
        "",
        "Written by `" + meta["command"] + " --report`; see docs/drafts.md for the rule.",
        "",
        f"Each configuration ran {meta.get('repeats', 1)} time(s) per cell, the configurations taking turns; "
        "a row is the run with the median ms/token.",
        "",
        f"Model: `{meta['model']}` ({meta['layers']} layers); host: {host}; {meta['tokens']} tokens per run, "
        f"{meta['threads']} thread(s) per process, every remote process (the star's workers, the islands' stages) "
        "behind an emulated link (`moeswarm wan`'s proxy). `default`: speculate unset, the goodput rule under "
        f"{meta['auto_speculate']} suffix drafts; `off`: --speculate 0; `K=k`: up to k drafts every step "
        "(--speculate-policy fixed). ms/token: decode time per token after the first.",
        "",
        "## Per cell: the default against off and the best fixed K",
        "",
        "```",
        *table_lines(result),
        "```",
        "",
        "## Every run",
        "",
        "| topology | RTT ms | workload | config | ms/token | tokens/step | mean K | drafted | accepted |",
        "|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['topology']} | {r['rtt_ms']:g} | {r['workload']} | {r['config']} | {r['ms_per_token']:.1f} | "
          f"{r['tokens_per_step']:.2f} | {r['mean_k']:.2f} | {r['drafted']} | {r['accepted']} |" for r in rows],
        "",
    ]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines))
    return page
