"""What running workers serve, and their PING round trip: `moeswarm ping`'s measurement.

A worker tells what it holds only in its answer to a HELLO that carries the right model
fingerprint (docs/protocol.md), so the model is opened for its fingerprint (headers and 128 KiB of
data: no weights load) and each worker is greeted as a backbone would greet it.
"""

from __future__ import annotations

import ssl
import statistics
from collections.abc import Sequence

from moeswarm.errors import MoeSwarmError, one_line
from moeswarm.sources.source import open_source
from moeswarm.transport.path import PROBE_TIMEOUT_S, worker_link


def ping_workers(model: str, addresses: Sequence[str], count: int,
                 tls: ssl.SSLContext | None = None) -> tuple[str, list[dict]]:
    """(the model's fingerprint, one `ping_worker` report per address)."""
    fingerprint = open_source(model).fingerprint
    return fingerprint, [ping_worker(address, fingerprint, count, tls) for address in addresses]


def ping_worker(address: str, fingerprint: str, count: int, tls: ssl.SSLContext | None = None,
                probe_timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """One worker's HELLO answer and `count` PING round trips; {"ok": False, "error"} when it fails.
    probe_timeout_s: how long a path may take to answer (transport/path.py)."""
    try:
        link = worker_link(address, probe_timeout_s, tls)[1]  # HOST:PORT, relay://RELAY:PORT/NAME or both (docs/network.md)
    except MoeSwarmError as error:
        return {"address": address, "ok": False, "error": one_line(error)}
    try:
        info = link.connect(fingerprint)
        rtts = [link.ping() for _ in range(count)]  # seconds
    except MoeSwarmError as error:
        return {"address": address, "ok": False, "error": one_line(error)}
    finally:
        link.close()
    return {
        "address": address, "ok": True, "fingerprint": info.fingerprint, "model_type": info.model_type,
        "num_experts": info.num_experts, "hidden_size": info.hidden_size,
        "held": {str(layer): list(experts) for layer, experts in sorted(info.held.items())},
        "codecs": list(info.codecs), "pings": count,
        "rtt_us_min": 1e6 * min(rtts), "rtt_us_p50": 1e6 * statistics.median(rtts),
    }
