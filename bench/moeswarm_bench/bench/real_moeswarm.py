"""moeswarm's side of `moeswarm bench real`: a child process holding one backbone.

`python -m moeswarm_bench.bench.real_moeswarm FILE THREADS MODE [ADDRESS=PID ...]`, MODE one of
  local   the whole model in this process: every expert held here (`open_swarm(FILE, [])`)
  direct  the backbone connected to the workers at ADDRESS (their process ids: PID) on loopback
  wan     the same through one emulated WAN link per worker (moeswarm_bench.wan), its RTT set per run
then answers `run` requests (real_proc.serve): a fresh cache, the prompt as one forward (timed:
prompt speed), then greedy decode steps, one token per forward with the argmax of its logits
(timed together: decode speed), as real_llama times llama.cpp's. The forwards are the packed ones
of `generate` and `serve` (forward/packed.py: the sequence's own cache, the decode query's
attention in C) where the model's layers allow them, else transformers' cache (Stepper). Over the
decode steps it also reads the dispatcher's accounting (each layer call's time, each worker's round
trips) and every process's CPU time per thread (/proc), and with `profile` the step's time by part
(real_profile).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import statistics
import sys
import time

from moeswarm_bench.bench.real_proc import cpu_split, serve, thread_cpu

MODES = ("local", "direct", "wan")


def load(path: str, threads: int, mode: str, workers: list[tuple[str, int]]):
    import torch

    from moeswarm_bench.bench.real_profile import StepProfile
    from moeswarm.forward.packed import PackedStepper, install, supports_ragged
    from moeswarm.forward.stepper import Stepper
    from moeswarm.gc_freeze import freeze_loaded
    from moeswarm.swarm import open_swarm
    from moeswarm.wire.config import WireConfig

    timed = WireConfig(timings=True)  # exact and lossless; each RESULT says its experts' CPU time

    torch.set_num_threads(threads)
    closing = contextlib.ExitStack()
    atexit.register(closing.close)  # the swarm's links, then the proxies
    links = None
    if mode == "local":  # the local mode of `moeswarm generate --model M` (no --workers): every expert here
        swarm, opened = open_swarm(path, []), "open_swarm(path, [])"
    elif mode == "direct":
        swarm, opened = open_swarm(path, [address for address, _ in workers], wire=timed), "open_swarm(path, workers)"
    else:
        from moeswarm_bench.bench.wan_links import wan_links
        from moeswarm_bench.wan import LinkProfile

        links = closing.enter_context(wan_links([address for address, _ in workers], LinkProfile(rtt_s=0.0)))
        swarm, opened = open_swarm(path, links.addresses, wire=timed), \
            "open_swarm(path, WAN proxies in front of the workers)"
    closing.callback(swarm.close)
    freeze_loaded()  # as the commands do once the model is in (gc_freeze.py)
    # the dispatcher names a worker by the address it connected to: a proxy's, in the workers' order
    addresses = links.addresses if links is not None else [address for address, _ in workers]
    pids = {address: pid for address, (_, pid) in zip(addresses, workers)}
    packed = supports_ragged(swarm.model)
    if packed:
        install(swarm.model)

    def run(request: dict) -> dict:
        if links is not None:
            links.set_all(rtt_s=request.get("rtt_ms", 0.0) / 1e3)
        profile = StepProfile(swarm.model) if request.get("profile") else None
        try:
            stepper = PackedStepper(swarm.model) if packed else Stepper(swarm.model)
            return _run(swarm, stepper, request["prompt"], request["decode"], pids, profile)
        finally:
            if profile is not None:
                profile.close()

    info = {"opened": opened, "forwards": "packed" if packed else "transformers' cache", "threads": threads,
            "moe_layers": len(swarm.moe_layers), "holders": swarm.workers,
            "wire": swarm.wire.describe()}
    return info, run


def _run(swarm, stepper, prompt: list[int], steps: int, pids: dict[str, int], profile) -> dict:
    cpu_start, start = time.process_time(), time.perf_counter()
    # The prompt's last logits only, as generate computes them (and llama.cpp, whose other rows'
    # logits nobody asked for): the same bits as the full forward's last row (Stepper.forward).
    token = int(stepper.forward(prompt, last_only=True)[-1].argmax())  # logits [1, V]
    prompt_s = time.perf_counter() - start
    swarm.reset_accounting()
    if profile is not None:
        profile.reset()
    before = {pid: thread_cpu(pid) for pid in pids.values()}
    tokens, step_s = [token], []
    cpu_decode, decode_start = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step_start = time.perf_counter()
        token = int(stepper.forward([token])[-1].argmax())
        step_s.append(time.perf_counter() - step_start)
        tokens.append(token)
    decode_s = time.perf_counter() - decode_start
    decode_cpu_s = time.process_time() - cpu_decode
    after = {pid: thread_cpu(pid) for pid in pids.values()}
    calls = swarm.layer_calls()
    timed = [c for c in calls if c.worker_cpu]
    reply = {"prompt_s": prompt_s, "decode_s": decode_s, "step_s": step_s, "tokens": tokens, "waiting": swarm.waiting,
             "prompt_cpu_s": cpu_decode - cpu_start, "decode_cpu_s": decode_cpu_s,
             "layer_calls": len(calls), "layer_call_ms": 1e3 * statistics.fmean(c.seconds for c in calls),
             "layer_call_ms_median": 1e3 * statistics.median(c.seconds for c in calls),
             "bytes_per_step": sum(c.bytes_out + c.bytes_in for c in calls) / steps, "workers": [],
             # a call waits for its slowest holder: per call, the largest experts' CPU its RESULTs said
             "slowest_kernel_ms": 1e3 * statistics.fmean(max(c.worker_cpu.values()) for c in timed) if timed else None}
    for address, pid in pids.items():
        trips = [c.worker_seconds[address] for c in calls if address in c.worker_seconds]
        said = [c.worker_cpu[address] for c in calls if address in c.worker_cpu]  # its experts' CPU, per RESULT
        reply["workers"].append({"address": address, "pid": pid, "trips": len(trips),
                                 "rtt_ms": 1e3 * statistics.fmean(trips) if trips else None,
                                 "experts_ms": 1e3 * statistics.fmean(said) if said else None,
                                 "cpu": cpu_split(pid, before[pid], after[pid])})
    if profile is not None:
        reply["parts_ms"] = profile.parts_ms(decode_s, steps)
    return reply


if __name__ == "__main__":
    file, thread_count, mode, *holders = sys.argv[1:]
    if mode not in MODES:
        raise SystemExit(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parsed = [(spec.rsplit("=", 1)[0], int(spec.rsplit("=", 1)[1])) for spec in holders]
    serve(lambda: load(file, int(thread_count), mode, parsed))
