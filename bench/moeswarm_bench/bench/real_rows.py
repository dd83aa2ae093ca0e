"""The rows of `moeswarm bench real`: one per (shape, configuration), from the children's runs.

Every speed is the median over the timed repeats of that repeat's own figure (32 / decode time;
64 / prompt time); ratios are this row's median over the llama.cpp row's median, same shape.
Per layer call (decode steps only), from the dispatcher's accounting and /proc:
  layer_call_ms            the MoE layer call as the backbone sees it (plan, send, wait, combine)
  worker_rtt_ms            a worker's round trip as the dispatcher timed it (mean), the slower worker's
  worker_compute_ms        per layer call, the CPU time of the experts (kernels) of its slowest holder,
                           as the RESULTs say (`cpu_us`): the call cannot end before it; where they do
                           not say it, the busier worker's CPU off its main thread per trip (/proc).
                           Only with workers of one thread: with more, `cpu_us` is the share of the
                           thread that answered, no measure of the kernels, and this field and the
                           two below that stand on it are None
  kernel_imbalance_ms      worker_compute_ms less the busier worker's mean kernel per trip: what the
                           experts' uneven split between the workers adds to a call
  worker_loop_ms           per round trip, the worker's main thread (/proc: its event loop, frames,
                           socket; and a decode step's experts, which run there when the compute
                           thread is idle: worker/runner.py run_here)
  machinery_ms             layer_call_ms - worker_compute_ms: what a call costs beyond the kernels
  backbone_side_ms         layer_call_ms - worker_rtt_ms: the backbone's part of it (plan, encode,
                           decode, combine), roughly: the slower worker is not always the same one
"""

from __future__ import annotations

import statistics

from moeswarm_bench.bench.real_shapes import DECODE_TOKENS, PROMPT_TOKENS, ModelShape


def shape_rows(shape: ModelShape, configs, runs: dict[str, list[dict]], profiles: dict[str, dict],
               processes: list[dict], threads: int) -> list[dict]:
    """One row per configuration, in `configs`' order, with ratios against the llama.cpp row."""
    rows = [_row(shape, config, runs[config.name], profiles.get(config.name), processes, threads) for config in configs]
    reference = next(row for row in rows if row["config"] == "llama.cpp")
    local = next(row for row in rows if row["config"] == "local")
    for row in rows:
        row["decode_over_llama_cpp"] = row["decode_tokens_per_s"] / reference["decode_tokens_per_s"]
        row["prompt_over_llama_cpp"] = row["prompt_tokens_per_s"] / reference["prompt_tokens_per_s"]
        row["tokens_match_llama_cpp"] = row["tokens"] == reference["tokens"]
        row["tokens_match_local"] = row["tokens"] == local["tokens"]
    return rows


def _row(shape: ModelShape, config, runs: list[dict], profile: dict | None, processes: list[dict],
         threads: int) -> dict:
    decode = [DECODE_TOKENS / run["decode_s"] for run in runs]
    prompt = [PROMPT_TOKENS / run["prompt_s"] for run in runs]
    row = {"shape": shape.name, "dims_of": shape.model, "note": shape.note, "config": config.name,
           "label": config.label, "rtt_ms": config.rtt_ms, "threads": threads, "repeats": len(runs),
           "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS,
           "decode_tokens_per_s": statistics.median(decode), "prompt_tokens_per_s": statistics.median(prompt),
           "decode_tokens_per_s_runs": decode, "prompt_tokens_per_s_runs": prompt,
           "step_ms": 1e3 * statistics.median(s for run in runs for s in run["step_s"]),
           "tokens": runs[-1]["tokens"], "tokens_same_every_run": all(run["tokens"] == runs[0]["tokens"] for run in runs),
           "cpu_cores_decode": statistics.median(run["decode_cpu_s"] / run["decode_s"] for run in runs)}
    row["processes"] = _processes(config, processes)
    row["worker_threads"] = max((p["threads"] for p in row["processes"] if "threads" in p), default=None)
    if "layer_calls" in runs[0]:
        row.update(_layer_calls(runs, kernels_timed=row["worker_threads"] in (None, 1)))
    if profile is not None:
        row["parts_ms"] = profile["parts_ms"]
        row["profiled_step_ms"] = 1e3 * profile["decode_s"] / DECODE_TOKENS
    return row


def _processes(config, processes: list[dict]) -> list[dict]:
    """The processes this configuration runs on: its own, and the workers it uses."""
    return [p for p in processes if p["role"] == config.process] + \
        [p for role in config.workers for p in processes if p["role"] == role]


def _layer_calls(runs: list[dict], kernels_timed: bool) -> dict:
    """Per decode layer call: the backbone's view, each worker's trips and CPU, the machinery
    (`kernels_timed`: the workers' RESULTs time their kernels whole, one thread each)."""
    fields = {"layer_calls_per_step": statistics.median(run["layer_calls"] / DECODE_TOKENS for run in runs),
              "waiting": runs[-1].get("waiting"),  # how its layer calls waited for replies (dispatch/wait.py)
              "layer_call_ms": statistics.median(run["layer_call_ms"] for run in runs),
              "bytes_per_step": statistics.median(run["bytes_per_step"] for run in runs)}
    if not runs[0]["workers"]:
        return fields
    workers = []
    for index in range(len(runs[0]["workers"])):
        mine = [run["workers"][index] for run in runs]
        trips = [w for w in mine if w["trips"]]
        workers.append({
            "trips_per_step": statistics.median(w["trips"] / DECODE_TOKENS for w in mine),
            "rtt_ms": statistics.median(w["rtt_ms"] for w in trips) if trips else None,
            "compute_ms_per_trip": (statistics.median(w["experts_ms"] for w in trips) if all(w.get("experts_ms") is not None for w in trips)
                                    else statistics.median(1e3 * w["cpu"]["other_s"] / w["trips"] for w in trips))
            if trips else None,
            "loop_ms_per_trip": statistics.median(1e3 * w["cpu"]["main_s"] / w["trips"] for w in trips) if trips else None,
            "cpu_cores_decode": statistics.median(w["cpu"]["total_s"] / run["decode_s"] for w, run in zip(mine, runs)),
        })
    computed = [w["compute_ms_per_trip"] for w in workers if w["compute_ms_per_trip"] is not None] if kernels_timed else []
    fields["workers"] = workers
    slowest = [run.get("slowest_kernel_ms") for run in runs]
    if computed and all(ms is not None for ms in slowest):  # per call, its slowest holder's kernel
        fields["worker_compute_ms"] = statistics.median(slowest)
        fields["kernel_imbalance_ms"] = fields["worker_compute_ms"] - max(computed)
    else:
        fields["worker_compute_ms"] = max(computed) if computed else None
    loops = [w["loop_ms_per_trip"] for w in workers if w["loop_ms_per_trip"] is not None]
    fields["worker_loop_ms"] = max(loops) if loops else None
    fields["machinery_ms"] = fields["layer_call_ms"] - fields["worker_compute_ms"] if computed else None
    rtts = [w["rtt_ms"] for w in workers if w["rtt_ms"] is not None]
    fields["worker_rtt_ms"] = max(rtts) if rtts else None
    fields["backbone_side_ms"] = fields["layer_call_ms"] - fields["worker_rtt_ms"] if rtts else None
    return fields
