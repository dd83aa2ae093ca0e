"""A stage's round trip kept with its age, and which stages are due to be measured again (pure).

A gateway's figure for a stage goes stale: the stage's link may slow down or speed up after it was
first dialled. So each read of the swarm (stages/find.py) measures again the answered stages whose
figure is at least `remeasure_s` old, the oldest first and at most `REMEASURED_PER_READ` of them
(one wave of the read's probes), and keeps the newest figure in place of the old one: a route
move (stages/route_move.py) weighs what the link is now, its margin standing against the noise of
one measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

StageKey = tuple[str, int, int]  # (address, first layer, layer after the last): one stage record's claim

REMEASURE_S = 60.0  # a round trip this old is measured again at the next read
REMEASURED_PER_READ = 16  # answered stages measured again per read; the others wait for later reads


@dataclass(frozen=True)
class Measured:
    """A stage's round trip: the least of its probe's PINGs in ms, and when it was taken (time.monotonic() s)."""

    rtt_ms: float
    at: float


def due(measured: Mapping[StageKey, Measured], offered: Iterable[StageKey], now: float, period_s: float,
        most: int = REMEASURED_PER_READ) -> list[StageKey]:
    """The stages among `offered` to measure again at `now`: those in `measured` whose figure is at
    least `period_s` old, the oldest first (ties in `offered`'s order), at most `most`. A stage not
    in `measured` is not due (it is dialled as new); `period_s` math.inf: none ever is."""
    old = [key for key in dict.fromkeys(offered) if key in measured and now - measured[key].at >= period_s]
    return sorted(old, key=lambda key: measured[key].at)[:max(most, 0)]
