"""docs/bench-islands.md and its plot from `moeswarm bench islands --json`'s result."""

from __future__ import annotations

import json
from pathlib import Path

from moeswarm_bench.bench.markdown import markdown_table as table, write_page

DOCS = Path(__file__).resolve().parents[3] / "docs"


def write_report(result: dict, command: str, docs: Path = DOCS) -> Path:
    (docs / "bench").mkdir(parents=True, exist_ok=True)
    (docs / "bench" / "islands.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, docs / "bench" / "islands.png")
    rows = [[r["topology"], f"{r['rtt_ms']:g}", r["speculate"], f"{r['ms_per_token']:.0f}", f"{r['tokens_per_step']:.2f}",
             r["one_way_trips_per_step"], f"{r['prefill_s']:.2f}", "yes" if r["tokens_equal_local"] else "no"]
            for r in result["rows"]]
    targets = [[t["target"], f"{t['measured']:.3g}", "yes" if t["met"] else "no"] for t in result["targets"]]
    split = [[s["islands"], f"{s['rtt_ms']:g}", s["speculate"], f"{s['islands_ms']:.0f}", f"{s['split_ms']:.0f}",
              f"{s['ratio']:.2f}"] for s in result.get("against_split", [])]
    text = f"""# Islands against a star over the WAN (`moeswarm bench islands`)

Measured with `{command}`: the OLMoE-1B-7B-shaped Q4_K_M file of `moeswarm bench real` ({result['layers']}
layers, hidden 2048, 64 experts of 1024, top-8), a {result['prompt_tokens']}-token prompt, {result['decode_tokens']}
greedy tokens, with and without suffix drafts (up to {result['speculate']} per step). Rows: [bench/islands.json](bench/islands.json).

- **star**: this process holds every layer's trunk; 2 workers (half the experts of every layer each)
  behind emulated links: each MoE layer of a step is one round trip over the WAN (2 one-way trips).
- **N stages**: N `moeswarm stage` processes, each a contiguous span of layers with one worker holding
  all of that span's experts next to it on loopback (the LAN); this process is the gateway
  (embeddings, head, sampling, drafts). Each stage's address is behind its own emulated link, so
  gateway -> stage 1 -> ... -> stage N -> gateway crosses N + 1 one-way links per step.
- **N-way split**: the same N stages, each holding its span's experts itself (no workers): a pure
  layer split (Petals', prima.cpp's shape) over the same links. Islands pay their layer calls on
  the LAN for what they buy: no stage has to hold its span's experts.
- **local**: the whole model in this process: the compute time every figure is over.
- Threads: {result.get('island_threads', 1)} in this process (local, the star's backbone, the gateway),
  each stage and each island's worker; one in each of the star's 2 workers, which compute at once.
  With one sequence only one process of a chain computes at a time; the machine has 2 cores, so
  the 4-stage chain (9 processes) still competes for them. `tokens = local`: the greedy tokens
  equal the local run's.

{table(["topology", "RTT ms", "drafts", "ms/token", "tokens/step", "one-way WAN trips/step", "prompt s", "tokens = local"], rows)}

Each chain of islands beside the layer split of the same spans (same links, same drafts):

{table(["islands", "RTT ms", "drafts", "islands ms/token", "layer split ms/token", "islands / split"], split)}

Issue 25's targets (no drafts):

{table(["target", "measured", "met"], targets)}

![ms per token by RTT](bench/islands.png)
"""
    return write_page(docs / "bench-islands.md", text)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    names = sorted({r["topology"] for r in result["rows"] if r["topology"] != "local"}, key=lambda n: (n != "star", n))
    for name in names:
        points = sorted((r["rtt_ms"], r["ms_per_token"]) for r in result["rows"] if r["topology"] == name and r["speculate"] == 0)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    axis.set_xlabel("RTT of each emulated link (ms)")
    axis.set_ylabel("decode ms per token (no drafts)")
    axis.set_yscale("log")
    axis.legend()
    axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
