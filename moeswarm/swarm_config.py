"""Everything that says how a backbone talks to its expert holders, in one frozen object.

Built once, from the command line by the shared flag group (commands/_swarm_flags.py) or by hand in
code, and passed to `open_swarm(model, workers, config)`. Defaults are written here and nowhere
else.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moeswarm.dispatch.health import REPLY_TIMEOUT_S
from moeswarm.discovery.follow import DiscoveryOptions
from moeswarm.wire.config import EXACT, WireConfig


@dataclass(frozen=True)
class SwarmConfig:
    wire: WireConfig = EXACT  # codecs and combine mode (docs/wire.md)
    fanout: str = "star"  # star: every holder at once; chain: one after another
    reply_timeout_s: float = REPLY_TIMEOUT_S  # the cap on any holder's deadline (docs/failover.md)
    hedge: bool = True  # send a late share's duplicate to a replica holding its experts
    spot_check: float = 0.0  # the fraction of remote answers recomputed by another holder
    spot_check_seed: int | None = None
    # experts held in this process, through the same link interface as a worker: the same ids for
    # every MoE layer, or {layer: experts}; None with no workers and no discovery: every expert (the local mode)
    local_experts: Sequence[int] | Mapping[int, Sequence[int]] | None = None
    tls: ssl.SSLContext | None = None  # the swarm key's client context: mutual TLS to every worker; None: plain TCP
    discovery: DiscoveryOptions | None = None  # find the workers on the swarm's DHT, and follow joins and leaves
    # the packed forwards' keys and values: "model" (the backbone's dtype) or "f16" (forward/sequence_cache.py)
    kv_cache: str = "model"
