"""`moeswarm bench swarm`'s settings: its flags' defaults, the run's frozen settings, and the command
line that reproduces a run (a report keeps one result per command line)."""

from __future__ import annotations

from dataclasses import dataclass

JOINERS = (2, 4, 8)
KILLS = 3
REPLICAS = 2
TTL_S = 5.0  # a killed member's record lasts at most this long
REBALANCE_S = 2.0  # seconds between a member's rebalancing rounds
SEGMENT_TOKENS = 128


@dataclass(frozen=True)
class Settings:
    joiners: tuple[int, ...] = JOINERS
    kills: int = KILLS
    replicas: int = REPLICAS
    seed: int = 0
    ttl_s: float = TTL_S
    rebalance_s: float = REBALANCE_S
    segment_tokens: int = SEGMENT_TOKENS
    rejoin: str = "expiry"  # or "now"
    keyed: bool = False
    check_local: bool = False


def command_line(model: str, settings: Settings) -> str:
    """The `moeswarm bench swarm` command that runs `settings` on `model` (defaults left out)."""
    parts = [f"moeswarm bench swarm --model {model} --joiners {','.join(map(str, settings.joiners))}",
             f"--kills {settings.kills}", f"--replicas {settings.replicas}", f"--seed {settings.seed}"]
    if settings.rejoin != "expiry":
        parts.append(f"--rejoin {settings.rejoin}")
    if settings.ttl_s != TTL_S:
        parts.append(f"--ttl {settings.ttl_s:g}")
    if settings.rebalance_s != REBALANCE_S:
        parts.append(f"--rebalance {settings.rebalance_s:g}")
    if settings.segment_tokens != SEGMENT_TOKENS:
        parts.append(f"--segment-tokens {settings.segment_tokens}")
    parts += ["--keyed"] * settings.keyed + ["--check-local"] * settings.check_local
    return " ".join(parts)
