"""Relay against direct: time per MoE layer call, on loopback and at 50 ms RTT (docs/network.md).

Every path runs TLS with a swarm key made for the run. One `moeswarm relay` process and two
worker processes holding every expert, each registered at the relay:

    loopback  direct: backbone -> worker                       relay: backbone -> relay -> worker
    wan       direct: backbone -> WAN(50 ms) -> worker         relay: backbone -> WAN(25 ms) -> relay
                                                                      <- WAN(25 ms) <- worker (its outbound connection)

so both paths of a scenario have the same total round-trip time and the relay's cost is its
extra hop: a process, two TCP connections and a copy each way. The emulated links are
WanProxies on a thread of this process (bench/wan_links.py). The two paths decode the same
greedy tokens taking turns token by token, so machine noise hits both alike; the figures are the
medians of the decode steps' layer calls (one token each) and of PINGs.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moeswarm_bench.bench.wan_links import wan_links
from moeswarm.errors import MoeSwarmError
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import spawn_worker, stop, wait_listening
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.source import open_source
from moeswarm.progress import progress
from moeswarm.swarm import Swarm, open_swarm
from moeswarm.transport.tls import client_context, write_swarm_key
from moeswarm_bench.wan import LinkProfile

PROMPT = [5, 17, 42, 8, 99, 23, 11, 60]


def run_relay_bench(model: str, rtt_ms: float = 50.0, steps: int = 16, repeats: int = 3) -> dict:
    experts = range(num_experts_in_config(open_source(model).config))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        key = write_swarm_key(Path(tmp) / "swarm.key")
        tls = client_context(key)
        relay = _start_relay()
        stack.callback(stop, [relay])
        relay_at = _listening(relay, "relay")
        half = LinkProfile(rtt_s=rtt_ms / 2000)
        # link 0: the backbone's to the relay, link 1: the WAN worker's to the relay (both half the RTT).
        links = stack.enter_context(wan_links([relay_at, relay_at], half))
        workers = [spawn_worker(model, experts, extra_args=("--swarm-key", str(key), "--relay", where))
                   for where in (relay_at, links.addresses[1])]
        stack.callback(stop, workers)
        direct = [wait_listening(worker) for worker in workers]
        routes = [_route(worker) for worker in workers]
        full = stack.enter_context(wan_links([direct[1]], LinkProfile(rtt_s=rtt_ms / 1000)))
        wan_relay = f"relay://{links.addresses[0]}/{routes[1].rsplit('/', 1)[1]}"
        scenarios = {
            "loopback": {"direct": direct[0], "relay": routes[0]},
            f"wan_{rtt_ms:g}ms": {"direct": full.addresses[0], "relay": wan_relay},
        }
        rows = [_measure(name, paths, model, tls, steps, repeats) for name, paths in scenarios.items()]
    return {"model": model, "tls": True, "decode_steps": steps, "repeats": repeats, "rtt_ms": rtt_ms, "rows": rows}


def _measure(name: str, paths: dict[str, str], model: str, tls, steps: int, repeats: int) -> dict:
    with contextlib.ExitStack() as stack:
        swarms = {kind: stack.enter_context(open_swarm(model, [address], tls=tls)) for kind, address in paths.items()}
        return _alternate(name, swarms, steps, repeats)


def _alternate(name: str, swarms: dict[str, Swarm], steps: int, repeats: int) -> dict:
    calls: dict[str, list[float]] = {kind: [] for kind in swarms}
    pings: dict[str, list[float]] = {kind: [] for kind in swarms}
    for _ in progress(range(repeats), desc=f"relay bench, {name}: {steps} decode steps direct and relayed", unit="repeat"):
        for kind, seconds in _interleaved_decode(swarms, steps).items():
            calls[kind] += seconds
        for kind, swarm in swarms.items():
            pings[kind] += [swarm.ping(0) for _ in range(10)]
    row = {"scenario": name, "layer_calls": {kind: len(seconds) for kind, seconds in calls.items()}}
    for kind in swarms:
        row[f"{kind}_layer_call_ms_p50"] = 1000 * statistics.median(calls[kind])
        row[f"{kind}_layer_call_ms_mean"] = 1000 * statistics.fmean(calls[kind])
        row[f"{kind}_ping_ms_p50"] = 1000 * statistics.median(pings[kind])
    row["relay_overhead_pct"] = 100 * (row["relay_layer_call_ms_p50"] / row["direct_layer_call_ms_p50"] - 1)
    row["relay_ping_overhead_pct"] = 100 * (row["relay_ping_ms_p50"] / row["direct_ping_ms_p50"] - 1)
    row["paths"] = {kind: swarm.accounting()["worker_paths"] for kind, swarm in swarms.items()}
    return row


def _interleaved_decode(swarms: dict[str, Swarm], steps: int) -> dict[str, list[float]]:
    """Seconds of each one-token layer call, the paths taking turns token by token (after a prefill
    each), so that the other jobs on this machine slow both alike."""
    steppers, tokens = {}, {}
    for kind, swarm in swarms.items():
        swarm.reset_accounting()
        steppers[kind] = Stepper(swarm.model)
        tokens[kind] = int(steppers[kind].forward(PROMPT)[-1].argmax())
    for _ in range(steps):
        for kind, stepper in steppers.items():
            tokens[kind] = int(stepper.forward([tokens[kind]])[-1].argmax())
    return {kind: [call.seconds for call in swarm.layer_calls() if call.tokens == 1] for kind, swarm in swarms.items()}


def _start_relay() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moeswarm.cli", "relay", "--host", "127.0.0.1", "--port", "0",
                             "--log-level", "WARNING"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _listening(process: subprocess.Popen, what: str) -> str:
    line = process.stdout.readline()
    if "listening on " not in line:
        raise MoeSwarmError(f"{what} did not start: {process.stderr.read().strip()[-2000:]}")
    return line.split("listening on ", 1)[1].split()[0]


def _route(worker: subprocess.Popen) -> str:
    line = worker.stdout.readline()
    if "reachable through " not in line:
        raise MoeSwarmError(f"worker did not register at the relay: {worker.stderr.read().strip()[-2000:]}")
    return line.split("reachable through ", 1)[1].strip()


def report_lines(result: dict) -> list[str]:
    lines = [f"relay vs direct, TLS on every path, {result['decode_steps']} decode steps x {result['repeats']} repeats "
             f"(medians):"]
    for row in result["rows"]:
        lines.append(f"  {row['scenario']:>10}: layer call direct {row['direct_layer_call_ms_p50']:.3f} ms, relay "
                     f"{row['relay_layer_call_ms_p50']:.3f} ms ({row['relay_overhead_pct']:+.1f} %); PING direct "
                     f"{row['direct_ping_ms_p50']:.3f} ms, relay {row['relay_ping_ms_p50']:.3f} ms "
                     f"({row['relay_ping_overhead_pct']:+.1f} %)")
    return lines
