"""A backbone wired to its expert holders: load without experts, connect, place, attach the hook.

`open_swarm` returns a connected `Swarm`, a context manager that closes its links. Callers use its
methods for accounting and configuration, never the dispatcher's insides.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence

from transformers import PreTrainedModel

from moeswarm.dispatch.accounting import LayerCall
from moeswarm.dispatch.dispatcher import REPLY_TIMEOUT_S, Dispatcher
from moeswarm.dispatch.health import DeadlinePolicy
from moeswarm.dispatch.spot_check import SpotCheckPolicy
from moeswarm.errors import MoeSwarmError, WorkerError
from moeswarm.ids import WorkerId, format_ids
from moeswarm.model.backend import attach
from moeswarm.model.experts import experts_modules, num_experts_of
from moeswarm.model.loading import load_backbone, load_experts
from moeswarm.model.source import ModelSource
from moeswarm.placement.table import build_table
from moeswarm.transport.link import WorkerLink
from moeswarm.transport.local import LocalLink
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.config import EXACT, WireConfig
from moeswarm.worker.store import ExpertStore


class Swarm:
    def __init__(self, model: PreTrainedModel, source: ModelSource, dispatcher: Dispatcher, moe_layers: list[int]):
        self.model = model
        self.source = source
        self.moe_layers = moe_layers
        self._dispatcher = dispatcher

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
    def workers(self) -> list[str]:
        """The holders' addresses ("local" for experts held in this process)."""
        return [link.address for link in self._dispatcher.links]

    def configure(self, wire: WireConfig) -> None:
        """Use `wire` for the next layers' dispatches."""
        self._dispatcher.wire = wire

    def reset_accounting(self) -> None:
        self._dispatcher.accounting.reset()

    def accounting(self) -> dict:
        """Totals since the last reset: round trips, bytes, per-worker round-trip times."""
        return self._dispatcher.accounting.summary()

    def layer_calls(self) -> list[LayerCall]:
        return list(self._dispatcher.accounting.calls)

    def resilience(self) -> dict:
        """Counts of takedowns, failovers, readmissions, hedges, spot checks and bans so far."""
        return self._dispatcher.stats.to_dict()

    def standing(self) -> list[dict]:
        """Per holder: up, banned, consecutive failures, last cause, round-trip quantiles (ms)."""
        return self._dispatcher.standing()

    def holdings(self) -> list[tuple[str, dict[int, tuple[int, ...]]]]:
        """Per holder: (address, {layer: experts it announced})."""
        return [(link.address, dict(link.info.held) if link.info else {}) for link in self._dispatcher.links]

    def readmit(self) -> list[str]:
        """Probe every holder out of use now (HELLO, PING), backoff or not: when an operator knows a
        worker is back. Returns the addresses still out of use."""
        self._dispatcher.readmit(due_only=False)
        return [s["worker"] for s in self._dispatcher.standing() if not s["up"] or s["banned"]]

    def ping(self, worker: int = 0, timeout_s: float = 10.0) -> float:
        return self._dispatcher.links[worker].ping(timeout_s)

    def interpose(self, wrap: Callable[[Dispatcher], object]) -> object:
        """Route the model's MoE layers through `wrap(dispatcher)` (a batcher, say); return it.

        The wrapper must offer the dispatcher's `dispatch(layer, hidden, index, weights)` and
        `combine(handle)`.
        """
        wrapper = wrap(self._dispatcher)
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

    def close(self) -> None:
        self._dispatcher.close()


def open_swarm(model_path, workers: Sequence[str], wire: WireConfig = EXACT, fanout: str = "star",
               local_experts: Sequence[int] | None = None, reply_timeout_s: float = REPLY_TIMEOUT_S,
               hedge: bool = True, spot_check: float = 0.0, spot_check_seed: int | None = None,
               wrap_link: Callable[[int, WorkerLink], WorkerLink] | None = None, tls: ssl.SSLContext | None = None) -> Swarm:
    """Load the backbone of `model_path`, connect to `workers` (HOST:PORT), and attach the hook.

    local_experts: experts (of every MoE layer) to hold in this process, through the same link
    interface as a worker; the chooser prefers them over a remote copy, and spot checks trust them.
    reply_timeout_s: the cap on any holder's deadline (docs/failover.md).
    hedge: send a late share's duplicate to a replica when one holds its experts.
    spot_check: the fraction of remote answers recomputed by another holder.
    wrap_link: (index in `workers`, link) -> the link to use (fault injection in benchmarks).
    tls: the swarm key's client context (transport/tls.py): mutual TLS to every worker; None: plain TCP.
    """
    if not workers and not local_experts:
        raise MoeSwarmError("no workers given: pass --workers HOST:PORT[,HOST:PORT...]")
    model, source = load_backbone(model_path)
    num_experts, hidden_size = num_experts_of(model), model.config.hidden_size
    links: list[WorkerLink] = []
    if local_experts:
        hosted, _, _ = load_experts(source, local_experts, None)
        links.append(LocalLink(ExpertStore(hosted, num_experts, hidden_size), model.config.model_type))
    remote: list[WorkerLink] = [TcpLink(address, tls) for address in workers]
    links += [wrap_link(i, link) for i, link in enumerate(remote)] if wrap_link else remote
    layers = list(experts_modules(model))
    policy = DeadlinePolicy(cap_s=reply_timeout_s, hedge=hedge)
    dispatcher = connect(links, source.fingerprint, num_experts, hidden_size, layers, wire, fanout, policy,
                         SpotCheckPolicy(spot_check, spot_check_seed))
    attach(model, dispatcher)
    return Swarm(model, source, dispatcher, layers)


def connect(links: Sequence[WorkerLink], fingerprint: str, num_experts: int, hidden_size: int, layers: Sequence[int],
            wire: WireConfig = EXACT, fanout: str = "star", policy: DeadlinePolicy | None = None,
            spot_checks: SpotCheckPolicy | None = None) -> Dispatcher:
    """Connect every link, place the experts they announce, and check `layers` are covered."""
    try:
        for link in links:
            info = link.connect(fingerprint)
            if info.num_experts != num_experts or info.hidden_size != hidden_size:
                raise WorkerError(link.address, f"announces {info.num_experts} experts of width {info.hidden_size}, "
                                                f"the model has {num_experts} of width {hidden_size}")
            strays = sorted(set(info.held) - set(layers))
            if strays:
                raise WorkerError(link.address, f"announces experts of layers {strays[:8]}, which are not MoE layers "
                                                f"of this model (MoE layers: {format_ids(sorted(layers))})")
        table = build_table({WorkerId(i): link.info.held for i, link in enumerate(links)}, num_experts)
        dispatcher = Dispatcher(links, table, wire, fanout, policy=policy, spot_checks=spot_checks)
        dispatcher.check_covers(layers)
    except BaseException:
        for link in links:
            link.close()
        raise
    return dispatcher
