"""A backbone wired to its expert holders: load without experts, connect, place, attach the hook.

`open_swarm` returns a connected `Swarm`, a context manager that closes its links. Callers use its
methods for accounting and configuration, never the dispatcher's insides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from transformers import PreTrainedModel

from moeswarm.dispatch.accounting import LayerCall
from moeswarm.dispatch.dispatcher import Dispatcher
from moeswarm.dispatch.health import DeadlinePolicy
from moeswarm.dispatch.in_process import ByLayer, InProcess
from moeswarm.dispatch.referee import Referee
from moeswarm.dispatch.spot_check import SpotCheckPolicy
from moeswarm.dispatch.taint import Taint
from moeswarm.errors import MoeSwarmError
from moeswarm.forward.packed import set_kv_cache
from moeswarm.ids import WorkerId
from moeswarm.model.backend import attach, set_overlap
from moeswarm.model.experts import experts_modules, num_experts_in_config, num_experts_of
from moeswarm.sources.loading import empty_model, load_backbone
from moeswarm.sources.source import ModelSource
from moeswarm.discovery.members import Following, Members, open_dht
from moeswarm.transport.path import worker_link
from moeswarm.placement.profile import RoutingStats
from moeswarm.placement.table import build_table
from moeswarm.swarm_config import SwarmConfig
from moeswarm.swarm_members import MemberLinks, check_holder
from moeswarm.transport.link import WorkerLink
from moeswarm.worker.local_link import LOCAL_ADDRESS, LocalLink, hold_local
from moeswarm.wire.config import WireConfig
from moeswarm.worker.store import ExpertStore


class Swarm:
    def __init__(self, model: PreTrainedModel, source: ModelSource, dispatcher: Dispatcher, moe_layers: list[int],
                 following: Following | None = None, in_process: Mapping[int, InProcess] | None = None):
        self.model = model
        self.source = source
        self.moe_layers = moe_layers
        self._dispatcher = dispatcher
        self._in_process = dict(in_process or {})  # {layer: backend} for the layers held whole in this process
        self._following = following  # --swarm: the DHT node and the thread following joins and leaves
        self._closers: list[Callable[[], None]] = []

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def wire(self) -> WireConfig:
        return self._dispatcher.wire

    @property
    def fanout(self) -> str:
        return self._dispatcher.fanout

    @property
    def remote(self) -> bool:
        """Whether a forward waits on other machines: some MoE layer is not held whole in this process
        and some holder is not local."""
        held_whole = set(self._in_process) >= set(self.moe_layers)
        return not held_whole and any(link.address != LOCAL_ADDRESS for link in self._dispatcher.links)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (read from the config: a gateway over stages holds no experts module)."""
        return num_experts_in_config(self.model.config.get_text_config())

    @property
    def workers(self) -> list[str]:
        """The holders' addresses ("local" for experts held in this process)."""
        return [link.address for link in self._dispatcher.links]

    @property
    def waiting(self) -> str:
        """How decode layer calls wait for their replies here, as learned (dispatch/wait.py): "sleep", "doze" or "spin"."""
        return self._dispatcher.wait.chosen

    def configure(self, wire: WireConfig) -> None:
        """Use `wire` for the next layers' dispatches."""
        self._dispatcher.configure(wire)

    def reset_accounting(self) -> None:
        self._dispatcher.accounting.reset()

    def set_decoding(self, decoding: bool) -> None:
        """Whether the layer calls from now on are a decode step's (the accounting's decode figures)."""
        self._dispatcher.accounting.decoding = decoding

    def accounting(self) -> dict:
        """Totals since the last reset: round trips, bytes, per-worker round-trip times."""
        return self._dispatcher.accounting.summary()

    def layer_calls(self, since: int = 0) -> list[LayerCall]:
        """The layer calls accounted since the last reset, from the `since`-th on."""
        return self._dispatcher.accounting.calls[since:]

    def layer_calls_accounted(self) -> int:
        return len(self._dispatcher.accounting.calls)

    def resilience(self) -> dict:
        """Counts of takedowns, failovers, readmissions, hedges, spot checks and bans so far."""
        return self._dispatcher.stats.to_dict()

    def layer_call_number(self) -> int:
        """How many remote layer calls have started (monotonic): record it before and after a step
        to know which calls the step made."""
        return self._dispatcher.call_number

    def take_taints(self) -> list[Taint]:
        """Holders banned since the last take, each with the layer calls that used its unchecked
        answers (`Taint.hits(first, last)`): a sequence whose step made one of those calls must be
        rolled back to before that step and recomputed."""
        return self._dispatcher.take_taints()

    def standing(self) -> list[dict]:
        """Per holder: up, banned, degraded, consecutive failures, last cause, PING and round-trip quantiles (ms)."""
        return self._dispatcher.standing()

    def announced(self) -> dict:
        """{address: the Announcement it made on the DHT at discovery's last look} (`--swarm`; {}
        without discovery): what members say of themselves (version, start, load), for pages."""
        follower = self._following.follower if self._following is not None else None
        return dict(follower.records) if follower is not None else {}

    def holdings(self) -> list[tuple[str, dict[int, tuple[int, ...]]]]:
        """Per holder that has not left: (address, {layer: experts it announced}). Joins and leaves
        count from the first layer call after they were seen (dispatch/membership.py)."""
        gone = self._dispatcher.gone
        return [(link.address, dict(link.info.held) if link.info else {})
                for i, link in enumerate(self._dispatcher.links) if i not in gone]

    def readmit(self) -> list[str]:
        """Probe every holder out of use now (HELLO, PING), backoff or not: when an operator knows a
        worker is back. Returns the addresses still out of use."""
        self._dispatcher.readmit(due_only=False)
        return [s["worker"] for s in self._dispatcher.standing() if not s["up"] or s["banned"]]

    @property
    def local_store(self) -> ExpertStore | None:
        """The experts held in this process (`local_experts`), or None when there are none."""
        for link in self._dispatcher.links:
            if isinstance(link, LocalLink):
                return link.store
        return None

    def local_held(self) -> dict[int, tuple[int, ...]]:
        """{MoE layer: the experts held in this process, ascending} ({} when none)."""
        store = self.local_store
        return store.held if store is not None else {}

    def set_overlap(self, enabled: bool) -> int:
        """Compute each block's shared expert while its layer's trip is in flight (the default), or
        where the block calls it; returns how many blocks have one (model/overlap.py)."""
        return set_overlap(self.model, enabled)

    def routing_stats(self) -> RoutingStats:
        """Live routing counts since the swarm opened: per (layer, expert) and per pair chosen together."""
        return self._dispatcher.routing

    def ping(self, worker: int = 0, timeout_s: float = 10.0) -> float:
        return self._dispatcher.links[worker].ping(timeout_s)

    def interpose(self, wrap: Callable[[Dispatcher], object]) -> object:
        """Route the model's MoE layers through `wrap(dispatcher)` (a batcher, say); return it.

        The wrapper must offer the dispatcher's `dispatch(layer, hidden, index, weights)` and
        `combine(handle)`.
        """
        inner = ByLayer(self._dispatcher, self._in_process) if self._in_process else self._dispatcher
        wrapper = wrap(inner)  # the layers held whole here still run in process, behind the wrapper too
        attach(self.model, wrapper)
        return wrapper

    def health(self, timeout_s: float = 2.0) -> list[str]:
        """What stops a forward now ([] when ready): holders out of use whose experts no other
        holder serves, and those experts. A holder down with a replica standing in is not a problem.

        Probes down holders whose backoff has run out, or whose experts nobody else serves
        (reconnect: HELLO, then PING), and pings the others. Not thread-safe against a running
        forward: call it between steps.
        """
        return self._dispatcher.health(self.moe_layers, timeout_s)

    def members(self) -> list[str]:
        """The addresses of the holders in the swarm now (`workers` also lists those that left)."""
        return [link.address for link in self._dispatcher.members()]

    def close_with(self, closer: Callable[[], None]) -> None:
        """Call `closer` when the swarm closes (what a gateway's chain of stages holds open: stages/)."""
        self._closers.append(closer)

    def close(self) -> None:
        for closer in self._closers:
            closer()
        if self._following is not None:
            self._following.close()
        self._dispatcher.close()


def open_swarm(model_path, workers: Sequence[str], config: SwarmConfig | None = None, *,
               wrap_link: Callable[[int, WorkerLink], WorkerLink] | None = None, layers: range | None = None,
               ends: bool = True, **overrides) -> Swarm:
    """Load the backbone of `model_path`, connect to `workers` (HOST:PORT), and attach the hook.

    config: how to reach and trust the holders (swarm_config.py); `overrides` replace its fields
    by name (`open_swarm(path, workers, wire=WAN)`). With no workers, no discovery and no local
    experts, every expert is held in this process (the local mode: the whole model in one process,
    as fast as `load_local`, dispatch/in_process.py).
    wrap_link: (index in `workers`, link) -> the link to use (fault injection in benchmarks).
    layers, ends: hold only these decoder layers (None: all), and without `ends` no embeddings, final
    norm or head: a stage of a chain (stages/); only those layers' experts are placed and covered.
    """
    if config is not None and not isinstance(config, SwarmConfig):
        raise TypeError(f"open_swarm's third argument is a SwarmConfig, not {type(config).__name__} (wire=... for a wire)")
    config = replace(config or SwarmConfig(), **overrides)
    if config.discovery is not None and workers:
        raise MoeSwarmError("give the workers either as a list (--workers) or through the swarm (--swarm), not both")
    # before the backbone: a bad peer fails fast
    following = open_dht(config.discovery) if config.discovery is not None else None
    try:
        return _open(model_path, workers, config, wrap_link, following, layers, ends)
    except BaseException:
        if following is not None:
            following.close()
        raise


def _open(model_path, workers: Sequence[str], config: SwarmConfig, wrap_link, following, span: range | None,
          ends: bool) -> Swarm:
    model, source = load_backbone(model_path, span, ends)
    set_kv_cache(model, config.kv_cache)
    num_experts, hidden_size = num_experts_of(model), model.config.hidden_size
    local_experts = config.local_experts
    if config.discovery is None and not workers and not local_experts:
        local_experts = range(num_experts)  # the local mode: every expert in this process
    layers = [layer for layer in experts_modules(model) if span is None or layer in span]
    # A holder may hold experts of any of the model's layers: a stage uses those of its span (issue 59, item 4)
    model_layers = layers if span is None else list(experts_modules(empty_model(source)))
    links: list[WorkerLink] = []
    local = hold_local(source, local_experts, layers, num_experts, hidden_size) if layers else None
    if local is not None:
        links.append(LocalLink(local, model.config.model_type))
    chosen = [worker_link(spec, tls=config.tls) for spec in workers]  # (path kind, link): transport/path.py's policy
    remote: list[WorkerLink] = [link for _, link in chosen]
    links += [wrap_link(i, link) for i, link in enumerate(remote)] if wrap_link else remote
    options = {  # what the dispatcher is built with, either way
        "wire": config.wire, "fanout": config.fanout,
        "policy": DeadlinePolicy(cap_s=config.reply_timeout_s, hedge=config.hedge),
        "spot_checks": SpotCheckPolicy(config.spot_check, config.spot_check_seed),
        "referee": Referee(source, num_experts, hidden_size),  # settles two holders' dispute itself
        "routing": RoutingStats(num_experts, source.fingerprint, model.config.model_type),
        "paths": {link.address: kind for kind, link in chosen},
    }
    if following is None:
        dispatcher = connect(links, source.fingerprint, num_experts, hidden_size, layers, model_layers, **options)
    else:
        dispatcher = _follow(following, config, links, source.fingerprint, num_experts, hidden_size, layers,
                             model_layers, options)
    whole = local.whole_layers() if local is not None else {}  # layers held whole here: no dispatch at all
    in_process = InProcess(whole, dispatcher.routing, dispatcher.accounting)
    backends = {layer: in_process for layer in whole}
    attach(model, dispatcher, backends)
    return Swarm(model, source, dispatcher, layers, following, backends)


def connect(links: Sequence[WorkerLink], fingerprint: str, num_experts: int, hidden_size: int, layers: Sequence[int],
            model_layers: Sequence[int] | None = None, **dispatcher_options) -> Dispatcher:
    """Connect every link, place the experts they announce, and check `layers` are covered.

    model_layers: every MoE layer of the model (None: `layers`): a holder may hold experts of any of
    them, and serves those of `layers` (a stage's span).
    dispatcher_options: the Dispatcher's wire, fanout, policy, spot_checks, referee, routing and paths."""
    try:
        for link in links:
            link.connect(fingerprint)
            check_holder(link, num_experts, hidden_size, layers if model_layers is None else model_layers)
        table = build_table({WorkerId(i): link.info.held for i, link in enumerate(links)}, num_experts)
        dispatcher = Dispatcher(links, table, **dispatcher_options)
        dispatcher.check_covers(layers)
    except BaseException:
        for link in links:
            link.close()
        raise
    return dispatcher


def _follow(following: Following, config: SwarmConfig, links: Sequence[WorkerLink], fingerprint: str, num_experts: int,
            hidden_size: int, layers: Sequence[int], model_layers: Sequence[int], dispatcher_options: dict) -> Dispatcher:
    """A dispatcher over `links` (held in this process, if any) and the workers announced on the swarm:
    discovery's join and leave events reach it through `MemberLinks`; waits until they cover every
    MoE layer, then discovery keeps following on its thread."""
    dispatcher = None
    try:
        for link in links:
            link.connect(fingerprint)
        held = {WorkerId(i): link.info.held for i, link in enumerate(links)}
        dispatcher = Dispatcher(links, build_table(held, num_experts), **dispatcher_options)
        sink = MemberLinks(dispatcher, fingerprint, num_experts, hidden_size, model_layers, config.tls)
        members = Members(sink, num_experts, layers, _merged(link.info.held for link in links))
        following.follow(config.discovery, fingerprint, members, config.tls is not None)
        dispatcher.apply_membership()  # no forward runs yet: the members joined so far are holders now
    except BaseException:
        if dispatcher is not None:
            dispatcher.close()  # links joined in the last round, too
        for link in links:
            link.close()
        raise
    return dispatcher


def _merged(helds) -> dict[int, tuple[int, ...]]:
    """{layer: experts} over several holders' {layer: experts}."""
    merged: dict[int, set[int]] = {}
    for held in helds:
        for layer, experts in held.items():
            merged.setdefault(layer, set()).update(experts)
    return {layer: tuple(sorted(experts)) for layer, experts in merged.items()}
