"""`moeswarm bench wan --scenarios drafts`: where speculative drafts come from, at 80 and 100 ms.

The backbone holds 25 % of each layer's experts (the hottest by a routing profile counted on the
bundled prompts that are not measured here), the 4 workers sit behind 80 ms links, exact f32.
Each drafter decodes every measured held-out prompt greedily, with up to DRAFT_CAP drafts a step:

  none   plain greedy decode (one token per forward)
  ngram  prompt lookup (generation/draft.py)
  local  the backbone with only its local experts, no round trip (generation/draft_local.py)
  both   n-gram on a match of 2+ tokens, else local (generation/drafters.py)

Per drafter, over all prompts: tokens per verify step (decode tokens / decode steps), accepted /
drafted, drafting ms per step, decode tokens/s, and whether every prompt's tokens equal plain
decode's (they must: the verify rule keeps the greedy output). A `baseline` row is today's plain
decode with no local experts. Then the per-token time of each drafter at 100 ms on the least
repetitive prompt, against (MoE layers / 2) x RTT.

Prompts of one drafter and the next are interleaved (prompt by prompt, the order reversed every
other prompt), so drifting load on a shared machine hits the drafters alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from moeswarm_bench.bench.wan_context import WanContext
from moeswarm.bundled import PROMPTS
from moeswarm.generation.result import GenerationResult
from moeswarm.engine.generate import generate
from moeswarm.model.experts import experts_modules
from moeswarm.placement.profile import hot_sets
from moeswarm.progress import progress
from moeswarm.swarm import Swarm, open_swarm


DRAFTERS = ("none", "ngram", "local", "both")
DRAFT_CAP = 6
LOCAL_PERCENT = 25
DRAFTS_RTT_S = 0.08
TOKEN_TIME_RTT_S = 0.1
MAX_PROMPTS = 4  # held-out prompts measured (quick: one)


def measured_prompts(context: WanContext) -> dict[str, list[int]]:
    """{name: token ids}: held-out prompts spread over repetitiveness (rep3); quick: the least repetitive one."""
    if context.quick:
        return {"non_repetitive": context.prompts["non_repetitive"]}
    if not PROMPTS.is_file():
        return dict(context.prompts)
    heldout = sorted((p for p in map(json.loads, filter(str.strip, PROMPTS.read_text().splitlines()))
                      if p.get("kind") == "heldout"), key=lambda p: p["rep3"])
    if len(heldout) <= MAX_PROMPTS:
        chosen = heldout
    else:
        chosen = [heldout[round(i * (len(heldout) - 1) / (MAX_PROMPTS - 1))] for i in range(MAX_PROMPTS)]
    limit = max(len(ids) for ids in context.prompts.values())
    return {p["id"]: context.codec.encode(p["text"])[:limit] for p in chosen}


def _run(swarm: Swarm, prompt: list[int], new_tokens: int, drafter: str, codec) -> GenerationResult:
    if drafter == "none":
        return generate(swarm, prompt, new_tokens, codec=codec)
    return generate(swarm, prompt, new_tokens, DRAFT_CAP, codec=codec, draft=drafter)


def _totals(results: list[GenerationResult]) -> dict:
    decode_tokens = sum(len(r.tokens) - 1 for r in results)
    steps = sum(r.steps for r in results)
    decode_s = sum(r.seconds - r.prefill_seconds for r in results)
    return {"prompts": len(results), "decode_tokens": decode_tokens, "steps": steps,
            "drafted": sum(r.drafted for r in results), "accepted": sum(r.accepted for r in results),
            "drafted_all_branches": sum(r.drafted_all for r in results),
            "branches_per_step": sum(r.branches for r in results) / steps,
            "tokens_per_step": decode_tokens / steps, "step_s": decode_s / steps,
            "draft_ms_per_step": 1e3 * sum(r.draft_seconds for r in results) / steps,
            "decode_tokens_per_s": decode_tokens / decode_s, "ms_per_token": 1e3 * decode_s / decode_tokens}


def _compare(swarms: dict[str, Swarm], prompts: dict[str, list[int]], new_tokens: int, codec,
             desc: str) -> dict[str, list[GenerationResult]]:
    """{config: results per prompt}; config "baseline" runs plain decode on the swarm with no local experts."""
    configs = ["baseline", *DRAFTERS]
    out: dict[str, list[GenerationResult]] = {c: [] for c in configs}
    for i, prompt in enumerate(progress(list(prompts.values()), desc=desc, unit="prompt")):
        for config in configs[:: 1 if i % 2 == 0 else -1]:
            swarm = swarms["none" if config == "baseline" else "local"]
            out[config].append(_run(swarm, prompt, new_tokens, "none" if config == "baseline" else config, codec))
    return out


def run_drafts(context: WanContext) -> list[dict]:
    """The drafts scenario's rows: per drafter at 80 ms, then the per-token time at 100 ms."""
    from moeswarm_bench.bench.wan_local import calibration_profile

    prompts = measured_prompts(context)
    stats, calibration_prompts = calibration_profile(dataclasses.replace(context, prompts={**context.prompts, **prompts}))
    held = hot_sets(stats, list(experts_modules(context.local_model)), LOCAL_PERCENT / 100)
    load_before, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M %Z")
    swarms: dict[str, Swarm] = {}
    try:
        swarms["none"] = open_swarm(context.model, context.links.addresses)
        swarms["local"] = open_swarm(context.model, context.links.addresses, local_experts=held)
        context.links.set_all(rtt_s=DRAFTS_RTT_S, bandwidth_bps=None)
        measured = _compare(swarms, prompts, context.new_tokens, context.codec, "drafts scenario, 80 ms")
        context.links.set_all(rtt_s=TOKEN_TIME_RTT_S, bandwidth_bps=None)
        token_time = _compare(swarms, {"non_repetitive": context.prompts["non_repetitive"]}, context.new_tokens, context.codec,
                              "drafts scenario, 100 ms")
        moe_layers = len(swarms["local"].moe_layers)
    finally:
        for swarm in swarms.values():
            swarm.close()
    per_layer = len(next(iter(held.values()), ()))
    common = {"local_percent": LOCAL_PERCENT, "local_experts_per_layer": per_layer, "draft_cap": DRAFT_CAP,
              "calibration_prompts": calibration_prompts, "moe_layers": moe_layers, "date": started,
              "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2)}
    rows = []
    for rtt_s, scenario, results in ((DRAFTS_RTT_S, "drafts", measured), (TOKEN_TIME_RTT_S, "drafts_token_time", token_time)):
        plain, baseline = _totals(results["none"]), _totals(results["baseline"])
        for config, runs in results.items():
            totals = _totals(runs)
            rows.append({"scenario": scenario, "drafter": config, "rtt_ms": 1e3 * rtt_s, "round_trip_ms": 1e3 * rtt_s,
                         **common, "local_percent": 0 if config == "baseline" else LOCAL_PERCENT,
                         "prompt_names": list(prompts) if scenario == "drafts" else ["non_repetitive"],
                         **totals, "speedup_vs_plain": totals["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                         "speedup_vs_baseline": totals["decode_tokens_per_s"] / baseline["decode_tokens_per_s"],
                         "tokens_match_plain": all(r.tokens == p.tokens for r, p in zip(runs, results["baseline"])),
                         "token_time_limit_ms": 1e3 * rtt_s * moe_layers / 2,
                         "label": f"{config}, {1e3 * rtt_s:g} ms"})
    return rows
