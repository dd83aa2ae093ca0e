"""Names for the integers that travel through the system, so signatures say what they mean."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NewType

LayerId = NewType("LayerId", int)  # index of a decoder layer whose MLP is a routed MoE
ExpertId = NewType("ExpertId", int)  # global routed-expert index within a layer
WorkerAddress = NewType("WorkerAddress", str)  # "host:port"
WorkerId = NewType("WorkerId", int)  # index of a holder (worker link) in a swarm's list of links


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


_ID_OR_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
MAX_EXPERT_ID = (1 << 16) - 1  # far above any model's experts: a typo cannot ask for billions of ids


def parse_experts(text: str) -> list[int]:
    """Parse an expert list "0-3,9,17-20" into ascending distinct ids; raise ValueError naming the bad part."""
    ids: list[int] = []
    for part in (piece.strip() for piece in text.split(",")):
        match = _ID_OR_RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"bad expert list {text!r}: {part!r} is not an expert id or an A-B range "
                             f"(expected e.g. 0-3,9,17-20)")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise ValueError(f"bad experts range {part!r} in {text!r}: expected A-B with A <= B")
        if high > MAX_EXPERT_ID:
            raise ValueError(f"bad expert list {text!r}: {part!r} goes past the largest expert id {MAX_EXPERT_ID}")
        if ids and low <= ids[-1]:
            raise ValueError(f"bad expert list {text!r}: {part!r} does not come after expert {ids[-1]} "
                             f"(list experts in ascending order, each once)")
        ids.extend(range(low, high + 1))
    return ids


def format_ids(ids: Sequence[int]) -> str:
    """Ascending distinct ids as runs: [0, 1, 2, 3, 9, 17, 18] -> "0-3,9,17-18" (parse_experts' inverse)."""
    return ",".join(f"{run.start}" if len(run) == 1 else f"{run.start}-{run.stop - 1}" for run in runs(ids)) or "none"


def runs(ids: Sequence[int]) -> list[range]:
    """The maximal runs of consecutive values of ascending ids: [0, 1, 2, 5, 7, 8] -> [0-2, 5, 7-8] as ranges."""
    found: list[range] = []
    for value in ids:
        if found and value == found[-1].stop:
            found[-1] = range(found[-1].start, value + 1)
        else:
            found.append(range(value, value + 1))
    return found


def parse_address(text: str) -> tuple[str, int]:
    """Parse "host:port"; raise ValueError with the bad text."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"bad address {text!r}: expected HOST:PORT")
    return host, int(port)
