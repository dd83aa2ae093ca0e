"""`moeswarm bench wan`: decode over emulated WAN links, four scenarios, rows as plain dicts.

Every scenario runs the same 4 worker processes (experts split evenly) behind one WanProxy each
(wan_links.py). A step is one forward after a prefill; a row's step time is the median over
all its steps and repeats. Scenarios:

  petals       steps/s at link RTT {1 ms, 100 ms} x bandwidth {1 gbit, 100 mbit}, for exact f32
               and the cheapest gated wire (wire.defaults.WAN); local (no network) and direct
               loopback (no proxy) as references. "<5 ms" is the proxy at 1 ms.
  fanout       star vs chain, links at 20/40/60/80 ms: time per MoE layer call against the max
               (star) or the sum (chain) of the RTTs of the workers that call reached.
  speculation  n-gram prompt lookup (speculate=K) vs plain greedy at 80 ms, on a repetitive and a
               non-repetitive prompt, and the break-even accepted tokens per step.

The limit line (`limit_line`) adds to every networked row what the step spends beyond its round
trips: overhead_ratio = step_s / (remote layers per step x round trip), beyond_round_trips_ms.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Collection

import torch

from moeswarm_bench.bench.wan_context import WanContext
from moeswarm_bench.bench.wan_links import wan_links
from moeswarm.bundled import PROMPTS
from moeswarm.engine.generate import generate
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import local_workers, split_experts
from moeswarm.model.experts import num_experts_of
from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.progress import progress
from moeswarm.swarm import Swarm, open_swarm
from moeswarm_bench.wan import LinkProfile
from moeswarm.wire.config import EXACT, WAN

WORKERS = 4
WIRES = {"exact-f32": EXACT, "wan-int8": WAN}
PETALS_RTT_S = (0.001, 0.1)
PETALS_BANDWIDTH_BPS = (1e9, 1e8)
FANOUT_RTT_S = (0.02, 0.04, 0.06, 0.08)
SPECULATION_RTT_S = 0.08
SPECULATE = 4


FALLBACK_PROMPTS = {  # when models/pymoe/prompts.jsonl is absent
    "repetitive": "    self.a = a\n    self.b = b\n    self.c = c\n    self.d = d\n    self.e = e\n    self.f = f\n",
    "non_repetitive": "The quick brown fox jumps over the lazy dog while seven wizards quietly hex a jovial bard.",
}


def _forwards(stepper: Stepper, prompt: list[int], n: int, width: int = 1) -> tuple[float, list[float]]:
    """(prefill seconds, seconds of each of n forwards after it): greedy decode for width 1; for
    width > 1, `width`-token forwards at a fixed context (a speculative verify step, cropped back)."""
    start = time.perf_counter()
    token = int(stepper.forward(prompt)[-1].argmax())
    prefill_s, times = time.perf_counter() - start, []
    for _ in range(n):
        feed = [token] + prompt[len(prompt) - width + 1:] if width > 1 else [token]
        start = time.perf_counter()
        logits = stepper.forward(feed)  # [width, V]
        times.append(time.perf_counter() - start)
        if width > 1:
            stepper.crop(len(prompt))
        else:
            token = int(logits[-1].argmax())
    return prefill_s, times


def _measure(swarm: Swarm, prompt: list[int], n: int, width: int = 1) -> dict:
    """Forwards on a fresh cache, with the dispatcher's accounting of the forwards after the prefill."""
    swarm.reset_accounting()
    prefill_s, times = _forwards(Stepper(swarm.model), prompt, n, width)
    calls = swarm.layer_calls()[len(swarm.moe_layers):]  # the prefill is the first forward
    token_layers = sum(c.tokens for c in calls)
    return {"prefill_s": prefill_s, "times": times, "calls": calls,
            "remote_layers_per_step": sum(1 for c in calls if c.round_trips > 0) / n,
            "layer_call_ms": 1e3 * statistics.fmean(c.seconds for c in calls),
            "bytes_out_per_token_layer": sum(c.bytes_out for c in calls) / token_layers,
            "bytes_in_per_token_layer": sum(c.bytes_in for c in calls) / token_layers}


def _step_fields(times: list[float]) -> dict:
    step_s = statistics.median(times)
    return {"steps": len(times), "step_s": step_s, "step_s_mean": statistics.fmean(times), "steps_per_s": 1 / step_s}


def petals(local_model, swarms: dict[str, Swarm], links, prompt: list[int], steps: int, repeats: int) -> list[dict]:
    configs = [("local", None, None, "local"), *[("direct", None, None, w) for w in WIRES]]
    configs += [("wan", r, b, w) for r in PETALS_RTT_S for b in PETALS_BANDWIDTH_BPS for w in WIRES]
    times: dict[int, list[float]] = {i: [] for i in range(len(configs))}
    last: dict[int, dict] = {}
    bar = progress(desc="petals scenario", total=repeats * len(configs), unit="config")
    for repeat in range(repeats):  # interleaved, every other repeat reversed: drifting load hits all alike
        for i, (link, rtt_s, bandwidth_bps, wire) in list(enumerate(configs))[:: 1 if repeat % 2 == 0 else -1]:
            bar.update()
            if link == "local":
                prefill_s, step_times = _forwards(Stepper(local_model), prompt, steps)
                times[i] += step_times
                last[i] = {"prefill_s": prefill_s, "remote_layers_per_step": 0.0}
                continue
            swarm = swarms["direct" if link == "direct" else "star"]
            if link == "wan":
                links.set_all(rtt_s=rtt_s, bandwidth_bps=bandwidth_bps)
            swarm.configure(WIRES[wire])
            ping_ms = 1e3 * statistics.median(swarm.ping(0) for _ in range(3))
            measured = _measure(swarm, prompt, steps)
            times[i] += measured.pop("times")
            del measured["calls"]
            last[i] = {**measured, "ping_ms": ping_ms}
    bar.close()
    rows = []
    for i, (link, rtt_s, bandwidth_bps, wire) in enumerate(configs):
        config = WIRES.get(wire)
        rows.append({"scenario": "petals", "link": link, "rtt_ms": rtt_s and 1e3 * rtt_s, "bandwidth_bps": bandwidth_bps,
                     "wire": wire, "mode": config and config.mode.value, "wire_dispatch": config and config.dispatch_codec,
                     "wire_combine": config and config.combine_codec, "prompt_tokens": len(prompt),
                     **_step_fields(times[i]), "round_trip_ms": rtt_s and 1e3 * rtt_s, **last[i]})
    return rows


def fanout(swarms: dict[str, Swarm], links, prompt: list[int], steps: int, widths: tuple[int, ...]) -> list[dict]:
    """Star vs chain with links at FANOUT_RTT_S: each layer call against the RTTs it reached."""
    for index, rtt_s in enumerate(FANOUT_RTT_S):
        links.set_profile(index, rtt_s=rtt_s, bandwidth_bps=None)
    rtt_ms = {address: 1e3 * rtt_s for address, rtt_s in zip(links.addresses, FANOUT_RTT_S)}
    rows = []
    for name, combine_rtts, nominal_ms in (("star", max, max(rtt_ms.values())), ("chain", sum, sum(rtt_ms.values()))):
        swarm = swarms[name]
        swarm.configure(EXACT)
        for width in progress(widths, desc=f"fanout scenario, {name}", unit="width"):
            measured = _measure(swarm, prompt, steps, width)
            reached = [[rtt_ms[w] for w in call.worker_seconds] for call in measured["calls"]]
            expected_ms = statistics.fmean(combine_rtts(r) for r in reached)
            rows.append({"scenario": "fanout", "fanout": name, "link_rtts_ms": list(rtt_ms.values()),
                         "tokens_per_step": width, **_step_fields(measured["times"]),
                         "layer_call_ms": measured["layer_call_ms"], "expected_layer_ms": expected_ms,
                         "nominal_layer_ms": nominal_ms, "workers_per_call": statistics.fmean(map(len, reached)),
                         "layer_call_over_expected": measured["layer_call_ms"] / expected_ms,
                         "round_trip_ms": expected_ms, "remote_layers_per_step": measured["remote_layers_per_step"]})
    return rows


def speculation(swarm: Swarm, links, prompts: dict[str, list[int]], new_tokens: int, steps: int, codec) -> list[dict]:
    """Plain greedy vs n-gram prompt lookup at SPECULATION_RTT_S, and the verify step's cost."""
    links.set_all(rtt_s=SPECULATION_RTT_S, bandwidth_bps=None)
    swarm.configure(EXACT)
    base = {"scenario": "speculation", "rtt_ms": 1e3 * SPECULATION_RTT_S, "round_trip_ms": 1e3 * SPECULATION_RTT_S}
    one, verify = (_measure(swarm, prompts["non_repetitive"], steps, width) for width in (1, SPECULATE + 1))
    step_1_s, step_verify_s = statistics.median(one["times"]), statistics.median(verify["times"])
    rows = [{**base, "prompt": "verify-cost", "speculate": SPECULATE, "step_1_token_s": step_1_s,
             "step_verify_s": step_verify_s, "break_even_tokens_per_step": step_verify_s / step_1_s}]
    for kind, prompt in progress(list(prompts.items()), desc="speculation scenario", unit="prompt"):
        results = {}
        for speculate in (0, SPECULATE):
            swarm.reset_accounting()
            result = generate(swarm, prompt, new_tokens, speculate, codec=codec, draft="ngram")
            decode_s = result.seconds - result.prefill_seconds
            calls = swarm.layer_calls()[len(swarm.moe_layers):]
            results[speculate] = result
            plain = results[0]
            step_s, tokens_per_step = decode_s / result.steps, (len(result.tokens) - 1) / result.steps
            plain_step_s = (plain.seconds - plain.prefill_seconds) / plain.steps  # plain: 1 token per step
            rows.append({**base, "prompt": kind, "prompt_tokens": len(prompt), "speculate": speculate,
                         "new_tokens": len(result.tokens), "steps": result.steps, "drafted": result.drafted,
                         "accepted": result.accepted, "tokens_per_step": tokens_per_step,
                         "step_s": step_s, "steps_per_s": 1 / step_s,
                         "decode_tokens_per_s": (len(result.tokens) - 1) / decode_s, "tokens_per_s": result.tokens_per_s,
                         "tokens_match_plain": result.tokens == plain.tokens,
                         "break_even_tokens_per_step": step_s / plain_step_s,
                         "speedup_vs_plain": tokens_per_step * plain_step_s / step_s,  # time per token, plain / this
                         "remote_layers_per_step": sum(1 for c in calls if c.round_trips > 0) / result.steps})
    return rows


def limit_line(rows: list[dict]) -> list[dict]:
    """Add what each step spends beyond (remote MoE layers per step x round trip)."""
    for row in rows:
        layers, rtt_ms, step_s = row.get("remote_layers_per_step"), row.get("round_trip_ms"), row.get("step_s")
        limit_ms = layers * rtt_ms if layers and rtt_ms and step_s else None
        row["round_trips_ms"] = limit_ms
        row["overhead_ratio"] = limit_ms and 1e3 * step_s / limit_ms
        row["beyond_round_trips_ms"] = limit_ms and 1e3 * step_s - limit_ms
    return rows


def load_prompts(codec, max_tokens: int) -> dict[str, list[int]]:
    """The most and the least repetitive held-out code prompts (by rep3), as token ids."""
    texts = dict(FALLBACK_PROMPTS)
    if PROMPTS.is_file():
        heldout = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
        heldout = sorted((p for p in heldout if p.get("kind") == "heldout"), key=lambda p: p["rep3"])
        if heldout:
            texts = {"repetitive": heldout[-1]["text"], "non_repetitive": heldout[0]["text"]}
    return {kind: codec.encode(text)[:max_tokens] for kind, text in texts.items()}


def _local_scenario(context: WanContext) -> list[dict]:
    from moeswarm_bench.bench.wan_local import run_local

    return run_local(context)


def _drafts_scenario(context: WanContext) -> list[dict]:
    from moeswarm_bench.bench.wan_drafts import run_drafts

    return run_drafts(context)


def _placement_scenario(context: WanContext) -> list[dict]:
    from moeswarm_bench.bench.wan_placement import run_placement

    return run_placement(context)


# Scenarios beyond the built-in three: name -> rows. One line each (wan_<name>.py holds the code).
SCENARIOS: dict[str, Callable[[WanContext], list[dict]]] = {
    "local": _local_scenario,
    "drafts": _drafts_scenario,
    "placement": _placement_scenario,
}
BUILT_IN = ("petals", "fanout", "speculation")


def scenario_names() -> tuple[str, ...]:
    return BUILT_IN + tuple(SCENARIOS)


def run_wan(model: str, quick: bool = False, scenarios: Collection[str] | None = None) -> dict:
    """Run the scenarios named (None: every one) on `model`; returns {"meta": {...}, "rows": [...]}."""
    chosen = list(scenario_names()) if scenarios is None else [s for s in scenario_names() if s in scenarios]
    steps, repeats, new_tokens, widths = (3, 1, 8, (1, 8)) if quick else (8, 3, 24, (1, 16))
    local_model = load_local(model)
    config = local_model.config
    codec = load_text_codec(model, config.vocab_size)
    room = getattr(config, "max_position_embeddings", 256) - new_tokens - SPECULATE - 2
    prompts = load_prompts(codec, min(128, room))
    started, load_before = time.perf_counter(), os.getloadavg()
    with local_workers(model, split_experts(num_experts_of(local_model), WORKERS)) as addresses, \
            wan_links(addresses, LinkProfile(rtt_s=PETALS_RTT_S[0])) as links:
        swarms: dict[str, Swarm] = {}
        rows: list[dict] = []
        try:
            swarms["direct"] = open_swarm(model, addresses)
            swarms["star"] = open_swarm(model, links.addresses, fanout="star")
            swarms["chain"] = open_swarm(model, links.addresses, fanout="chain")
            if "petals" in chosen:
                rows += petals(local_model, swarms, links, prompts["non_repetitive"], steps, repeats)
            if "fanout" in chosen:
                rows += fanout(swarms, links, prompts["non_repetitive"], steps, widths)
            if "speculation" in chosen:
                rows += speculation(swarms["star"], links, prompts, new_tokens, steps, codec)
            context = WanContext(model, local_model, codec, prompts, addresses, links, steps, repeats, new_tokens, quick)
            for name in chosen:
                if name in SCENARIOS:
                    links.set_all(rtt_s=PETALS_RTT_S[0], bandwidth_bps=None)  # each starts from the same links
                    rows += [{**row, "group": name} for row in SCENARIOS[name](context)]
        finally:
            for swarm in swarms.values():
                swarm.close()
        moe_layers = len(swarms["star"].moe_layers)
    meta = {"model": str(model), "model_type": config.model_type, "moe_layers": moe_layers,
            "hidden_size": config.hidden_size, "workers": WORKERS, "quick": quick, "tokenizer": codec.name,
            "seconds": time.perf_counter() - started, "speculate": SPECULATE, "scenarios": chosen,
            "prompts": {kind: len(ids) for kind, ids in prompts.items()},
            "steps_per_config": steps, "repeats": repeats, "new_tokens": new_tokens, **_machine(load_before)}
    return {"meta": meta, "rows": limit_line(rows)}


def _machine(load_before: tuple[float, ...]) -> dict:
    import transformers

    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "load_average_before": round(load_before[0], 2), "load_average_after": round(os.getloadavg()[0], 2)}
