"""A worker put together: `open_worker` beside `swarm.open_swarm` (`run_worker`: one served until a stop signal).

A node is a WorkerServer (server.py) with, as configured, its registration at a relay (for a
worker behind NAT: relay/worker.py) and its announcement on the swarm's DHT (discovery/). The
order matters and lives here once: the port is checked and the DHT joined before the experts
load (a busy port or a bad peer fails fast, and the DHT's process forks small); the throughput
it announces is measured before any request is taken; on the way out the announcement is
withdrawn first, so backbones stop choosing this worker before it stops answering.

What the node has to say (where it listens, the swarm it started, its relay route) goes to
`report`, one line at a time: printing is the command's business.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from moeswarm.stop_signal import stop_event
from moeswarm.worker.config import WorkerConfig
from moeswarm.worker.limits import model_top_k
from moeswarm.worker.listen import check_can_listen, raise_open_files_limit
from moeswarm.worker.server import WorkerServer

if TYPE_CHECKING:
    from moeswarm.discovery.announce import Announcer
    from moeswarm.discovery.dht import SwarmDht
    from moeswarm.sources.source import ModelSource
    from moeswarm.worker.store import ExpertStore

RELAY_REGISTER_TIMEOUT_S = 15.0
Report = Callable[[str], None]


def open_worker(config: WorkerConfig, load: Callable[[], tuple[ExpertStore, ModelSource]],
                report: Report = lambda line: None, dht: SwarmDht | None = None) -> WorkerNode:
    """Check the port, join the DHT (with `config.swarm`), then `load()` the experts and build the server.

    dht: a DHT node already joined (`moeswarm join` reads the coverage on it first): used instead of
    opening one, and closed with the node.

    load: returns (the experts to serve, their model's source); called once, after the checks that
    fail fast. The node is not listening yet: `await node.serve(stop)` (or start/stop) runs it;
    `close()` leaves the DHT. MoeSwarmError (one line) for a busy port, a bad peer, an address
    that cannot be announced.
    """
    check_can_listen(config.host, config.port)
    raise_open_files_limit(config.limits.max_connections)
    if dht is None and config.swarm is not None:
        dht = _open_dht(config, report)
    try:
        return build_node(config, load, report, dht)
    except BaseException:
        if dht is not None:
            dht.close()
        raise


def build_node(config: WorkerConfig, load: Callable[[], tuple[ExpertStore, ModelSource]],
               report: Report = lambda line: None, dht: SwarmDht | None = None) -> WorkerNode:
    """`load()` the experts and build the node on `dht` (left open whatever happens: the caller's).

    A member moving its share (node/rebalancing.py) builds its next node so, beside the one
    serving, on the DHT node they share; set the old node's `dht` to None before closing it."""
    store, source = load()
    server = WorkerServer(store, source.fingerprint, source.config.model_type, config.limits, config.tls,
                          top_k=model_top_k(source.config), inline_tokens=config.inline_tokens)
    return WorkerNode(config, server, source, dht, report)


def run_worker(config: WorkerConfig, load: Callable[[], tuple[ExpertStore, ModelSource]], report: Report = lambda line: None,
               stop_signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
               dht: SwarmDht | None = None) -> WorkerNode:
    """`open_worker`, then serve until one of `stop_signals` arrives; returns the node, stopped and closed
    (its server's counts still readable)."""
    with open_worker(config, load, report, dht) as node:
        asyncio.run(_serve_until(node, stop_signals))
    return node


async def _serve_until(node: WorkerNode, stop_signals: Sequence[signal.Signals]) -> None:
    await node.serve(stop_event(stop_signals))


class WorkerNode:
    """A worker's server, relay registration and announcement, started and stopped together."""

    def __init__(self, config: WorkerConfig, server: WorkerServer, source: ModelSource, dht: SwarmDht | None,
                 report: Report):
        self.config = config
        self.server = server
        self.source = source
        self.dht = dht
        self.report = report
        self.address: tuple[str, int] | None = None  # (host, port) once listening
        self.route: str | None = None  # relay://HOST:PORT/NAME once registered at the relay
        self.announcer: Announcer | None = None
        # Measured before the server takes requests (the store runs one call at a time); only announced.
        self.tokens_per_s = _throughput(server.store, source) if dht is not None else 0.0
        self._tasks: list[asyncio.Task] = []  # the relay registration's

    async def serve(self, stop: asyncio.Event) -> None:
        """Start, serve until `stop` is set (or this task is cancelled), then stop everything."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    async def start(self) -> tuple[str, int]:
        """Listen, register at the relay, announce; return the bound (host, port)."""
        server, source = self.server, self.source
        self.address = host, port = await server.start(self.config.host, self.config.port)
        self.report(f"listening on {host}:{port} model {source.config.model_type} {source.fingerprint} "
                    f"{server.store.describe()}")
        try:
            if self.config.relay is not None:
                await self._attach_relay()
            if self.dht is not None:
                await self._announce(port)
        except BaseException:
            await self.stop()
            raise
        return self.address

    async def stop(self) -> None:
        """Withdraw the announcement, leave the relay, close the server (its connections, its compute thread)."""
        await self.withdraw()
        tasks, self._tasks = self._tasks, []  # the relay's
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.server.close()

    async def withdraw(self) -> None:
        """Withdraw the announcement and go on serving: backbones drop this node at their next look."""
        if self.announcer is not None:
            announcer, self.announcer = self.announcer, None
            await asyncio.get_running_loop().run_in_executor(None, announcer.stop)

    def close(self) -> None:
        """Leave the DHT (after `stop`)."""
        if self.dht is not None:
            self.dht.close()
            self.dht = None

    def __enter__(self) -> WorkerNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def _attach_relay(self) -> None:
        from moeswarm.relay.worker import RelayAttachment, relay_identity

        name, identity = relay_identity(self.config.swarm_key, self.config.relay_name)  # a keyed relay asks for it
        attachment = RelayAttachment(self.server, self.config.relay, name, self.config.relay_pool, identity)
        self._tasks.append(asyncio.create_task(attachment.run()))
        await attachment.wait_registered(timeout_s=RELAY_REGISTER_TIMEOUT_S)  # RelayError when the first one fails
        self.route = attachment.route
        self.report(f"reachable through {self.route}")

    async def _announce(self, port: int) -> None:
        from moeswarm.discovery.announce import Announcer, announce_address, moeswarm_version
        from moeswarm.discovery.record import Announcement, Capacity

        store, limits, config = self.server.store, self.config.limits, self.config
        address = announce_address(config.host, port, config.announce_host)
        # with a relay route the record offers both paths (backbones probe the direct one first)
        record = Announcement(f"{address}+{self.route}" if self.route else address, self.source.fingerprint,
                              self.source.config.model_type, store.num_experts, store.hidden_size, store.held,
                              tls=config.tls is not None, capacity=Capacity(limits.max_connections, limits.max_tokens),
                              throughput=self.tokens_per_s, version=moeswarm_version(), started=time.time())
        announcer = Announcer(self.dht, record, config.announce_ttl_s, refresh=_load_refresh(store, config.announce_ttl_s))
        await asyncio.get_running_loop().run_in_executor(None, announcer.start)
        self.announcer = announcer
        self.report(f"announced on the swarm as {announcer.record.address} ({self.tokens_per_s:.0f} tokens/s measured)")


def _open_dht(config: WorkerConfig, report: Report) -> SwarmDht:
    """The worker's DHT node; for a new swarm (no peers) its address line goes to `report`."""
    from moeswarm.discovery.announce import announce_address
    from moeswarm.discovery.dht import SwarmDht

    announce_address(config.host, 1, config.announce_host)  # refuse 0.0.0.0 without an announce host, before loading
    keys = {}
    if config.swarm_key:
        from moeswarm.transport.member_cert import Authority, Identity

        keys = {"authority": Authority.load(config.swarm_key), "identity": Identity.load(config.swarm_key)}
    dht = SwarmDht.open(list(config.swarm), host=config.host, port=config.dht_port, **keys)
    if not config.swarm:
        report(f"started a new swarm; join it with --swarm {','.join(dht.addresses())}")
    return dht


def _load_refresh(store: ExpertStore, span_s: float):
    """The announcement's refresh: the record with the rows per minute its experts computed over
    the last `span_s` (worker/served.py), counted from now (the start-up measurement is not load);
    None for a store that counts nothing."""
    import dataclasses

    from moeswarm.worker.served import LoadWindow

    served = getattr(store, "served", None)
    if served is None:
        return None
    window = LoadWindow(served, span_s)
    window.mark()

    def refresh(record):
        rates = window.rates()
        return record if rates is None else dataclasses.replace(record, load=rates)

    return refresh


def _throughput(store: ExpertStore, source: ModelSource) -> float:
    """Tokens per second through every held layer, measured now."""
    from moeswarm.discovery.announce import measure_throughput

    return measure_throughput(store, getattr(source.config, "num_experts_per_tok", None) or 1)
