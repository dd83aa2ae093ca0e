"""Each holder's state as the dispatcher sees it: recent round trips, deadline, hedge delay, backoff.

Deadlines follow what a holder has shown: `multiple` x its recent p99 round trip (scaled up for
a request with more rows than its typical one), never under `floor_s`, never over `cap_s` (the
`--reply-timeout`). Until `min_samples` calls are measured, a holder whose PING round trip is
known and whose rows a replica could take gets a first deadline from it: `multiple` x the PING,
at least `floor_s`, plus `row_allowance_s` per row for compute (a worker answering 10 s late is
failed over within its first call); each such miss doubles that holder's first deadline, so a
slow machine's first prefill is not mistaken twice in a row. Otherwise the cap applies. A reply later
than the holder's p95 may be hedged (sent again to a replica); a holder that failed is out of
use until a probe (reconnect: HELLO, then PING) succeeds, tried with exponential backoff. A
holder that misses a deadline, or keeps losing hedges (`degraded_after` in a row), is degraded
for `degraded_s`: calls go to a replica where one exists. A holder caught lying is
banned for the session.
"""

from __future__ import annotations

import bisect
import time
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
    row_allowance_s: float = 0.02  # first deadline (from the PING): compute time allowed per row
    degraded_after: int = 3  # hedges lost in a row
    degraded_s: float = 60.0  # how long a degraded holder is avoided where a replica exists


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
    ping_s: float | None = None  # the PING round trip, once measured
    early_scale: float = 1.0  # x the first deadline's allowance: grows with each early miss
    strikes: int = 0  # hedges lost in a row
    degraded_until: float = 0.0  # time.monotonic()

    def __post_init__(self) -> None:
        self.round_trips = RoundTrips(self.policy.window)

    @property
    def usable(self) -> bool:
        return self.up and not self.banned

    @property
    def degraded(self) -> bool:
        return self.degraded_until > 0 and time.monotonic() < self.degraded_until

    @property
    def measured(self) -> bool:
        return len(self.round_trips) >= self.policy.min_samples

    def deadline_s(self, rows: int, early: bool = False) -> float:
        """The deadline of a request of `rows` rows; early: a replica could take them (the first
        deadline from the PING applies while unmeasured)."""
        p = self.policy
        if len(self.round_trips) < p.min_samples:
            if not early or self.ping_s is None:
                return p.cap_s
            return min(p.cap_s, self.early_scale * (max(p.floor_s, p.multiple * self.ping_s) + rows * p.row_allowance_s))
        return min(p.cap_s, max(p.floor_s, p.multiple * self.round_trips.quantile(0.99, rows)))

    def hedge_after_s(self, rows: int) -> float | None:
        """How long to wait before hedging a request of `rows` rows (None: not yet measured)."""
        p = self.policy
        if not p.hedge or len(self.round_trips) < p.hedge_min_samples:
            return None
        return self.round_trips.quantile(0.95, rows)

    def strike(self, now: float) -> None:
        """A hedge lost: `degraded_after` in a row degrade the holder."""
        self.strikes += 1
        if self.strikes >= self.policy.degraded_after:
            self.degrade(now)

    def stalled(self, now: float) -> None:
        """A deadline missed: degraded at once; while unmeasured, its next first deadline doubles
        (a slow machine's first prefill is not mistaken twice in a row)."""
        self.degrade(now)
        if not self.measured:
            self.early_scale *= 2

    def degrade(self, now: float) -> None:
        self.degraded_until, self.strikes = now + self.policy.degraded_s, 0

    def on_time(self) -> None:
        self.strikes = 0

    def fail(self, now: float, cause: str) -> None:
        self.up = False
        self.failures += 1
        self.retry_at = now + min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (self.failures - 1))
        self.cause = cause

    def readmit(self) -> None:
        self.up, self.failures, self.cause = True, 0, ""

    def ban(self, cause: str) -> None:
        self.banned, self.cause = True, cause

