"""A stages swarm as seen from here (`moeswarm status`): every announced stage probed, the route a
gateway here would take, the coverage per span of the swarm's cut."""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from moeswarm.discovery.stage_view import SpanRow, StageRow, span_rows, stage_rows
from moeswarm.stages.probe import probe_stage
from moeswarm.stages.route import Offer, RouteError, plan_route

PROBES_AT_ONCE = 16
MAX_PROBED = 256  # as a gateway: more records are shown unprobed


def survey_stages(records: Mapping[str, object], fingerprint: str, num_layers: int, cut: Sequence[range],
                  tls: ssl.SSLContext | None, timeout_s: float, now: float,
                  ) -> tuple[list[StageRow], list[SpanRow], list[tuple[range, str]], str]:
    """(a row per stage record by address, a row per span, the route from here as (span, address
    in use) per position, why there is no route or ""). Each stage is dialled as a gateway would
    (its HELLO must name its record's span) and its round trip measured; a record whose `tls` is
    not this side's is not dialled (its cause says so). `now`: Unix seconds here, for the uptimes
    the rows show from the records' `started`."""
    records = dict(sorted(records.items())[:MAX_PROBED])

    def probe(item) -> float | str:
        address, record = item
        if record.tls != (tls is not None):
            return "it requires the swarm key (give --swarm-key)" if record.tls else "it does not use the swarm key"
        if record.layers.stop > num_layers:
            return f"layers {record.layers.start}-{record.layers.stop - 1} beyond the model's 0-{num_layers - 1}"
        return probe_stage(address, record.layers, fingerprint, tls, timeout_s)

    with ThreadPoolExecutor(PROBES_AT_ONCE) as pool:
        outcomes = list(pool.map(probe, records.items()))
    offers = [Offer(address, record.layers, outcome)
              for (address, record), outcome in zip(records.items(), outcomes) if isinstance(outcome, float)]
    route, why = [], ""
    try:
        route = [(p.layers, p.replicas[0]) for p in plan_route(offers, num_layers)]
    except RouteError as error:
        why = str(error)
    rows = stage_rows([(address, record.layers, outcome if isinstance(outcome, float) else None,
                        "" if isinstance(outcome, float) else outcome, record)
                       for (address, record), outcome in zip(records.items(), outcomes)], route, now)
    return rows, span_rows([(a, r.layers) for a, r in records.items()], cut), route, why
