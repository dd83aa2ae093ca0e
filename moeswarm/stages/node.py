"""A stage put together: `open_stage_node` (what `moeswarm stage` runs) and `open_stage` (its span and holders).

A node is a StageServer (server.py) over the model cut to its span, the span's experts reached
through its own swarm (workers, the DHT, or this process), and, as configured, its record on the
swarm's DHT (discovery/stage_record.py) so gateways find it (`--stages-swarm`). The order lives
here once: the port is checked and the DHT joined before the model loads (a busy port or a bad
peer fails fast); the record is stored once the server listens; on the way out it is withdrawn
first, so gateways stop choosing this stage before it stops answering.

What the node has to say (where it listens, the swarm it started, its announcement) goes to
`report`, one line at a time: printing is the command's business, as are signals and logging.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moeswarm.errors import MoeSwarmError
from moeswarm.forward.packed import install, supports_ragged
from moeswarm.sources.source import ModelSource, as_source, open_source
from moeswarm.stages.server import StageLimits, StageServer
from moeswarm.stages.span import keep_span
from moeswarm.swarm import Swarm, open_swarm
from moeswarm.swarm_config import SwarmConfig

if TYPE_CHECKING:
    from moeswarm.discovery.announce import Announcer
    from moeswarm.discovery.dht import SwarmDht

DEFAULT_ANNOUNCE_TTL_S = 30.0
Report = Callable[[str], None]


@dataclass(frozen=True)
class StageAnnouncement:
    """How a stage announces itself on the swarm's DHT (`--announce-swarm` and its flags).

    peers: DHT peers to join (multiaddrs); (): start a new swarm (its address is reported).
    host: the address gateways dial (default: the listen host, which must then be a real address).
    ttl_s: the record's lifetime, refreshed every third of it.
    dht_port: this stage's DHT node's port, on the listen host (0: a free one).
    swarm_key: the `--swarm-key` file: the record is signed by its member key (discovery/sign.py).
    """

    peers: tuple[str, ...]
    host: str | None = None
    ttl_s: float = DEFAULT_ANNOUNCE_TTL_S
    dht_port: int = 0
    swarm_key: str | None = None


@dataclass(frozen=True)
class StageOptions:
    """A stage: the model and span it serves, where it listens, what it accepts, how it is found."""

    model: str
    span: range
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    workers: tuple[str, ...] = ()  # its experts' holders (none, and no discovery in the config: held here)
    limits: StageLimits = field(default_factory=StageLimits)
    tls: ssl.SSLContext | None = None  # the swarm key's server context; None: plain TCP
    backbone_dtype: str = "file"
    announce: StageAnnouncement | None = None  # None: not on the DHT (gateways list it in --stages)


def open_stage_node(options: StageOptions, swarm_config: Callable[[ModelSource], SwarmConfig],
                    report: Report = lambda line: None, dht: SwarmDht | None = None) -> StageNode:
    """Check the port, join the DHT (with `options.announce`), load the span and reach its experts.

    swarm_config: the SwarmConfig for the model's source (how the span's experts are reached).
    dht: a DHT node already joined to announce on (a stage member moving to another span reuses
    its own: node/stage_member.py); the node then owns it, and it is not closed on a failure here.
    The node is not listening yet: `node.serve()` runs it until `node.stop()`; closing the node
    (a context manager) closes its swarm and leaves the DHT. MoeSwarmError (one line) for a busy
    port, a bad peer, an address that cannot be announced, a span outside the model.
    """
    from moeswarm.worker.listen import check_can_listen

    check_can_listen(options.host, options.port)
    given = dht is not None
    if dht is None and options.announce is not None:
        dht = _open_dht(options, report)
    try:
        source = open_source(options.model, options.backbone_dtype)
        server, swarm = open_stage(source, options.span, list(options.workers), swarm_config(source), options.limits,
                                   options.tls)
    except BaseException:
        if dht is not None and not given:
            dht.close()
        raise
    return StageNode(options, source, server, swarm, dht, report)


class StageNode:
    """A stage's server, its swarm and its announcement, started and stopped together."""

    def __init__(self, options: StageOptions, source: ModelSource, server: StageServer, swarm: Swarm,
                 dht: SwarmDht | None, report: Report):
        self.options, self.source, self.server, self.swarm, self.dht = options, source, server, swarm, dht
        self.report = report
        self.port: int | None = None  # once listening
        self.announcer: Announcer | None = None
        self._stop = threading.Event()

    @property
    def steps(self) -> int:
        return self.server.steps

    def serve(self) -> None:
        """Listen, announce, serve until `stop()`; then withdraw the record and close the server."""
        try:
            self.start()
            self._stop.wait()
        finally:
            self._withdraw()
            self.server.close()

    def start(self) -> int:
        """Listen and announce; return the bound port."""
        options, span = self.options, self.options.span
        self.port = self.server.listen(options.host, options.port)
        self.report(f"listening on {options.host}:{self.port} model {self.source.config.model_type} "
                    f"{self.source.fingerprint} layers {span.start}-{span.stop - 1}")
        if self.dht is not None:
            self._announce()
        return self.port

    def stop(self) -> None:
        """Make `serve` return (safe in a signal handler: it only sets an event)."""
        self._stop.set()

    def close(self) -> None:
        """Close the server (if `serve` did not), the swarm, and leave the DHT."""
        self._withdraw()
        self.server.close()
        self.swarm.close()
        if self.dht is not None:
            self.dht.close()
            self.dht = None

    def __enter__(self) -> StageNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _announce(self) -> None:
        from moeswarm.discovery.announce import Announcer, announce_address, moeswarm_version
        from moeswarm.discovery.stage_record import STAGES, StageRecord

        announce, span = self.options.announce, self.options.span
        record = StageRecord(announce_address(self.options.host, self.port, announce.host), self.source.fingerprint,
                             self.source.config.model_type, span, self.source.config.get_text_config().hidden_size,
                             tls=self.options.tls is not None, version=moeswarm_version(), started=time.time())
        announcer = Announcer(self.dht, record, announce.ttl_s, kind=STAGES)
        announcer.start()
        self.announcer = announcer
        self.report(f"announced on the swarm as {announcer.record.address} layers {span.start}-{span.stop - 1}")

    def withdraw(self) -> None:
        """Withdraw the record (stored offline: gateways reading now no longer find it) and keep
        answering: a gateway whose chain holds this stage goes on until it fails over or leaves."""
        self._withdraw()

    def _withdraw(self) -> None:
        if self.announcer is not None:
            announcer, self.announcer = self.announcer, None
            announcer.stop()  # withdrawn: gateways that look now no longer find it


def open_stage(model_path, span: range, workers: list[str], config: SwarmConfig | None = None,
               limits: StageLimits | None = None, tls_server: ssl.SSLContext | None = None,
               ) -> tuple[StageServer, Swarm]:
    """Load decoder layers `span` of the model (their trunk only), reach their experts (`workers`,
    the swarm, or this process), and return the stage's server (not yet listening) with its swarm
    (close it when the server stops)."""
    source = as_source(model_path)
    total = source.config.get_text_config().num_hidden_layers
    if span.stop > total:  # before anything loads
        raise MoeSwarmError(f"--layers {span.start}-{span.stop - 1}: the model has decoder layers 0-{total - 1}")
    swarm = open_swarm(source, workers, config, layers=span, ends=False)
    try:
        if not supports_ragged(swarm.model):
            raise MoeSwarmError(f"{swarm.model.config.model_type}: its layers keep a state a stage cannot pack "
                                "(recurrent layers, or an index of its own): it cannot be staged")
        install(swarm.model)
        keep_span(swarm.model, span)
        config = config or SwarmConfig()
        server = StageServer(swarm.model, span, source.fingerprint, limits, tls_server, config.tls)
        server.swarm = swarm
    except BaseException:
        swarm.close()
        raise
    return server, swarm


def _open_dht(options: StageOptions, report: Report) -> SwarmDht:
    """The stage's DHT node (a full node: it stores records); for a new swarm its address goes to `report`."""
    from moeswarm.discovery.announce import announce_address
    from moeswarm.discovery.dht import SwarmDht

    announce = options.announce
    announce_address(options.host, 1, announce.host)  # refuse 0.0.0.0 without an announce host, before loading
    keys = {}
    if announce.swarm_key:
        from moeswarm.transport.member_cert import Authority, Identity

        keys = {"authority": Authority.load(announce.swarm_key), "identity": Identity.load(announce.swarm_key)}
    dht = SwarmDht.open(list(announce.peers), host=options.host, port=announce.dht_port, **keys)
    if not announce.peers:
        report(f"started a new swarm; join it with {','.join(dht.addresses())} (stages: --announce-swarm, "
               "gateways: --stages-swarm, workers: --swarm)")
    return dht
