"""What a member says of itself in its DHT record, for `status` and the `/swarm` page (pure).

A worker's record (discovery/record.py) carries, besides its share, the moeswarm version it runs,
when it started serving, the tokens/s it measured at start and the rows per minute its experts
computed lately; a stage's record (discovery/stage_record.py) the version and the start. These are
claims, shown as such and never used to route.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def total_load(load: Mapping[int, Sequence[int]] | None) -> int | None:
    """Rows per minute over every layer and expert of a record's `load` (None: not announced)."""
    return None if load is None else sum(sum(rates) for rates in load.values())


def version_and_uptime(record, now: float) -> dict:
    """{"version", "uptime_s"} of anything with a record's `version` and `started` (an Announcement,
    a StageRecord, an Offer read from one), None for each without one or where it says nothing;
    `now`: Unix seconds here (uptime is never below 0, whatever the member's clock)."""
    started = getattr(record, "started", None)
    return {"version": getattr(record, "version", None),
            "uptime_s": None if started is None else max(0.0, now - started)}


def member_about(record, now: float) -> dict:
    """{"version", "uptime_s", "tokens_per_s", "load"} of an Announcement (None for each, without
    one or where the record says nothing); `now` as in `version_and_uptime`."""
    if record is None:
        return {"version": None, "uptime_s": None, "tokens_per_s": None, "load": None}
    return {**version_and_uptime(record, now), "tokens_per_s": record.throughput or None,
            "load": total_load(getattr(record, "load", None))}
