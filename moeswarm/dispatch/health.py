"""Each holder's state as the dispatcher sees it: recent round trips, deadline, hedge delay, backoff.

Deadlines follow what a holder has shown: `multiple` x its recent p99 round trip (scaled up for
a request with more rows than its typical one), never under `floor_s`, never over `cap_s` (the
`--reply-timeout`). Until `min_samples` calls are measured the cap applies: a first prefill on a
slow machine must not be mistaken for a failure. A reply later than the holder's p95 may be
hedged (sent again to a replica); a holder that failed is out of use until a probe (reconnect:
HELLO, then PING) succeeds, tried with exponential backoff. A holder caught lying by a spot check
is banned for the session.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

REPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DeadlinePolicy:
    cap_s: float = REPLY_TIMEOUT_S  # --reply-timeout: no call waits longer
    floor_s: float = 2.0  # above a WAN RTT, a GC pause or a busy core's scheduling hiccup
    multiple: float = 8.0  # x the recent p99
    min_samples: int = 8  # calls measured before the deadline leaves the cap
    window: int = 256  # recent calls remembered per holder
    hedge: bool = True  # duplicate a late share to a replica
    hedge_min_samples: int = 20  # calls measured before a p95 means something
    backoff_s: float = 0.5  # first wait before a failed holder is probed again; doubles each failure
    backoff_max_s: float = 30.0
    probe_timeout_s: float = 2.0  # connect, HELLO and PING of a probe


class RoundTrips:
    """A holder's recent round trips (seconds) with the rows each request carried.

    The window's values are also kept sorted, updated per call (an insort and a removal in C), so a
    quantile is one index: every layer call asks for a deadline, and sorting the window each time
    cost more than the rest of the call's bookkeeping.
    """

    def __init__(self, window: int):
        self._calls: deque[tuple[float, int]] = deque(maxlen=window)
        self._sorted: list[float] = []
        self._rows_sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._calls)

    def record(self, seconds: float, rows: int) -> None:
        rows = max(1, rows)
        if len(self._calls) == self._calls.maxlen:
            old_seconds, old_rows = self._calls[0]
            del self._sorted[bisect.bisect_left(self._sorted, old_seconds)]
            del self._rows_sorted[bisect.bisect_left(self._rows_sorted, old_rows)]
        self._calls.append((seconds, rows))
        bisect.insort(self._sorted, seconds)
        bisect.insort(self._rows_sorted, rows)

    def quantile(self, q: float, rows: int) -> float:
        """The q-quantile round trip, scaled for a request of `rows` rows if it is larger than usual."""
        typical = float(self._rows_sorted[len(self._rows_sorted) // 2])  # median rows of a request
        index = min(len(self._sorted) - 1, int(q * len(self._sorted)))
        return self._sorted[index] * max(1.0, rows / typical)

    def summary_ms(self) -> dict[str, float]:
        if not self._calls:
            return {}
        ordered = sorted(s for s, _ in self._calls)
        pick = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return {"p50": pick(0.5), "p95": pick(0.95), "p99": pick(0.99), "max": 1000 * ordered[-1]}


@dataclass
class Holder:
    """One link's standing: measured, up or down (with backoff), banned."""

    policy: DeadlinePolicy
    round_trips: RoundTrips = field(init=False)
    up: bool = True
    banned: bool = False
    failures: int = 0  # consecutive, since the last admission
    retry_at: float = 0.0  # time.monotonic() of the next probe while down
    cause: str = ""  # why it went down or was banned

    def __post_init__(self) -> None:
        self.round_trips = RoundTrips(self.policy.window)

    @property
    def usable(self) -> bool:
        return self.up and not self.banned

    def deadline_s(self, rows: int) -> float:
        p = self.policy
        if len(self.round_trips) < p.min_samples:
            return p.cap_s
        return min(p.cap_s, max(p.floor_s, p.multiple * self.round_trips.quantile(0.99, rows)))

    def hedge_after_s(self, rows: int) -> float | None:
        """How long to wait before hedging a request of `rows` rows (None: not yet measured)."""
        p = self.policy
        if not p.hedge or len(self.round_trips) < p.hedge_min_samples:
            return None
        return self.round_trips.quantile(0.95, rows)

    def fail(self, now: float, cause: str) -> None:
        self.up = False
        self.failures += 1
        self.retry_at = now + min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (self.failures - 1))
        self.cause = cause

    def readmit(self) -> None:
        self.up, self.failures, self.cause = True, 0, ""

    def ban(self, cause: str) -> None:
        self.banned, self.cause = True, cause

