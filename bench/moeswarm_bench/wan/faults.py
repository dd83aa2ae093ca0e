"""Faults switched on and off at run time: a stall of every delivery, a byte budget per
connection. Link changes (rtt, jitter, bandwidth) live in the proxy's LinkProfile instead."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Faults:
    """Mutable on purpose: the control channel flips these while connections run.

    stall_until: loop time before which nothing is delivered in either direction.
    close_after_bytes: close each connection once it has forwarded this many bytes upstream.
    """

    stall_until: float = 0.0
    close_after_bytes: int | None = None

    def clear(self) -> None:
        self.stall_until = 0.0
        self.close_after_bytes = None

    def to_dict(self, now: float) -> dict[str, float | int | None]:
        return {
            "stall_remaining_s": max(0.0, self.stall_until - now),
            "close_after_bytes": self.close_after_bytes,
        }
