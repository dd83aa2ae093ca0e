"""What a swarm looks like from its DHT (`moeswarm status`): members, shares, coverage per layer.

`swarm_view` is a pure function of the announcements read (plain data in, plain data out);
`format_view` turns its result into the terminal table. Announcements are what members claim:
the view shows the swarm as announced, which is what joiners choose their shares from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moeswarm.discovery.member_about import member_about
from moeswarm.errors import printable
from moeswarm.ids import format_ids
from moeswarm.placement.share import coverage_of


@dataclass(frozen=True)
class MemberRow:
    address: str
    path: str  # "direct", "relay", or "direct+relay" (transport/path.py's forms)
    share: str  # "experts X of layers Y", or per layer when it differs
    throughput: float  # tokens/s the member measured at start (0: unmeasured)
    tls: bool
    load: int | None = None  # rows per minute its experts computed lately, all together (None: not announced)
    version: str | None = None  # the moeswarm it runs (None: not announced)
    uptime_s: float | None = None  # since it started serving, by its record and this clock (None: not announced)
    rtt_ms: float | str | None = None  # the least PING round trip from here, or why none (None: not dialled)


@dataclass(frozen=True)
class LayerRow:
    layer: int
    fewest: int  # holders of its least-held expert
    weakest: tuple[int, ...]  # the experts with that many holders
    weakest_layer: bool  # whether no layer's least-held expert has fewer holders


def path_of(address: str) -> str:
    """How a member is reached, from its announced address's form."""
    if "+" in address:
        return "direct+relay"
    return "relay" if address.startswith("relay://") else "direct"


def share_text(held: Mapping[int, Sequence[int]]) -> str:
    """A member's {layer: experts} in one phrase: one expert list when it is the same at every layer."""
    lists = {tuple(experts) for experts in held.values()}
    if len(lists) == 1:
        return f"experts {format_ids(next(iter(lists)))} of layers {format_ids(sorted(held))}"
    return "; ".join(f"layer {layer}: {format_ids(experts)}" for layer, experts in sorted(held.items()))


def swarm_view(records: Mapping[str, object], layers: Sequence[int], num_experts: int, now: float = 0.0,
               rtts: Mapping[str, float | str] | None = None) -> tuple[list[MemberRow], list[LayerRow]]:
    """(a row per member, a row per MoE layer) from the announcements by address (each with `held`,
    `throughput`, `tls`, and `load`, `version`, `started` where announced: discovery/record.py);
    `now`: Unix seconds here, for uptimes; rtts: {address: round trip from here in ms, or why none}."""
    members = []
    for address, record in sorted(records.items()):
        about = member_about(record, now)
        members.append(MemberRow(printable(address, 300), path_of(address), share_text(record.held),
                                 record.throughput, record.tls, about["load"],
                                 None if about["version"] is None else printable(about["version"], 64),
                                 about["uptime_s"], (rtts or {}).get(address)))
    return members, layer_rows(coverage_of([record.held for record in records.values()], layers, num_experts))


def duration(seconds: float | None) -> str:
    """An uptime in a few characters: "42s", "17m", "5h3m", "2d4h"; "-" for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def layer_rows(coverage: Mapping[int, Sequence[int]]) -> list[LayerRow]:
    """A row per layer of {layer: holders per expert}: its least-held experts, the weakest layers marked."""
    floor = min((min(holders) for holders in coverage.values() if holders), default=0)
    rows = []
    for layer, holders in sorted(coverage.items()):
        fewest = min(holders, default=0)
        rows.append(LayerRow(layer, fewest, tuple(e for e, h in enumerate(holders) if h == fewest), fewest == floor))
    return rows


def format_view(model: str, members: Sequence[MemberRow], layers: Sequence[LayerRow],
                stages: Sequence[tuple[str, range]] = (), seeds: Sequence[tuple[str, Sequence[int]]] = (),
                title: str | None = None, joining: Sequence[tuple[str, str]] = ()) -> str:
    """The terminal table. seeds: (address, the experts whose slice pieces it serves) of each
    member's seed (discovery/seed_record.py); joining: (address, what it chose) of each joiner still
    fetching (discovery/joining_record.py); title: the first line (default: the members counted);
    no `layers`: no coverage per MoE layer (a stages swarm's coverage is per span: stage_view.py)."""
    lines = [title or f"swarm of model {model}: {len(members)} members announced"]
    if members:
        width = max(len(m.address) for m in members)
        lines.append(f"  {'ADDRESS':<{width}}  {'PATH':<12}  {'TLS':<3}  {'VERSION':<9}  {'UP':>8}  {'RTT MS':>7}  "
                     f"{'TOKENS/S':>9}  {'ROWS/MIN':>9}  SHARE")
        for m in members:
            load = "-" if m.load is None else str(m.load)
            rtt = f"{m.rtt_ms:.2f}" if isinstance(m.rtt_ms, float) else "-" if m.rtt_ms is None else "down"
            lines.append(f"  {m.address:<{width}}  {m.path:<12}  {'yes' if m.tls else 'no':<3}  {m.version or '-':<9}  "
                         f"{duration(m.uptime_s):>8}  {rtt:>7}  {m.throughput:>9.0f}  {load:>9}  {m.share}")
        for m in members:
            if isinstance(m.rtt_ms, str):
                lines.append(f"  {m.address}: {printable(m.rtt_ms, 300)}")
    for address, share in joining:
        lines.append(f"  joining {printable(address, 300)}: {share} (fetching, not serving yet)")
    for address, span in stages:
        lines.append(f"  stage {printable(address, 300)}: decoder layers {span.start}-{span.stop - 1}")
    for address, experts in seeds:
        lines.append(f"  seed {printable(address, 300)}: the pieces of experts {format_ids(experts)}")
    if layers:
        lines.append("coverage per MoE layer (holders of its least-held experts):")
    for row in layers:
        state = "UNCOVERED" if row.fewest == 0 else f"{row.fewest} holder{'s' if row.fewest != 1 else ''}"
        mark = "  <- weakest" if row.weakest_layer else ""
        lines.append(f"  layer {row.layer:>3}: {state:<11} experts {format_ids(row.weakest)}{mark}")
    return "\n".join(lines)
