"""The gateway finding its stages on the swarm's DHT (`generate`/`serve --stages-swarm PEERS`).

Stages announce themselves (`moeswarm stage --announce-swarm`, discovery/stage_record.py). The
gateway joins the DHT as a client, reads the stage records of its model's fingerprint, and dials
each one it may use: its HELLO must name the span its record claims (a record only says where to
dial; of several members' claims of one address, only the one its HELLO confirms is used), and the
least round trip of a few PINGs is its latency (stages/probe.py). A figure is kept with when it was
taken and measured again once it is `remeasure_s` old, at the next read (stages/remeasure.py: the
oldest first, a bounded number per read; the newest figure replaces the old one, and a stage that
no longer answers is dropped, to be dialled as new). `plan_route` (stages/route.py, pure) turns the
stages that answered into the chain: per span in layer order, its replicas. Until they tile every
layer the gateway reads again every `poll_s`, saying what is missing, for at most `wait_s`; then it
gives up with the gap in one line.

The route is chosen at start. While the gateway runs, a `StageWatch` reads the records again
every `follow_s`: a stage announced since that holds exactly one of the chain's spans (dialled and
confirmed as above) joins that span's replicas (stages/client.py `Chain.add_replica`: after the
one in use, by round trip), to take over when the ones before it fail. When the stages announced
now, at their round trips as last measured, make a route clearly cheaper than the chain's
(stages/route_move.py: the round trips plus a weight per stage, by a margin against noise), the
chain moves to that route between two steps (`Chain.reroute`: the new stages replay the logged
steps, so outputs stay bit-identical): a stage in use whose link slowed down, or another whose
link sped up, is seen within `follow_s` after its figure is `remeasure_s` old. When a span of the
chain loses every replica, the chain asks the watch (`Chain.replan`) for a route of the stages
still alive before it gives up.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from moeswarm.errors import MoeSwarmError, printable
from moeswarm.stages.probe import probe_stage
from moeswarm.stages.remeasure import REMEASURE_S, REMEASURED_PER_READ, Measured, StageKey, due
from moeswarm.stages.route import Offer, RouteError, plan_route
from moeswarm.stages.watch import StageWatch

log = logging.getLogger("moeswarm.gateway")

WAIT_S = 60.0
POLL_S = 2.0
PROBE_TIMEOUT_S = 2.0
MAX_PROBED = 256  # stage records dialled per read; more are left out (and said so)
PROBES_AT_ONCE = 16
MAX_CAUSES_LOGGED = 8  # new causes of left-out records logged per read
FOLLOW_S = 10.0  # between reads for stages announced after the start


@dataclass(frozen=True)
class StageSearch:
    """How a gateway finds its stages on the swarm.

    peers: multiaddrs of DHT peers to join by.
    swarm_key: the `--swarm-key` file: only records signed by the swarm's members count, and only
        stages that require the key are used; None: an unkeyed swarm, stages without TLS.
    wait_s: the most to wait for announced stages that tile every layer.
    report: called with a line while waiting (None: logged).
    follow_s: between a running gateway's reads of the records (stages/watch.py).
    remeasure_s: a stage's round trip this old is measured again at the next read (math.inf: never).
    """

    peers: tuple[str, ...]
    swarm_key: str | None = None
    wait_s: float = WAIT_S
    poll_s: float = POLL_S
    probe_timeout_s: float = PROBE_TIMEOUT_S
    report: Callable[[str], None] | None = None
    follow_s: float = FOLLOW_S
    remeasure_s: float = REMEASURE_S


def find_route(search: StageSearch, source, tls: ssl.SSLContext | None) -> list[list[str]]:
    """The chain for model `source` (a ModelSource) from the stages announced on the swarm: per
    position in layer order, its replicas' addresses. MoeSwarmError (one line) when the swarm cannot
    be joined, or the stages do not tile the model within `search.wait_s`."""
    watch = watch_stages(search, source, tls)
    watch.close()
    return watch.route


def watch_stages(search: StageSearch, source, tls: ssl.SSLContext | None) -> StageWatch:
    """As `find_route`, keeping the swarm joined: the watch's `route`, and `follow` for stages announced later."""
    from moeswarm.discovery.dht import SwarmDht

    authority = None
    if search.swarm_key:
        from moeswarm.transport.member_cert import Authority

        authority = Authority.load(search.swarm_key)
    if not search.peers:
        raise MoeSwarmError("--stages-swarm joins an existing swarm: give the multiaddr a stage, a worker or "
                            "`moeswarm dht` printed, not 'new'")
    dht = SwarmDht.open(search.peers, client=True, authority=authority)
    try:
        finder = _StageFinder(dht, search, source, tls)
        return StageWatch(finder, finder.wait())
    except BaseException:
        dht.close()
        raise


class _StageFinder:
    """Reads, dials and plans until the stages tile the model (state kept across reads: what was dialled)."""

    def __init__(self, dht, search: StageSearch, source, tls: ssl.SSLContext | None):
        config = source.config.get_text_config()
        self.dht, self.search, self.tls = dht, search, tls
        self.fingerprint, self.model_type = source.fingerprint, source.config.model_type
        self.num_layers, self.hidden_size = config.num_hidden_layers, config.hidden_size
        self.answered: dict[StageKey, Measured] = {}  # (address, start, stop) -> its round trip, and when
        self.said: set[str] = set()
        self.latest: list[Offer] = []  # what the last read offered

    def wait(self) -> list[list[str]]:
        deadline = time.monotonic() + self.search.wait_s
        last = ""
        while True:
            try:
                route = plan_route(self.offers(), self.num_layers)
            except RouteError as error:
                if time.monotonic() >= deadline:
                    raise RouteError(f"--stages-swarm: {error} (after waiting {self.search.wait_s:g} s)") from None
                if str(error) != last:
                    last = str(error)
                    self.report(f"waiting for stages on the swarm: {error}")
                time.sleep(self.search.poll_s)
                continue
            self.report("stages found on the swarm: " + ", ".join(
                f"layers {p.layers.start}-{p.layers.stop - 1} at {'|'.join(p.replicas)}" for p in route))
            return [list(p.replicas) for p in route]

    def offers(self) -> list[Offer]:
        """The stages announced now that this gateway may use, each dialled (again while it does not
        answer, and once its round trip is `remeasure_s` old)."""
        from moeswarm.discovery.stage_record import STAGES

        # every claim of an address (keyed, several members may claim one): its HELLO tells which is true
        records = list({self._key(r): r for claims in self.dht.claims(self.fingerprint, STAGES).values()
                        for r in claims}.values())
        return self._offers(records)

    def _offers(self, records: Iterable) -> list[Offer]:
        """The records' stages this gateway may use, each dialled: the ones not answered yet, and at most
        `REMEASURED_PER_READ` answered ones whose round trip is `remeasure_s` old (the oldest first).
        A new figure replaces the old; a stage that no longer answers is left out until it does."""
        causes: list[str] = []
        wanted = []
        for record in records:
            cause = self._unusable(record)
            if cause:
                causes.append(f"stage {record.address}: {cause}")
            else:
                wanted.append(record)
        if len(wanted) > MAX_PROBED:
            causes.append(f"{len(wanted)} stages announced: only the first {MAX_PROBED} are dialled")
            wanted = wanted[:MAX_PROBED]
        old = set(due(self.answered, map(self._key, wanted), time.monotonic(), self.search.remeasure_s,
                      REMEASURED_PER_READ))
        dialled = [r for r in wanted if self._key(r) not in self.answered or self._key(r) in old]
        if dialled:
            with ThreadPoolExecutor(min(PROBES_AT_ONCE, len(dialled))) as pool:
                for record, outcome in zip(dialled, pool.map(self._probe, dialled)):
                    if isinstance(outcome, float):
                        self.answered[self._key(record)] = Measured(outcome, time.monotonic())
                    else:  # never answered, or no longer: dialled as new at the next read
                        self.answered.pop(self._key(record), None)
                        causes.append(f"stage {record.address}: {outcome}")
        new = [c for c in dict.fromkeys(causes) if c not in self.said][:MAX_CAUSES_LOGGED]
        for cause in new:
            self.said.add(cause)
            log.warning("leaving out %s", printable(cause, 300))
        self.latest = [Offer(r.address, r.layers, self.answered[self._key(r)].rtt_ms, r.version, r.started)
                       for r in wanted if self._key(r) in self.answered]
        return self.latest

    def _unusable(self, record) -> str:
        """Why a well-formed record cannot serve this gateway ("" when it can)."""
        if record.layers.stop > self.num_layers:
            return f"layers {record.layers.start}-{record.layers.stop - 1} beyond the model's 0-{self.num_layers - 1}"
        if record.hidden_size != self.hidden_size or record.model_type != self.model_type:
            return f"model {record.model_type} of width {record.hidden_size}, not this model's"
        if record.tls != (self.tls is not None):
            return "it requires the swarm key (give --swarm-key)" if record.tls else \
                "it does not use the swarm key this gateway has"
        return ""

    def _probe(self, record) -> float | str:
        """The round trip to the stage in ms, or why it cannot be used (unreachable, a HELLO against its record)."""
        return probe_stage(record.address, record.layers, self.fingerprint, self.tls, self.search.probe_timeout_s)

    def report(self, line: str) -> None:
        if self.search.report is not None:
            self.search.report(printable(line, 1000))
        else:
            log.warning("%s", printable(line, 1000))

    @staticmethod
    def _key(record) -> StageKey:
        return record.address, record.layers.start, record.layers.stop
