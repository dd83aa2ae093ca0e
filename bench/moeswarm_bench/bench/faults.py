"""`moeswarm bench faults`: generations through faults, the tail with one slow worker, spot checks.

1. Generations: a small model, 2 worker processes each holding every expert (each expert held
   twice), each behind its own WAN emulator link. Every generation draws one fault and the layer
   call at which it strikes: none, a reset, a short stall (under the deadline floor), a long stall
   (over it), close-after-N-bytes, a slow link, or SIGKILL of the worker (restarted on the same
   port after the generation; the dispatcher re-admits it after HELLO and PING). Each generation
   is compared with the local eager model at every step (`torch.equal` of the logits).
2. Tail: one link stalls 1 layer call in 20 for 1 s; layer-call latency with and without hedging.
3. Spot checks (bench/lying.py): steps until a lying link is banned, and what checking costs.
4. Liars: greedy generations with a liar (zeros, 1 % noise, 1e30 on one row) among 2 and 3
   holders at 5 % and 20 % spot checks; steps until the ban, and outputs that differ from the
   local model's with the tainted steps rolled back (and as first emitted, without rollback).
"""

from __future__ import annotations

import os
import random
import sys
import signal
import statistics
import time

from moeswarm_bench.bench.injector import Injector
from moeswarm_bench.bench.lying import check_cost, detection_trials, liar_trials
from moeswarm_bench.bench.wan_links import wan_links
from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.engine.generate import generate
from moeswarm.local.workers import replicated_split, spawn_worker, stop, wait_listening
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.loading import load_local
from moeswarm.sources.source import open_source
from moeswarm.swarm import open_swarm
from moeswarm_bench.wan import LinkProfile

FAULTS = ("none", "reset", "stall-short", "stall-long", "close-after", "slow-link", "sigkill")
WEIGHTS = (2, 2, 2, 2, 2, 2, 1)  # a SIGKILL costs a worker restart (seconds of model loading): drawn half as often
LINK = LinkProfile(rtt_s=0.002)
RECOVERY_TIMEOUT_S = 90.0


class Cluster:
    """The worker processes (restartable on their port) and their WAN links."""

    def __init__(self, model: str, expert_sets: list[list[int]]):
        self.model, self.expert_sets = model, expert_sets
        self.processes = [spawn_worker(model, experts) for experts in expert_sets]
        self.addresses = [wait_listening(p) for p in self.processes]

    def kill(self, worker: int) -> None:
        self.processes[worker].kill()

    def restart(self, worker: int) -> None:
        self.processes[worker].wait()
        port = int(self.addresses[worker].rsplit(":", 1)[1])
        self.processes[worker] = spawn_worker(self.model, self.expert_sets[worker], port=port)
        wait_listening(self.processes[worker])

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
        stop(self.processes)


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_generations(model: str, generations: int, new_tokens: int = 8, seed: int = 0) -> dict:
    rng = random.Random(seed)
    source = open_source(model)
    vocab = source.config.vocab_size
    reference = load_local(model)
    cluster = Cluster(model, replicated_split(num_experts_in_config(source.config), 2))
    rows = []
    try:
        injector = Injector()
        with wan_links(cluster.addresses, LINK, seed) as links, \
                open_swarm(model, links.addresses, wrap_link=injector.watch) as swarm:
            injector.swarm = swarm
            layers = len(swarm.moe_layers)
            for generation in range(generations):
                kind = FAULTS[generation] if generation < len(FAULTS) else rng.choices(FAULTS, WEIGHTS)[0]
                worker = rng.randrange(2)
                at_call = rng.randint(1, layers * new_tokens)
                injector.arm(at_call, _fault(kind, worker, links, cluster, rng))
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
                swarm.reset_accounting()
                before = swarm.resilience()
                started = time.perf_counter()
                try:
                    result = generate(swarm, prompt, new_tokens, 0, reference)
                    completed, identical, error = len(result.tokens) == new_tokens, result.bit_identical is True, None
                except MoeSwarmError as failure:
                    completed, identical, error = False, False, one_line(failure)
                    progress(f"  standing: {swarm.standing()}")
                seconds = time.perf_counter() - started
                after = swarm.resilience()
                recovery = _recover(kind, worker, links, cluster, swarm)
                progress(f"generation {generation}: {kind} on worker {worker} at call {at_call}: "
                         f"{'ok' if completed and identical else 'FAILED ' + str(error)} in {seconds:.2f} s "
                         f"(recovery {recovery:.2f} s)")
                rows.append({"generation": generation, "fault": kind, "worker": worker, "at_call": at_call,
                             "completed": completed, "identical": identical, "seconds": seconds,
                             "recovery_seconds": recovery, "error": error,
                             **{k: after[k] - before[k] for k in ("failovers", "deadline_misses", "hedges", "readmissions")}})
    finally:
        cluster.close()
    return {"generations": rows, "summary": _summarize(rows)}


def _fault(kind: str, worker: int, links, cluster: Cluster, rng: random.Random):
    proxy = links.proxies[worker]
    if kind == "none":
        return lambda: None
    if kind == "reset":
        return lambda: links._call(_run(proxy.reset))
    if kind == "stall-short":
        return lambda: links._call(_run(proxy.stall, 0.5))
    if kind == "stall-long":
        return lambda: links._call(_run(proxy.stall, 3.0))
    if kind == "close-after":
        extra = rng.randint(30, 3000)  # lands inside a header, metadata or tensor bytes
        return lambda: links._call(_close_after(proxy, extra))
    if kind == "slow-link":
        return lambda: links.set_profile(worker, rtt_s=0.03, bandwidth_bps=2e6)
    return lambda: cluster.kill(worker)


async def _run(function, *args):
    return function(*args)


async def _close_after(proxy, extra: int) -> None:
    sent = max((c.bytes_up for c in proxy.connections), default=0)
    proxy.close_after(sent + extra)


def _recover(kind: str, worker: int, links, cluster: Cluster, swarm) -> float:
    """Undo the fault and wait until both holders are in use again; seconds it took."""
    started = time.perf_counter()
    for proxy in links.proxies:
        links._call(_run(proxy.clear))
    if kind == "sigkill":
        cluster.restart(worker)
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while swarm.readmit() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not all(s["up"] for s in swarm.standing()):
        raise MoeSwarmError(f"holders not back in use after {RECOVERY_TIMEOUT_S:.0f} s: {swarm.standing()}")
    return time.perf_counter() - started


def _summarize(rows: list[dict]) -> dict:
    clean = [r["seconds"] for r in rows if r["fault"] == "none"] or [float("nan")]
    per_fault = {}
    for kind in FAULTS:
        mine = [r for r in rows if r["fault"] == kind]
        if mine:
            per_fault[kind] = {"generations": len(mine), "completed": sum(r["completed"] for r in mine),
                               "identical": sum(r["identical"] for r in mine),
                               "seconds_mean": statistics.mean(r["seconds"] for r in mine),
                               "seconds_max": max(r["seconds"] for r in mine),
                               "extra_seconds_mean": statistics.mean(r["seconds"] for r in mine) - statistics.mean(clean),
                               "failovers": sum(r["failovers"] for r in mine)}
    return {"generations": len(rows), "completed": sum(r["completed"] for r in rows),
            "identical": sum(r["identical"] for r in rows), "per_fault": per_fault}


def run_tail(model: str, layer_calls: int = 400, every: int = 20, stall_s: float = 1.0, seed: int = 0) -> list[dict]:
    """Layer-call latency when one link stalls 1 call in `every` for `stall_s`, hedging off and on."""
    source = open_source(model)
    vocab = source.config.vocab_size
    cluster = Cluster(model, replicated_split(num_experts_in_config(source.config), 2))
    out = []
    try:
        for hedge in (False, True):
            stalls = _EveryNth(every, stall_s)
            with wan_links(cluster.addresses, LINK, seed) as links, \
                    open_swarm(model, links.addresses, hedge=hedge, wrap_link=stalls.watch) as swarm:
                stalls.swarm = swarm
                stalls.action = lambda: links._call(_run(links.proxies[0].stall, stall_s))
                rng = random.Random(seed)
                swarm.reset_accounting()
                while len(swarm.layer_calls()) < layer_calls:
                    generate(swarm, [rng.randrange(vocab) for _ in range(4)], 16)
                ms = sorted(1000 * c.seconds for c in swarm.layer_calls()[:layer_calls])
                pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
                out.append({"hedging": hedge, "layer_calls": len(ms), "stalls": stalls.stalls, "p50_ms": pick(0.5),
                            "p95_ms": pick(0.95), "p99_ms": pick(0.99), "max_ms": ms[-1],
                            "mean_ms": statistics.mean(ms), **{k: v for k, v in swarm.resilience().items()
                                                                 if k in ("hedges", "hedge_wins", "failovers")}})
    finally:
        cluster.close()
    return out


class _EveryNth(Injector):
    """Runs `action` (a stall of `stall_s`) before every `every`-th layer call made outside a stall:
    calls made while the link is stalled do not count, so with or without hedging the link stalls
    once per `every` calls that it could have served."""

    def __init__(self, every: int, stall_s: float):
        super().__init__()
        self.every, self.stall_s, self.action, self.stalls, self._stalled_until = every, stall_s, None, 0, 0.0
        self.calls, self._seen = 0, 0  # layer calls counted, and the last one seen (a call may send to both links)

    def before_request(self) -> None:
        call = self.swarm.layer_call_number()
        if call == self._seen:
            return
        self._seen = call
        now = time.monotonic()
        if now >= self._stalled_until:
            self.calls += 1
            if self.calls % self.every == 0:
                self.stalls += 1
                self._stalled_until = now + self.stall_s
                self.action()


def run_spot_checks(model: str, trials: int = 10, max_steps: int = 200, seed: int = 0) -> dict:
    """Detection of a lying link (zeros; noise on 1 % of rows) at 1, 5 and 20 % sampling, and the cost."""
    experts = list(range(num_experts_in_config(open_source(model).config)))
    cluster = Cluster(model, [experts, experts])
    try:
        detection = [detection_trials(model, cluster.addresses, how, fraction, trials, max_steps, tokens, seed)
                     for how, tokens in (("zeros", 1), ("noise", 1), ("noise", 64))
                     for fraction in (0.01, 0.05, 0.2)]
        cost = [check_cost(model, cluster.addresses, fraction, 100, 1, seed) for fraction in (0.0, 0.05, 0.2, 1.0)]
    finally:
        cluster.close()
    return {"detection": detection, "cost": cost}


def run_liars(model: str, trials: int = 3, max_steps: int = 64, new_tokens: int = 16, seed: int = 0) -> list[dict]:
    """Liars among 2 and 3 holders (bench/lying.py `liar_trials`), on 2 worker processes holding every expert."""
    experts = list(range(num_experts_in_config(open_source(model).config)))
    reference = load_local(model)
    cluster = Cluster(model, [experts, experts])
    rows = []
    try:
        for how in ("zeros", "noise", "huge"):
            for fraction in (0.05, 0.2):
                for holders in (2, 3):
                    row = liar_trials(model, cluster.addresses, reference, how, fraction, holders, trials, max_steps,
                                      new_tokens, seed)
                    progress(_liar_line(row))
                    rows.append(row)
    finally:
        cluster.close()
    return rows


def _liar_line(row: dict) -> str:
    mean = "-" if row["steps_to_ban_mean"] is None else f"{row['steps_to_ban_mean']:.1f}"
    return (f"liar={row['liar']:<5} checks={row['fraction']:>4.0%} holders={row['holders']}: caught "
            f"{row['detected']}/{row['trials']} (steps to ban mean {mean}, max {row['steps_to_ban_max']}), "
            f"outputs changed {row['outputs_changed']}/{row['generations']} with rollback, "
            f"{row['outputs_changed_without_rollback']} without; rollbacks {row['rollbacks']}, "
            f"honest banned {row['honest_banned']}")


def run_faults(model: str, generations: int = 100, parts: tuple[str, ...] = ("generations", "tail", "spot-checks", "liars"),
               seed: int = 0, liar_trials_per_case: int = 3) -> dict:
    result: dict = {"model": model, "seed": seed}
    if "generations" in parts:
        result["faults"] = run_generations(model, generations, seed=seed)
    if "tail" in parts:
        result["tail"] = run_tail(model, seed=seed)
    if "spot-checks" in parts:
        result["spot_checks"] = run_spot_checks(model, seed=seed)
    if "liars" in parts:
        result["liars"] = run_liars(model, liar_trials_per_case, seed=seed)
    return result


def report_lines(result: dict) -> list[str]:
    """The text `moeswarm bench faults` prints."""
    lines = []
    if "faults" in result:
        s = result["faults"]["summary"]
        lines.append(f"generations  {s['completed']}/{s['generations']} completed, {s['identical']}/{s['generations']} "
                     f"bit-identical to local")
        lines.append(f"{'fault':<12} {'runs':>4} {'done':>4} {'same':>4} {'mean s':>7} {'max s':>7} {'extra s':>8} {'failovers':>9}")
        for kind, r in s["per_fault"].items():
            lines.append(f"{kind:<12} {r['generations']:>4} {r['completed']:>4} {r['identical']:>4} {r['seconds_mean']:>7.3f} "
                         f"{r['seconds_max']:>7.3f} {r['extra_seconds_mean']:>8.3f} {r['failovers']:>9}")
    for row in result.get("tail", []):
        lines.append(f"tail hedging={'on ' if row['hedging'] else 'off'} calls={row['layer_calls']} stalls={row['stalls']} "
                     f"p50={row['p50_ms']:.2f} p95={row['p95_ms']:.2f} p99={row['p99_ms']:.2f} max={row['max_ms']:.1f} ms "
                     f"hedges={row['hedges']} wins={row['hedge_wins']}")
    for row in result.get("spot_checks", {}).get("detection", []):
        lines.append(f"liar={row['liar']:<5} tokens/step={row['tokens_per_step']:<3} sampling={row['fraction']:.0%}: "
                     f"caught {row['detected']}/{row['trials']} within {row['max_steps']} steps "
                     f"(mean {row['steps_to_ban_mean']} steps)")
    for row in result.get("liars", []):
        lines.append(_liar_line(row))
    for row in result.get("spot_checks", {}).get("cost", []):
        lines.append(f"check cost sampling={row['fraction']:.0%}: {row['ms_per_step']:.2f} ms/step, "
                     f"{row['bytes_per_step']:.0f} B/step, {row['checks']} checks")
    return lines
