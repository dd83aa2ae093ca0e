"""Loopback overhead: remote experts on local worker processes against a local eager run.

Both runs decode the same greedy tokens from the same prompt, alternating repetitions so that
machine noise hits both alike. The overhead per MoE layer round trip is the step-time difference
divided by the number of MoE layers. Each RESULT says its experts' CPU time (`WireConfig(timings=True)`),
so with one worker the machinery per layer call is also given as `moeswarm bench real` gives it:
the backbone's time per layer call less the worker's experts (issue 23's measure, "beyond the
worker's kernels"). The two differ by what the experts cost in the worker against in the local
model (caches the worker finds cold after the backbone's turn) and by what the backbone does
meanwhile (the shared expert, which the local model computes after its experts).
"""

from __future__ import annotations

import statistics
import time

from moeswarm.forward.stepper import Stepper
from moeswarm.gc_freeze import freeze_loaded, thaw
from moeswarm.local.workers import local_swarm
from moeswarm.sources.loading import load_local
from moeswarm.progress import progress
from moeswarm.wire.config import WireConfig


def decode_seconds(stepper_factory, prompt: list[int], steps: int, after_prefill=lambda: None) -> float:
    """Mean seconds per decode step (one token per forward) after a prefill (then `after_prefill()`)."""
    stepper = stepper_factory()
    logits = stepper.forward(prompt)
    token = int(logits[-1].argmax())
    after_prefill()
    start = time.perf_counter()
    for _ in range(steps):
        token = int(stepper.forward([token])[-1].argmax())
    return (time.perf_counter() - start) / steps


def run_loopback(model: str, workers: int = 2, steps: int = 32, repeats: int = 3, prompt: list[int] | None = None) -> dict:
    prompt = prompt or [5, 17, 42, 8, 99, 23, 11, 60]
    local_model = load_local(model)
    with local_swarm(model, workers, wire=WireConfig(timings=True)) as swarm:
        freeze_loaded()  # both models, as the commands do once loaded (gc_freeze.py); thawed below
        pings = [swarm.ping(0) for _ in range(200)]
        local_runs, remote_runs = [], []
        for _ in progress(range(repeats), desc=f"loopback, {steps} decode steps local and remote", unit="repeat"):
            local_runs.append(decode_seconds(lambda: Stepper(local_model), prompt, steps))
            remote_runs.append(decode_seconds(lambda: Stepper(swarm.model), prompt, steps, swarm.reset_accounting))
        summary, waiting = swarm.accounting(), swarm.waiting
    thaw()
    layer_call = summary["seconds_per_layer_call_mean"]
    compute_us = {worker: 1e3 * ms for worker, ms in summary["worker_cpu_ms_mean"].items()}
    local_s, remote_s = statistics.median(local_runs), statistics.median(remote_runs)
    layers = len(swarm.moe_layers)
    return {
        "model": model,
        "workers": workers,
        "moe_layers": layers,
        "decode_steps": steps,
        "repeats": repeats,
        "local_tokens_per_s": 1 / local_s,
        "remote_tokens_per_s": 1 / remote_s,
        "remote_over_local": local_s / remote_s,
        "overhead_per_layer_round_trip_us": 1e6 * (remote_s - local_s) / layers,
        "layer_call_us_mean": 1e6 * layer_call,  # the last repetition's decode steps: one-token calls
        "worker_compute_us_mean": compute_us,  # the experts' CPU time per call, as each RESULT said
        "machinery_us": 1e6 * layer_call - next(iter(compute_us.values())) if len(compute_us) == 1 else None,
        "layer_calls_in_c": summary["layer_calls_in_c"],
        "layer_calls": summary["layer_calls"],
        "waiting": waiting,  # how the backbone waited for replies, as learned (dispatch/wait.py)
        "ping_rtt_us_p50": 1e6 * statistics.median(pings),
    }
