"""What a stages swarm looks like (`moeswarm status`, a gateway's `/swarm` page): every stage, the
coverage per span, the route (pure functions: plain data in, plain data out).

A stage row is one announced stage: its address, its span of decoder layers, the round trip
measured to it from here (None: not measured, or it did not answer: `cause` says why), whether
the route shown uses it, and what its record says of it: the moeswarm version it runs and how long
it has served its span (discovery/member_about.py; None where the record says nothing). A span
row is one span of the swarm's cut (`invite --stages N`: 0 stages is a gap) or one other
announced span, and how many stages hold exactly it; the spans with the fewest are the swarm's
weakest (a stage lost there costs the route a replan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moeswarm.discovery.member_about import version_and_uptime
from moeswarm.discovery.swarm_view import duration
from moeswarm.errors import printable


@dataclass(frozen=True)
class StageRow:
    address: str
    layers: range
    rtt_ms: float | None  # from here; None: not measured or unreachable
    in_route: bool  # the route shown uses it (the stage in use at its position)
    cause: str = ""  # why it cannot be used from here ("" when it can)
    version: str | None = None  # the moeswarm it runs (None: not announced)
    uptime_s: float | None = None  # serving its span since, by its record and this clock (None: not announced)


@dataclass(frozen=True)
class SpanRow:
    layers: range
    stages: int  # stages announcing exactly this span
    weakest: bool  # no span has fewer


def stage_rows(stages: Sequence[tuple[str, range, float | None, str, object]],
               route: Sequence[tuple[range, str]], now: float = 0.0) -> list[StageRow]:
    """A row per stage (address, span, round trip, cause, its record: anything with the `version`
    and `started` a StageRecord has, or None), in layer order then address; `route`: per position,
    (its span, the address in use); `now`: Unix seconds here, for uptimes."""
    used = {(layers.start, layers.stop, address) for layers, address in route}
    rows = []
    for address, layers, rtt, cause, record in sorted(stages, key=lambda s: (s[1].start, s[1].stop, s[0])):
        about = version_and_uptime(record, now)
        rows.append(StageRow(printable(address, 300), layers, rtt, (layers.start, layers.stop, address) in used,
                             printable(cause, 300), None if about["version"] is None else printable(about["version"], 64),
                             about["uptime_s"]))
    return rows


def span_rows(stages: Sequence[tuple[str, range]], cut: Sequence[range] = ()) -> list[SpanRow]:
    """A row per span of the swarm's `cut` (held or not) and per other announced span, each address
    counted once, in layer order, the weakest marked."""
    holders: dict[tuple[int, int], set[str]] = {(span.start, span.stop): set() for span in cut}
    for address, layers in stages:
        holders.setdefault((layers.start, layers.stop), set()).add(address)
    floor = min((len(h) for h in holders.values()), default=0)
    return [SpanRow(range(*span), len(h), len(h) == floor) for span, h in sorted(holders.items())]


def stage_json(rows: Sequence[StageRow], spans: Sequence[SpanRow], route: Sequence[tuple[range, str]]) -> dict:
    """The view as JSON-able data (`status --json`, `GET /v1/swarm`)."""
    return {"stages": [{"address": r.address, "layers": [r.layers.start, r.layers.stop - 1], "rtt_ms": r.rtt_ms,
                        "in_route": r.in_route, "cause": r.cause, "version": r.version, "uptime_s": r.uptime_s}
                       for r in rows],
            "spans": [{"layers": [s.layers.start, s.layers.stop - 1], "stages": s.stages, "weakest": s.weakest}
                      for s in spans],
            "route": [{"layers": [layers.start, layers.stop - 1], "address": printable(address, 300)}
                      for layers, address in route]}


def format_stages(rows: Sequence[StageRow], spans: Sequence[SpanRow], route: Sequence[tuple[range, str]],
                  route_title: str, no_route: str = "") -> list[str]:
    """The terminal lines: the stages, the coverage per span, the route (`route_title`; `no_route`:
    why there is none)."""
    lines = [f"{len(rows)} stage{'s' if len(rows) != 1 else ''} announced:"]
    if rows:
        width = max(len("ADDRESS"), *(len(r.address) for r in rows))
        lines.append(f"  {'ADDRESS':<{width}}  {'LAYERS':<7}  {'VERSION':<9}  {'UP':>8}  {'RTT MS':>7}  ROUTE")
        for r in rows:
            rtt = "-" if r.rtt_ms is None else f"{r.rtt_ms:.2f}"
            note = "in use" if r.in_route else (f"unusable: {r.cause}" if r.cause else "")
            lines.append(f"  {r.address:<{width}}  {_span(r.layers):<7}  {r.version or '-':<9}  "
                         f"{duration(r.uptime_s):>8}  {rtt:>7}  {note}".rstrip())
    lines.append("coverage per span (stages holding exactly it):")
    for s in spans:
        mark = "  <- weakest" if s.weakest else ""
        lines.append(f"  layers {_span(s.layers):<7}  {s.stages} stage{'s' if s.stages != 1 else ''}{mark}")
    if route:
        lines.append(f"{route_title}: " + ", ".join(f"layers {_span(layers)} at {printable(address, 300)}"
                                                   for layers, address in route))
    elif no_route:
        lines.append(f"{route_title}: none ({no_route})")
    return lines


def _span(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}"
