"""`moeswarm bench wan --scenarios placement`: the planner against the contiguous split, links at 20/40/60/80 ms.

A routing profile is counted on the local model over the bundled prompts, the measured ones left
out (bench/wan_local.py `calibration_profile`). Each placement then serves greedy decode after a
prefill over 4 workers, worker i behind its own WanProxy at RTT_MS[i], star fan-out, exact f32:

  contiguous   the scenario runner's 4 workers: experts cut in 4 even runs (E/4 per worker per layer)
  planned      placement/planner.py over the same 4 links, capacity ceil((E + R) / 4) per worker
               per layer, R the replica budget: R = 0 (the same expert memory) and R = E/4 (+25 %
               memory); 4 fresh workers started from the plan file (`--plan PLAN.json --plan-worker NAME`)

Per placement, over the decode layer calls (the prefill's left out): workers reached per
token-layer (holders that answered), mean layer-call ms, the mean largest nominal RTT among the
workers reached (`expected_layer_ms`), the planner's simulated figures for the same plan (rows
drawn from the profile), and whether the decode logits are torch.equal to the contiguous run's.
Placements run one after another (each needs its workers), not interleaved.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from moeswarm_bench.bench.wan_context import WanContext
from moeswarm_bench.bench.wan_links import wan_links
from moeswarm_bench.bench.wan_local import calibration_profile
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import stop, wait_listening
from moeswarm.model.experts import experts_modules, num_experts_of
from moeswarm.placement.plan_file import Plan, WorkerSpec
from moeswarm.placement.planner import contiguous_plan, plan_placement, pseudo_rows, routing_from_profile
from moeswarm.placement.simulate import simulate
from moeswarm.progress import progress
from moeswarm.swarm import open_swarm
from moeswarm_bench.wan import LinkProfile


RTT_MS = (20.0, 40.0, 60.0, 80.0)
DECODE_STEPS = 24  # per measured prompt (--quick: the runner's steps, one prompt)
SIMULATION_ROWS = 2048
SIMULATION_SEED = 1_000_003  # not the planner's own draws


def run_placement(context: WanContext) -> list[dict]:
    """The scenario's rows: contiguous, then planned at each replica budget."""
    model, local_model = context.model, context.local_model
    load_before = os.getloadavg()[0]
    e, layers = num_experts_of(local_model), list(experts_modules(local_model))
    measured = [context.prompts["non_repetitive"]] if context.quick else list(context.prompts.values())
    steps = context.steps if context.quick else DECODE_STEPS
    stats, calibration_prompts = calibration_profile(context)
    routing = routing_from_profile(stats)
    drawn = {layer: pseudo_rows(r, SIMULATION_ROWS, SIMULATION_SEED + layer) for layer, r in routing.items()}
    budgets = (e // 4,) if context.quick else (0, e // 4)
    plans = [("contiguous", contiguous_plan(e, layers, _workers(math.ceil(e / len(RTT_MS)))))]
    plans += [("planned", plan_placement(routing, _workers(math.ceil((e + r) / len(RTT_MS))), r)) for r in budgets]
    rows, reference = [], None
    for name, plan in progress(plans, desc="placement scenario", unit="placement"):
        if name == "contiguous":
            run = _decode_over(model, context.links, measured, steps)
        else:
            run = _decode_planned(model, plan, measured, steps)
        reference = reference or run
        sim = simulate(plan, drawn)
        calls = run["calls"]
        rows.append({
            "scenario": "placement", "label": f"{name}, {plan.replicas} replicas", "placement": name,
            "replicas": plan.replicas, "capacity": plan.workers[0].spec.capacity, "expert_slots_per_layer": _slots(plan),
            "link_rtts_ms": list(RTT_MS), "calibration_prompts": calibration_prompts,
            "calibration_tokens": max(stats.tokens.values()), "prompt_tokens": [len(p) for p in measured],
            "decode_steps": run["steps"], "layer_calls": len(calls),
            "workers_per_token_layer": statistics.fmean(len(c.worker_seconds) for c in calls),
            "layer_call_ms": 1e3 * statistics.fmean(c.seconds for c in calls),
            "expected_layer_ms": statistics.fmean(max(run["rtt_ms"][w] for w in c.worker_seconds) for c in calls),
            "calls_reaching_farthest": statistics.fmean(any(run["rtt_ms"][w] == max(RTT_MS) for w in c.worker_seconds)
                                                        for c in calls),
            "decode_step_ms": 1e3 * statistics.median(run["step_s"]),
            "simulated_workers_per_token_layer": sim["workers_per_token_layer"],
            "simulated_layer_ms": sim["layer_call_ms"],
            "logits_equal_contiguous": all(torch.equal(a, b) for a, b in zip(run["logits"], reference["logits"])),
            "plan": plan.to_json()})
    base, load = rows[0], [round(load_before, 2), round(os.getloadavg()[0], 2)]
    for row in rows:
        row["load_average"] = load  # before and after the scenario: the machine is shared
        row["layer_call_change"] = row["layer_call_ms"] / base["layer_call_ms"] - 1
        row["workers_change"] = row["workers_per_token_layer"] / base["workers_per_token_layer"] - 1
    return rows


def _workers(capacity: int) -> list[WorkerSpec]:
    return [WorkerSpec(f"w{i}", capacity, rtt) for i, rtt in enumerate(RTT_MS)]


def _slots(plan: Plan) -> float:
    return statistics.fmean(sum(len(w.experts.get(layer, ())) for w in plan.workers) for layer in plan.layers)


def _decode_planned(model: str, plan: Plan, prompts: list[list[int]], steps: int) -> dict:
    """`_decode_over` fresh workers started from `plan`, behind their own links."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(json.dumps(plan.to_json()))
        with plan_workers(model, path, plan.names) as addresses, \
                wan_links(addresses, LinkProfile(rtt_s=RTT_MS[0] / 1e3)) as links:
            return _decode_over(model, links, prompts, steps)


def _decode_over(model: str, links, prompts: list[list[int]], steps: int) -> dict:
    """Greedy decode of each prompt through `links` (worker i's at RTT_MS[i]): the decode layer
    calls, each step's logits [1, V] and seconds, and each link's nominal RTT by address."""
    for index, rtt_ms in enumerate(RTT_MS):
        links.set_profile(index, rtt_s=rtt_ms / 1e3, bandwidth_bps=None)
    calls, logits, step_s = [], [], []
    with open_swarm(model, links.addresses) as swarm:
        for prompt in prompts:
            swarm.reset_accounting()
            stepper = Stepper(swarm.model)
            token = int(stepper.forward(prompt)[-1].argmax())
            for _ in range(steps):
                started = time.perf_counter()
                out = stepper.forward([token])  # [1, V]
                step_s.append(time.perf_counter() - started)
                logits.append(out)
                token = int(out[-1].argmax())
            calls += swarm.layer_calls()[len(swarm.moe_layers):]  # the prefill's calls come first
    return {"calls": calls, "logits": logits, "step_s": step_s, "steps": len(step_s),
            "rtt_ms": dict(zip(links.addresses, RTT_MS))}


@contextlib.contextmanager
def plan_workers(model: str, plan_path: Path, names: list[str]) -> Iterator[list[str]]:
    """One `moeswarm worker --plan plan_path --plan-worker NAME` per name; yields their addresses."""
    processes = []
    try:
        for name in names:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "moeswarm.cli", "worker", "--model", str(model), "--plan", str(plan_path),
                 "--plan-worker", name, "--threads", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        yield [wait_listening(process) for process in processes]
    finally:
        stop(processes)
