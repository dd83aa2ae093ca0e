"""Names for the integers that travel through the system, so signatures say what they mean."""

from __future__ import annotations

from typing import NewType

LayerId = NewType("LayerId", int)  # index of a decoder layer whose MLP is a routed MoE
ExpertId = NewType("ExpertId", int)  # global routed-expert index within a layer
WorkerAddress = NewType("WorkerAddress", str)  # "host:port"


def parse_range(text: str, what: str) -> tuple[int, int]:
    """Parse an inclusive range "A-B" (or a single "A") into (A, B); raise ValueError naming `what`."""
    parts = text.split("-")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"bad {what} range {text!r}: expected A-B with integers A <= B") from None
    if low < 0 or high < low:
        raise ValueError(f"bad {what} range {text!r}: expected 0 <= A <= B")
    return low, high


def parse_address(text: str) -> tuple[str, int]:
    """Parse "host:port"; raise ValueError with the bad text."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT")
    return host, int(port)
