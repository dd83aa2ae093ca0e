"""The drafts section of docs/bench.md: its tables, a plot and the words around them.

Rows come from `moeswarm bench wan --scenarios drafts` (bench/wan_drafts.py); with none of them in
a result, every function here returns nothing.
"""

from __future__ import annotations

from pathlib import Path

from moeswarm_bench.bench.markdown import markdown_table


def _of(rows: list[dict], scenario: str) -> list[dict]:
    return [r for r in rows if r["scenario"] == scenario]


def _name(row: dict) -> str:
    return "baseline (0 % local, plain)" if row["drafter"] == "baseline" else row["drafter"]


def _drafting(row: dict) -> float | None:
    return None if row["drafter"] in ("none", "baseline") else row["draft_ms_per_step"]


def tables(rows: list[dict]) -> dict[str, str]:
    drafts, token_time = _of(rows, "drafts"), _of(rows, "drafts_token_time")
    out = {}
    if drafts:
        out["drafts"] = markdown_table(
            ["drafter", "tokens / verify step", "branches / step", "accepted / drafted (kept branch)", "drafting ms / step",
             "step ms (with drafting)", "decode tokens/s", "vs plain (25 % local)", "vs baseline", "same tokens as plain"],
            [[_name(r), r["tokens_per_step"], r.get("branches_per_step", 1.0), f"{r['accepted']} / {r['drafted']}", _drafting(r),
              1e3 * r["step_s"], r["decode_tokens_per_s"], r["speedup_vs_plain"], r["speedup_vs_baseline"],
              "yes" if r["tokens_match_plain"] else "NO"] for r in drafts])
    if token_time:
        out["drafts_token_time"] = markdown_table(
            ["drafter", "ms / token", "limit ((MoE layers / 2) x RTT)", "below it", "tokens / verify step",
             "branches / step", "drafting ms / step"],
            [[_name(r), r["ms_per_token"], r["token_time_limit_ms"], "yes" if r["ms_per_token"] < r["token_time_limit_ms"] else "no",
              r["tokens_per_step"], r.get("branches_per_step", 1.0), _drafting(r)] for r in token_time])
    return out


def plots(rows: list[dict], out_dir: Path) -> list[str]:
    drafts = _of(rows, "drafts")
    if not drafts:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["drafter"] for r in drafts]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [r["tokens_per_step"] for r in drafts])
    axes[0].axhline(2.0, color="grey", linestyle="--", linewidth=1, label="goal: 2 tokens per verify step")
    axes[0].set_ylabel("decode tokens per verify step")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [r["decode_tokens_per_s"] for r in drafts])
    axes[1].set_ylabel(f"decode tokens/s at {drafts[0]['rtt_ms']:g} ms")
    for axis in axes:
        axis.set_xlabel("drafter")
    local = max(r["local_percent"] for r in drafts)  # the drafters' swarm (the baseline holds none)
    figure.suptitle(f"Drafts at {drafts[0]['rtt_ms']:g} ms, {local} % of experts local (baseline: none, plain decode)")
    figure.tight_layout()
    name = "drafts.png"
    figure.savefig(out_dir / name, dpi=110)
    plt.close(figure)
    return [name]


def _findings(drafts: list[dict]) -> list[str]:
    by = {r["drafter"]: r for r in drafts}
    lines = []
    for name in ("local", "both"):
        if name in by:
            r = by[name]
            verdict = "reached" if r["tokens_per_step"] >= 2.0 else "not reached"
            lines.append(f"- **{name}**: {r['tokens_per_step']:.2f} tokens per verify step (goal at "
                         f"{r['local_percent']} % local: 2.0, {verdict}), {r['draft_ms_per_step']:.0f} ms drafting per "
                         f"step, {r['decode_tokens_per_s']:.2f} decode tokens/s ({r['speedup_vs_baseline']:.2f}x the "
                         f"baseline's plain decode).")
    if "ngram" in by:
        r = by["ngram"]
        faster = [n for n in ("local", "both") if n in by and by[n]["decode_tokens_per_s"] > r["decode_tokens_per_s"]]
        lines.append(f"- **ngram**: {r['tokens_per_step']:.2f} tokens per verify step, {r['decode_tokens_per_s']:.2f} "
                     f"decode tokens/s ({r['speedup_vs_baseline']:.2f}x the baseline): "
                     + (f"slower than {' and '.join(faster)} in this run." if faster else "the fastest drafter in this run."))
    return lines


def section(rows: list[dict]) -> str:
    """Markdown appended to docs/bench.md ("" without drafts rows)."""
    found = tables(rows)
    if not found:
        return ""
    lines = ["", "## f. Drafts from local experts (self-speculation)", ""]
    drafts = _of(rows, "drafts")
    if drafts:
        first = drafts[0]
        lines += [
            f"`generate --speculate K --draft ngram|local|both`. With `local`, the backbone drafts by running the model "
            f"with only the experts it holds ({first['local_experts_per_layer']} of each layer's experts, those with the "
            f"most routing weight in a profile of {first['calibration_prompts']} bundled prompts that are not measured "
            f"here), the other experts dropped and the kept routing weights scaled back to the top-k total: no round trip "
            f"while drafting. A greedy step verifies several drafts side by side, one row each, in one remote forward "
            f"(generation/branches.py), and keeps the branch accepted longest: `ngram` the continuations of up to 3 "
            f"earlier occurrences of the context's last n-gram, `local` the local model's 2 best first tokens each "
            f"continued greedily to the cap ({first['draft_cap']}), `both` all of these. Every drafter decodes "
            f"{first['prompts']} held-out prompts greedily, all 4 workers at {first['rtt_ms']:g} ms, exact f32; the "
            f"tokens equal plain decode's in every row (the verify rule; tests/test_local_drafts.py also checks every "
            f"verified forward against local eager, torch.equal). Run {first.get('date', '')}: timings on the shared "
            f"2-core machine are noisy (load average {first.get('load_average_before', '-')} before, "
            f"{first.get('load_average_after', '-')} after; drafting is the backbone's own compute, so load inflates it "
            f"most).", "", found["drafts"], "", "![drafts](bench/drafts.png)", "", *_findings(drafts), ""]
    if "drafts_token_time" in found:
        token_time = _of(rows, "drafts_token_time")
        lines += [f"Time per token at {token_time[0]['rtt_ms']:g} ms on the least repetitive prompt, against "
                  f"(MoE layers / 2) x RTT = {token_time[0]['token_time_limit_ms']:g} ms:", "", found["drafts_token_time"], ""]
    return "\n".join(lines)
