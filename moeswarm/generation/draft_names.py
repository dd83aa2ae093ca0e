"""The drafters `--draft` names, and the flag checks the commands make before loading anything (no torch)."""

from __future__ import annotations

from moeswarm.errors import MoeSwarmError

DRAFTERS = ("ngram", "suffix", "local", "both")  # generation/drafters.py builds them
DEFAULT_DRAFT = "suffix"  # measured best of the model-free drafters (docs/drafts.md)
AUTO_SPECULATE = 8  # the cap where speculation is on by default (steps with remote trips)
POLICIES = ("goodput", "fixed")  # how a step's drafts are counted: the goodput rule under the cap, or the cap
NEEDS_LOCAL_EXPERTS = ("local", "both")


def check_draft_flags(draft: str, speculate: int | None, holds_local_experts: bool) -> None:
    """MoeSwarmError (one line) when --draft cannot work with the other flags."""
    if draft != DEFAULT_DRAFT and speculate == 0:  # None: the default, resolved once the swarm is open
        raise MoeSwarmError(f"--draft {draft} drafts nothing without --speculate K (the most drafts per step)")
    if draft in NEEDS_LOCAL_EXPERTS and not holds_local_experts:
        raise MoeSwarmError(f"--draft {draft} drafts with the experts the backbone holds itself: "
                            f"give --local-experts N|P%|FILE")
