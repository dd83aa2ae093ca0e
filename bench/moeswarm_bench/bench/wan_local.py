"""`moeswarm bench wan --scenarios local`: hot experts on the backbone, and the shared expert
computed during the trip, over the same 4 workers behind 80 ms links.

  local    0/10/25/50/75/90 % of each layer's experts held by the backbone (the hottest by a routing
           profile counted on the bundled prompts, the measured prompt left out): the share of
           decode (token, layer) pairs that still travel, round trips per step, steps/s at 80 ms.
  overlap  the shared expert computed while the trip is in flight, on and off, at 1 ms and
           80 ms, with 0 and 25 % local: the gain is the step time off / on.
  overlap_large  the same on/off comparison with a real model's shared expert (Qwen1.5-MoE-A2.7B
           width) in a random 2-layer model on 2 workers: the bundled model's is too small to see.
  curve    no network: the share of decode (token, layer) pairs that would still travel with
           0 to 100 % of each layer's experts local, from the local model's own greedy decode.

A step is one greedy decode forward after a prefill (a fresh cache per repeat); its time is the
median over every step of every repeat. The configurations compared take turns step by step (the
order reversed every other step), so drifting load on a shared machine hits them alike; overlap
on and off share one swarm (exact either way: the same tokens). The most overlap can gain is
measured apart: one row through every block's shared expert, alone (`shared_expert_ms`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeswarm_bench.bench.wan_context import WanContext
from moeswarm.bundled import PROMPTS
from moeswarm.forward.stepper import Stepper
from moeswarm.placement.calibrate import count_routing
from moeswarm.model.experts import experts_modules, num_experts_of
from moeswarm.placement.profile import RoutingStats, hot_sets
from moeswarm.progress import progress
from moeswarm.swarm import Swarm, open_swarm


LOCAL_PERCENTS = (0, 10, 25, 50, 75, 90)
LOCAL_RTT_S = 0.08
OVERLAP_RTT_S = (0.001, 0.08)
OVERLAP_PERCENTS = (0, 25)
CURVE_STEPS = 32
# Qwen1.5-MoE-A2.7B's hidden size, heads and shared expert; 2 layers, 8 narrow routed experts.
LARGE_SHARED = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=2,
                    shared_expert_intermediate_size=5632, intermediate_size=5632, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=352)


def calibration_profile(context: WanContext) -> tuple[RoutingStats, int]:
    """Routing counts over the bundled prompts but the measured ones; (stats, prompts used)."""
    measured = list(context.prompts.values())
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()] \
        if PROMPTS.is_file() else []
    calibration = []
    for text in texts:
        ids = context.codec.encode(text)
        if not any(ids[:len(m)] == m for m in measured):
            calibration.append(ids[:256])
    if not calibration:  # no bundled prompts: the measured prompts' own routing (said in the rows)
        calibration = measured
    stats = RoutingStats(num_experts_of(context.local_model), model_type=context.local_model.config.model_type)
    return count_routing(context.local_model, calibration, stats), len(calibration)


def _round_robin(entries: list[tuple[Swarm, Callable[[], None]]], prompt: list[int], steps: int, repeats: int,
                 desc: str) -> tuple[list[list[float]], list[list]]:
    """Greedy decode on every entry (a swarm, and a setup run before each of its steps), one step
    of each in turn, the order reversed every other step: drifting load hits all alike. Returns
    (seconds of each entry's steps, each entry's decode layer calls)."""
    times: list[list[float]] = [[] for _ in entries]
    calls: list[list] = [[] for _ in entries]
    swarms = {id(swarm): swarm for swarm, _ in entries}
    bar = progress(desc=desc, total=repeats * steps * len(entries), unit="step")
    for _ in range(repeats):
        steppers, tokens = [], []
        for swarm, setup in entries:  # a fresh cache each repeat; the prefill is not timed
            setup()
            steppers.append(Stepper(swarm.model))
            tokens.append(int(steppers[-1].forward(prompt)[-1].argmax()))
        for swarm in swarms.values():
            swarm.reset_accounting()
        for step in range(steps):
            order = range(len(entries)) if step % 2 == 0 else reversed(range(len(entries)))
            for i in order:
                swarm, setup = entries[i]
                setup()
                before = len(swarm.layer_calls())
                start = time.perf_counter()
                logits = steppers[i].forward([tokens[i]])
                times[i].append(time.perf_counter() - start)
                calls[i] += swarm.layer_calls()[before:]
                tokens[i] = int(logits[-1].argmax())
                bar.update()
    bar.close()
    return times, calls


def _fields(times: list[float], calls: list, layers: int) -> dict:
    """Step time (median) and the trips of `calls`, per decode forward (`layers` calls each)."""
    step_s, forwards = statistics.median(times), len(calls) / layers
    return {"steps": len(times), "step_s": step_s, "step_s_mean": statistics.fmean(times), "steps_per_s": 1 / step_s,
            "layer_call_ms": 1e3 * statistics.median(c.seconds for c in calls),
            "trip_share": sum(c.remote_tokens or 0 for c in calls) / sum(c.tokens for c in calls),
            "round_trips_per_step": sum(c.round_trips for c in calls) / forwards,
            "remote_layers_per_step": sum(1 for c in calls if c.round_trips > 0) / forwards,
            "bytes_out_per_step": sum(c.bytes_out for c in calls) / forwards}


def _most_gain(off: dict, shared_ms: float | None, layers: int) -> float | None:
    """The step time with overlap off over that time less what overlap can hide: per layer, the
    shared expert's time or the layer call's (the trip, overlap off), whichever is shorter."""
    if shared_ms is None:
        return None
    hidden_s = layers * min(shared_ms / layers, off["layer_call_ms"]) / 1e3
    return off["step_s"] / (off["step_s"] - hidden_s)


def shared_expert_ms(swarm: Swarm, repeats: int = 200) -> float | None:
    """Median ms of one decode row through every MoE block's shared expert (what overlap can hide
    per step at most); None when the family has none."""
    shared = [m._moeswarm.shared for _, m in experts_modules(swarm.model).values()
              if getattr(m, "_moeswarm", None) is not None and m._moeswarm.shared is not None]
    if not shared:
        return None
    row = torch.randn(1, swarm.model.config.hidden_size, dtype=swarm.model.dtype)  # [1, d]
    samples = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for block in shared:
                block._forward(row)
            samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def run_local(context: WanContext) -> list[dict]:
    """The local and overlap scenarios' rows."""
    stats, calibration_prompts = calibration_profile(context)
    layers = list(experts_modules(context.local_model))
    prompt, steps = context.prompts["non_repetitive"], context.steps
    swarms: dict[int, Swarm] = {}
    try:
        for percent in sorted(set(LOCAL_PERCENTS) | set(OVERLAP_PERCENTS)):
            held = hot_sets(stats, layers, percent / 100)
            swarms[percent] = open_swarm(context.model, context.links.addresses, local_experts=held or None)
        rows = _curve_rows(context, stats, layers, prompt)
        rows += _local_rows(context, swarms, prompt, steps, calibration_prompts)
        rows += _overlap_rows(context, swarms, prompt, steps)
        rows += _overlap_large_rows(context)
    finally:
        for swarm in swarms.values():
            swarm.close()
    return rows


def _curve_rows(context: WanContext, stats: RoutingStats, layers: list, prompt: list[int]) -> list[dict]:
    """Trip share by local percent, from the routing of a local greedy decode (no network)."""
    seen: list[tuple[int, torch.Tensor]] = []  # (layer, top_k_index [1, k]) of every decode step
    hooks = [module.register_forward_pre_hook(lambda _m, args, layer=layer: seen.append((layer, args[1])))
             for layer, (_, module) in experts_modules(context.local_model).items()]
    try:
        stepper = Stepper(context.local_model)
        token = int(stepper.forward(prompt)[-1].argmax())
        seen.clear()  # the prefill's routing is not a decode step's
        for _ in range(CURVE_STEPS):
            token = int(stepper.forward([token])[-1].argmax())
    finally:
        for hook in hooks:
            hook.remove()
    rows = []
    for percent in range(0, 101, 10):
        held = hot_sets(stats, layers, percent / 100)
        travel = sum(bool((~torch.isin(index, torch.tensor(held.get(layer, ()), dtype=torch.long))).any())
                     for layer, index in seen)
        rows.append({"scenario": "local_curve", "local_percent": percent, "decode_steps": CURVE_STEPS,
                     "trip_share": travel / len(seen), "label": f"{percent} % local (no network)"})
    return rows


def _local_rows(context: WanContext, swarms: dict[int, Swarm], prompt: list[int], steps: int,
                calibration_prompts: int) -> list[dict]:
    context.links.set_all(rtt_s=LOCAL_RTT_S, bandwidth_bps=None)
    entries = [(swarms[percent], lambda swarm=swarms[percent]: swarm.set_overlap(True)) for percent in LOCAL_PERCENTS]
    times, calls = _round_robin(entries, prompt, steps, context.repeats, "local-experts scenario")
    rows = []
    for i, percent in enumerate(LOCAL_PERCENTS):
        swarm = swarms[percent]
        held = swarm.local_held()
        rows.append({"scenario": "local", "local_percent": percent, "rtt_ms": 1e3 * LOCAL_RTT_S,
                     "round_trip_ms": 1e3 * LOCAL_RTT_S, "local_experts_per_layer": len(next(iter(held.values()), ())),
                     "calibration_prompts": calibration_prompts, "prompt_tokens": len(prompt), "overlap": True,
                     "label": f"{percent} % local, 80 ms", **_fields(times[i], calls[i], len(swarm.moe_layers))})
    base = rows[0]["step_s"]
    for row in rows:
        row["speedup_vs_none_local"] = base / row["step_s"]
    return rows


def _overlap_rows(context: WanContext, swarms: dict[int, Swarm], prompt: list[int], steps: int) -> list[dict]:
    """Overlap off and on, alternating step by step on the same swarm (the same tokens either way)."""
    rows = []
    bound_ms = shared_expert_ms(swarms[0])
    for rtt_s in OVERLAP_RTT_S:
        context.links.set_all(rtt_s=rtt_s, bandwidth_bps=None)
        configs = [(percent, overlap) for percent in OVERLAP_PERCENTS for overlap in (False, True)]
        entries = [(swarms[p], lambda swarm=swarms[p], on=on: swarm.set_overlap(on)) for p, on in configs]
        times, calls = _round_robin(entries, prompt, steps, context.repeats, f"overlap scenario, {1e3 * rtt_s:g} ms")
        fields = [_fields(times[i], calls[i], len(swarms[p].moe_layers)) for i, (p, _) in enumerate(configs)]
        for i, (percent, overlap) in enumerate(configs):
            off = fields[configs.index((percent, False))]["step_s"]
            rows.append({"scenario": "overlap", "local_percent": percent, "rtt_ms": 1e3 * rtt_s,
                         "round_trip_ms": 1e3 * rtt_s, "overlap": overlap, "prompt_tokens": len(prompt), **fields[i],
                         "label": f"{percent} % local, {1e3 * rtt_s:g} ms, overlap {'on' if overlap else 'off'}",
                         "gain_vs_no_overlap": off / fields[i]["step_s"], "shared_expert_ms_per_step": bound_ms,
                         "most_gain": _most_gain(fields[configs.index((percent, False))], bound_ms,
                                                 len(swarms[percent].moe_layers))})
    for swarm in swarms.values():
        swarm.set_overlap(True)
    return rows


def _overlap_large_rows(context: WanContext) -> list[dict]:
    """Overlap on and off with a real model's shared expert (LARGE_SHARED: Qwen1.5-MoE-A2.7B's
    hidden size and shared-expert width) in a random 2-layer qwen2_moe, 2 workers, same links."""
    from moeswarm_bench.bench.wan_links import wan_links
    from moeswarm.local.workers import local_workers, split_experts
    from moeswarm.model.tiny import make_tiny_model
    from moeswarm_bench.wan import LinkProfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model("qwen2_moe", Path(tmp) / "large-shared", **LARGE_SHARED))
        prompt = list(range(3, 3 + 32))
        with local_workers(path, split_experts(LARGE_SHARED["num_experts"], 2)) as addresses, \
                wan_links(addresses, LinkProfile(rtt_s=OVERLAP_RTT_S[0])) as links, \
                open_swarm(path, links.addresses) as swarm:
            bound_ms = shared_expert_ms(swarm, repeats=20)
            for rtt_s in OVERLAP_RTT_S:
                links.set_all(rtt_s=rtt_s, bandwidth_bps=None)
                entries = [(swarm, lambda on=on: swarm.set_overlap(on)) for on in (False, True)]
                times, calls = _round_robin(entries, prompt, context.steps, context.repeats,
                                            f"overlap scenario, large shared expert, {1e3 * rtt_s:g} ms")
                fields = [_fields(t, c, len(swarm.moe_layers)) for t, c in zip(times, calls)]
                off = fields[0]["step_s"]
                for overlap, measured in zip((False, True), fields):
                    rows.append({"scenario": "overlap_large", "rtt_ms": 1e3 * rtt_s, "round_trip_ms": 1e3 * rtt_s,
                                 "overlap": overlap, "local_percent": 0, "prompt_tokens": len(prompt), **measured,
                                 "model_shape": dict(LARGE_SHARED), "moe_layers": len(swarm.moe_layers),
                                 "label": f"large shared expert, {1e3 * rtt_s:g} ms, overlap {'on' if overlap else 'off'}",
                                 "gain_vs_no_overlap": off / measured["step_s"], "shared_expert_ms_per_step": bound_ms,
                                 "most_gain": _most_gain(fields[0], bound_ms, len(swarm.moe_layers))})
    return rows
