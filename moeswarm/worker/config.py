"""What `moeswarm worker` is told: where it listens and how it is found (WorkerConfig), and which
experts it holds (Hosting). Each field is a flag of the command.

Nothing here imports torch: the command builds both before the worker's modules load.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from moeswarm.placement.plan_file import LayerExperts
from moeswarm.worker.limits import WorkerLimits

DEFAULT_ANNOUNCE_TTL_S = 30.0
# A DISPATCH of at most this many tokens runs on the event loop when the compute thread is idle (a
# decode step's, drafts included: its experts take a few ms at most, at real dimensions too).
INLINE_TOKENS = 8


@dataclass(frozen=True)
class WorkerConfig:
    """Where a worker listens, what it accepts, and how backbones find it (each a `moeswarm worker` flag)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    inline_tokens: int = INLINE_TOKENS  # 0: every DISPATCH goes to the compute thread (worker/runner.py run_here)
    tls: ssl.SSLContext | None = None  # the swarm key's server context (transport/tls.py); None: plain TCP
    swarm_key: str | None = None  # its file: the DHT's member certificates and the relay's proof of name
    relay: tuple[str, int] | None = None  # keep idle connections registered at this relay
    relay_name: str | None = None  # None: the member's name, or a random one
    relay_pool: int = 2
    swarm: tuple[str, ...] | None = None  # DHT peers to announce on; (): start a new swarm; None: no DHT
    announce_host: str | None = None  # the address backbones dial (default: host)
    announce_ttl_s: float = DEFAULT_ANNOUNCE_TTL_S
    dht_port: int = 0


@dataclass(frozen=True)
class Hosting:
    """Which of a model's experts a worker holds (worker/hosting.py loads them).

    experts: one list for every layer, or {layer: experts}; None: what the model source holds (every
    expert, or a slice file's). layers: an inclusive MoE layer range for the one-list form. Or
    plan + plan_worker: that worker's part of a `moeswarm plan` file (then neither of the others).
    """

    model: str
    experts: list[int] | LayerExperts | None = None
    layers: tuple[int, int] | None = None
    plan: str | None = None
    plan_worker: str | None = None
