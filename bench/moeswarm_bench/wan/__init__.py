"""A userspace WAN emulator: an asyncio TCP proxy with latency, jitter, bandwidth and faults.

This kernel has no `tc netem`, so the link is modelled in the proxy itself. See docs/wan.md.
"""

from moeswarm_bench.wan.link import (
    LinkProfile,
    format_bandwidth,
    format_duration,
    parse_bandwidth,
    parse_duration,
)
from moeswarm_bench.wan.proxy import WanProxy

__all__ = [
    "LinkProfile",
    "WanProxy",
    "format_bandwidth",
    "format_duration",
    "parse_bandwidth",
    "parse_duration",
]
