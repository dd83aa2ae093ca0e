"""A worker announcing itself on the DHT: its record, refreshed every TTL/3, withdrawn on a clean exit.

The record expires `ttl_s` after each store, so a worker that vanishes (killed, unplugged) is
forgotten by every backbone within about a TTL; a worker that stops cleanly stores an offline
record (which replaces the live one at once, as the newest expiry wins) so backbones drop it at
their next look.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import threading
import time
from collections.abc import Callable

import torch

from moeswarm.errors import MoeSwarmError
from moeswarm.discovery.dht import STORE_TIMEOUT_S, SwarmDht
from moeswarm.discovery.record import WORKERS, Announcement, RecordKind
from moeswarm.transport.path import canonical_address

log = logging.getLogger("moeswarm.discovery")

DEFAULT_TTL_S = 30.0
BENCH_TOKENS = 16


class Announcer:
    """Keeps one record on the DHT: a worker's Announcement, or a record of another `kind` (a stage's)."""

    def __init__(self, dht: SwarmDht, record: Announcement, ttl_s: float = DEFAULT_TTL_S, kind: RecordKind = WORKERS,
                 refresh: Callable[[Announcement], Announcement] | None = None):
        """refresh: the record to store at each refresh, from the last one (a worker's measured load:
        node/worker.py); None: the same record every time."""
        self.dht = dht
        self.refresh = refresh
        self.record = dataclasses.replace(record, address=canonical_address(record.address))  # as readers require it
        self.ttl_s = ttl_s
        self.kind = kind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="moeswarm-announce", daemon=True)

    def start(self) -> None:
        """Store the record now (MoeSwarmError if no peer takes it), then refresh it every TTL/3."""
        # hivemind reports the answer of whichever replica answered first: a hostile node saying no
        # must not stop a worker whose record the others took, so a refusal is checked by reading back
        if (not self.dht.store(self.record, self.ttl_s, kind=self.kind)
                and self.record.address not in self.dht.fetch(self.record.fingerprint, self.kind)):
            raise MoeSwarmError("could not announce on the swarm: no DHT peer stored the record")
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.refresh is not None:
                    self.record = self.refresh(self.record)
                if not self.dht.store(self.record, self.ttl_s, kind=self.kind):
                    log.warning("announcement refresh: no DHT peer stored the record (retrying)")
            except Exception as error:  # the DHT process may be going down; the next round tries again
                log.warning("announcement refresh failed: %s", error)

    def stop(self) -> None:
        """Stop refreshing and withdraw the record (backbones drop this worker at their next look)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STORE_TIMEOUT_S)  # a refresh in flight ends within its own timeout
        try:
            self.dht.store(self.record.offline(), self.ttl_s, kind=self.kind)
        except Exception as error:  # it expires on its own within a TTL
            log.warning("could not withdraw the announcement: %s", error)


def moeswarm_version() -> str:
    """The installed moeswarm's version, as a worker's or a stage's record says it ("unknown" when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moeswarm")
    except PackageNotFoundError:
        return "unknown"


def announce_address(listen_host: str, port: int, announce_host: str | None) -> str:
    """HOST:PORT that backbones (gateways, for a stage) dial: `announce_host` or the listen host,
    which must then be a real address."""
    host = announce_host or listen_host
    if not announce_host and _unspecified(listen_host):
        raise MoeSwarmError(f"--host {listen_host} listens on every interface, which is not an address to dial: "
                            "give --announce-host with the address others reach this process at")
    return f"{host}:{port}"


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def measure_throughput(store, top_k: int, tokens: int = BENCH_TOKENS) -> float:
    """Tokens per second through every held layer: one DISPATCH of `tokens` random rows per layer,
    each routed to `top_k` of the layer's held experts (timed after one untimed pass). 0.0 when the
    store takes none of the tried dtypes.

    store: an ExpertStore (its `held`, `hidden_size` and `run(Dispatch)`).
    """
    from moeswarm.errors import ProtocolError
    from moeswarm.wire.messages import Dispatch

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # the experts' dtype: the first the store accepts
        requests = []
        for layer, experts in store.held.items():
            k = min(top_k, len(experts))
            held = torch.tensor(experts)
            index = torch.stack([held[torch.randperm(len(experts), generator=generator)[:k]]
                                 for _ in range(tokens)])  # [T, k]
            hidden = torch.randn(tokens, store.hidden_size, generator=generator).to(dtype)  # [T, d]
            requests.append(Dispatch(layer, hidden, index, torch.full((tokens, k), 1.0 / k, dtype=dtype)))
        try:
            for request in requests:  # warm-up: first calls pay for allocations
                store.run(request)
        except ProtocolError:
            continue
        started = time.perf_counter()
        for request in requests:
            store.run(request)
        return tokens / max(time.perf_counter() - started, 1e-9)
    return 0.0
