"""A join's (or rejoin's) row: its seconds from the process's start, and every byte it fetched (the
manifest and the slice) against its share's bytes (its experts' blocks over every MoE layer)."""

from __future__ import annotations

import math

from moeswarm_bench.bench.swarm_procs import Joiner


def experts_each(count: int, num_experts: int, replicas: int) -> int:
    """Experts each of `count` joiners holds for every expert to be held `replicas` times."""
    return min(num_experts, math.ceil(replicas * num_experts / count))


def join_row(joiner: Joiner, figures, manifest_bytes: int | None, expert_bytes: int) -> dict:
    """A join's (or rejoin's) figures: its seconds, and its bytes against its share's."""
    share_bytes = len(figures.share) * expert_bytes
    fetched = figures.fetch.fetched_bytes + (manifest_bytes or 0)
    return {"joiner": joiner.name, "start": len(joiner.lives), **figures.seconds(), "experts": len(figures.share),
            "share": list(figures.share), "share_bytes": share_bytes, "manifest_bytes": manifest_bytes or 0,
            "slice_bytes": figures.fetch.fetched_bytes, "reused": figures.fetch.reused, "fetched_bytes": fetched,
            "fetched_over_share": fetched / share_bytes if share_bytes else None}
