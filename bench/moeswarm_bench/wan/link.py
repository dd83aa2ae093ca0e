"""The link a WAN proxy emulates, and parsers for the human units it is written in.

Durations: `80ms`, `0.08s`, `80us`, `1.5m`, `0` (a bare number other than 0 needs a unit).
Bandwidths (decimal prefixes, as network people count):
  bits per second:  `10kbit`, `100mbit`, `1gbit`, `100Mb/s`, `100mbit/s`
  bytes per second: `12.5MB/s`, `500kB/s`, `1GB/s`; binary: `10MiB/s`
`bps` alone is refused: tc reads `mbps` as megabytes, most people as megabits.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?"

_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
_DURATION_RE = re.compile(rf"^\s*{_NUMBER}\s*([a-zµ]*)\s*$")

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY_PREFIX = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_BANDWIDTH_RE = re.compile(rf"^\s*{_NUMBER}\s*([A-Za-z/]*)\s*$")


@dataclass(frozen=True)
class LinkProfile:
    """One direction-symmetric WAN link.

    rtt_s: round-trip propagation delay; each direction adds rtt_s / 2.
    jitter_s: each chunk's one-way delay moves uniformly in [-jitter_s, +jitter_s] (never
        reordering bytes: a chunk is never delivered before the one sent ahead of it).
    bandwidth_bps: bits per second, per direction; None = not capped.
    """

    rtt_s: float
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None

    def __post_init__(self) -> None:
        if not self.rtt_s >= 0:
            raise ValueError(f"rtt must be >= 0, got {self.rtt_s!r}")
        if not self.jitter_s >= 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter_s!r}")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth must be > 0 (or None), got {self.bandwidth_bps!r}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_s / 2

    def replace(self, **changes) -> LinkProfile:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        bandwidth = "unlimited" if self.bandwidth_bps is None else format_bandwidth(self.bandwidth_bps)
        return (
            f"rtt={format_duration(self.rtt_s)} jitter={format_duration(self.jitter_s)} "
            f"bandwidth={bandwidth}"
        )

    def to_dict(self) -> dict[str, float | None]:
        return {"rtt_s": self.rtt_s, "jitter_s": self.jitter_s, "bandwidth_bps": self.bandwidth_bps}


def _number(match: re.Match) -> float:
    mantissa, exponent = match.group(1), match.group(2)
    return float(mantissa + (f"e{exponent}" if exponent else ""))


def parse_duration(text: str) -> float:
    """`"80ms"` -> 0.08 (seconds). Raises ValueError naming the bad value."""
    match = _DURATION_RE.match(str(text))
    if not match:
        raise ValueError(f"bad duration {text!r}: expected a number and a unit, e.g. 80ms, 0.08s, 80us")
    value, unit = _number(match), match.group(3)
    if unit == "":
        if value == 0:
            return 0.0
        raise ValueError(f"bad duration {text!r}: missing unit (ns, us, ms, s or m), e.g. {text}ms")
    if unit not in _DURATION_UNITS:
        raise ValueError(f"bad duration {text!r}: unknown unit {unit!r} (use ns, us, ms, s or m)")
    return value * _DURATION_UNITS[unit]


def parse_bandwidth(text: str) -> float:
    """`"100mbit"` -> 1e8 (bits per second); `"12.5MB/s"` -> 1e8. Raises ValueError."""
    match = _BANDWIDTH_RE.match(str(text))
    if not match:
        raise ValueError(f"bad bandwidth {text!r}: expected e.g. 100mbit, 1gbit, 12.5MB/s")
    value, unit = _number(match), match.group(3)
    bits_per_second = _bandwidth_unit(text, unit)
    if not value > 0:
        raise ValueError(f"bad bandwidth {text!r}: must be > 0")
    return value * bits_per_second


def _bandwidth_unit(text: str, unit: str) -> float:
    """Bits per second in one `unit`; case matters only for b (bit) versus B (byte)."""
    if unit == "":
        raise ValueError(f"bad bandwidth {text!r}: missing unit, e.g. {text}mbit or {text}MB/s")
    lower = unit.lower()
    if lower.endswith("bit/s"):
        lower = lower[: -len("/s")]
    if lower.endswith("bit") and lower[: -len("bit")] in _PREFIX:
        return _PREFIX[lower[: -len("bit")]]
    if lower.endswith("bps"):
        raise ValueError(f"bad bandwidth {text!r}: 'bps' is ambiguous; write e.g. 100mbit or 12.5MB/s")
    if unit.endswith("/s") and len(unit) >= 3:
        prefix, kind = unit[:-3].lower(), unit[-3]
        scale = {**_PREFIX, **_BINARY_PREFIX}.get(prefix)
        if scale is not None and kind in "bB":
            return scale * (8.0 if kind == "B" else 1.0)
    raise ValueError(
        f"bad bandwidth {text!r}: unknown unit {unit!r} (use bit, kbit, mbit, gbit, or kB/s, MB/s, MiB/s)"
    )


def format_duration(seconds: float) -> str:
    if seconds == 0:
        return "0ms"
    if seconds < 1e-3:
        return f"{seconds * 1e6:g}us"
    if seconds < 1:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds:g}s"


def format_bandwidth(bits_per_second: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}"
    return f"{bits_per_second:g}bit"
