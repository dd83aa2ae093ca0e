"""`moeswarm bench discovery`: how fast a backbone follows the swarm on hivemind's DHT (loopback).

Two workers split the experts; a backbone finds them as `--swarm` does and decodes without
pause. Each round a replica of every expert joins (seconds from its announcement to the first
layer call it answers), then is killed outright (seconds until the backbone drops it: its record
must expire, within a TTL), then another joins and stops cleanly (seconds until it is dropped: its
record is withdrawn, about one poll). Wall-clock figures: on a shared machine, say so.
"""

from __future__ import annotations

import statistics
import subprocess
import time

from moeswarm.errors import MoeSwarmError
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import spawn_worker, split_experts, stop
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.source import open_source
from moeswarm.discovery.dht import SwarmDht
from moeswarm.discovery.follow import DiscoveryOptions
from moeswarm.swarm import Swarm, open_swarm

STEP_PAUSE_S = 0.02  # between decode steps: the backbone is busy but not spinning
LIMIT_S = 300.0


def run_discovery(model: str, rounds: int = 3, ttl_s: float = 30.0, poll_s: float = 2.0) -> dict:
    num_experts = num_experts_in_config(open_source(model).config)
    everything = list(range(num_experts))
    bootstrap = SwarmDht.open([], host="127.0.0.1")
    peer = bootstrap.addresses()[0]
    spawn = lambda experts: spawn_worker(model, experts, extra_args=["--swarm", peer, "--announce-ttl", str(ttl_s)])  # noqa: E731
    workers = [spawn(experts) for experts in split_experts(num_experts, 2)]
    figures: dict[str, list[float]] = {"join_s": [], "kill_drop_s": [], "stop_drop_s": []}
    try:
        for worker in workers:
            _announced(worker)
        with open_swarm(model, [], discovery=DiscoveryOptions((peer,), poll_s=poll_s)) as swarm:
            decoder = _Decoder(swarm)
            for _ in range(rounds):
                for how in ("kill", "stop"):
                    newcomer = spawn(everything)
                    workers.append(newcomer)
                    address, announced_at = _announced(newcomer)
                    decoder.until(lambda: decoder.answered_by(address))
                    figures["join_s"].append(time.monotonic() - announced_at)
                    if how == "kill":
                        newcomer.kill()
                    else:
                        newcomer.terminate()
                    gone_at = time.monotonic()
                    decoder.until(lambda: address not in swarm.members())
                    figures[f"{how}_drop_s"].append(time.monotonic() - gone_at)
                    newcomer.wait()
    finally:
        stop(workers)
        bootstrap.close()
    summary = {name: {"p50": statistics.median(values), "max": max(values), "all": values}
               for name, values in figures.items()}
    return {"model": model, "ttl_s": ttl_s, "poll_s": poll_s, "rounds": rounds, **summary}


class _Decoder:
    """Greedy decoding on the swarm, step after step, starting over before the model's positions run out."""

    def __init__(self, swarm: Swarm):
        self.swarm = swarm
        self.positions = getattr(swarm.model.config, "max_position_embeddings", 256)
        self.stepper, self.token = Stepper(swarm.model), 1
        self.seen: set[str] = set()

    def step(self) -> None:
        if self.stepper.length + 1 >= self.positions:
            self.stepper = Stepper(self.swarm.model)
        self.swarm.reset_accounting()
        self.token = int(self.stepper.forward([self.token])[-1].argmax())
        for call in self.swarm.layer_calls():
            self.seen.update(call.worker_seconds)

    def answered_by(self, address: str) -> bool:
        return address in self.seen

    def until(self, done) -> None:
        deadline = time.monotonic() + LIMIT_S
        while not done():
            if time.monotonic() > deadline:
                raise MoeSwarmError(f"the swarm did not change within {LIMIT_S:.0f} s")
            self.step()
            time.sleep(STEP_PAUSE_S)


def _announced(process: subprocess.Popen) -> tuple[str, float]:
    """(address, time.monotonic()) when the worker says it announced itself."""
    while line := process.stdout.readline():
        if "announced on the swarm as " in line:
            return line.split("announced on the swarm as ", 1)[1].split()[0], time.monotonic()
    raise MoeSwarmError(f"worker exited before announcing: {process.stderr.read()[-2000:]}")
