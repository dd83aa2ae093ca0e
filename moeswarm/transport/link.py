"""The worker link interface: what the dispatcher needs from any expert holder.

A link is one way to reach a holder of experts: a TCP connection to a worker process, plain or
with TLS (transport/tcp.py), the same through a relay (transport/relay.py), or the backbone's own
process (worker/local_link.py).
The dispatcher and the fan-out see only this interface, so where an expert runs is a placement
decision, not a code path.

Life of a call: `prepare` encodes a DISPATCH (before anything is sent, so a codec that refuses
its input sends nothing), `send` puts it on its way and returns a `Pending`, `wait` returns its
`Reply` before a deadline. A link whose stream fell out of step (a timeout, a broken frame, a lost
connection) closes itself and reports `broken`; `reconnect` opens it again and checks that the
holder still serves what it announced.

Several requests may be in flight on one link (a hedged duplicate, a spot check). The fan-out
selects on `fileno()` (None: the reply is computed when awaited), reads a readable link's next
frame with `pump`, asks `has_reply`, and `forget`s a request whose answer is no longer wanted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from moeswarm.wire.messages import Dispatch, Result, WorkerInfo


@dataclass(frozen=True)
class Pending:
    """A request on its way: what `wait` needs to find its reply."""

    request_id: int
    bytes_out: int
    sent_at: float  # time.perf_counter() when it was sent


@dataclass(frozen=True)
class Reply:
    result: Result
    bytes_in: int
    seconds: float  # from send to the whole reply read: this holder's round trip


class WorkerLink(Protocol):
    address: str
    info: WorkerInfo | None

    @property
    def broken(self) -> bool:
        """True when the link must be reconnected before its next request."""

    def connect(self, fingerprint: str) -> WorkerInfo:
        """Open the link and exchange HELLO; the holder must serve the model `fingerprint`."""

    def reconnect(self, timeout_s: float | None = None) -> WorkerInfo:
        """Open a broken link again; WorkerError if the holder now serves something else."""

    def prepare(self, request: Dispatch) -> Any:
        """The request made ready to send (encoded for a remote holder); raises before any I/O."""

    def send(self, prepared: Any) -> Pending:
        ...

    def wait(self, pending: Pending, deadline: float) -> Reply:
        """The reply to `pending` before `deadline` (time.monotonic()); WorkerError naming the cause."""

    def fileno(self) -> int | None:
        """What to select on for replies; None when `wait` computes the reply itself."""

    def has_reply(self, pending: Pending) -> bool:
        """Whether `wait(pending)` would return without reading the network."""

    def pump(self, deadline: float) -> None:
        """Read the next whole frame (the link is readable) before `deadline`; keep it for `wait`."""

    def forget(self, pending: Pending) -> None:
        """Give up on `pending`: its reply is dropped, now or when it arrives."""

    def ping(self, timeout_s: float) -> float:
        """Round-trip seconds of a PING."""

    def close(self) -> None:
        ...
