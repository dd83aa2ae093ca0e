"""`--speculate` and `--speculate-policy`, as generate and serve (and so a gateway over stages) take them."""

from __future__ import annotations

from moeswarm.commands._types import non_negative
from moeswarm.generation.draft_names import AUTO_SPECULATE, POLICIES


def add_speculate(add, per: str) -> None:
    """add: a parser's (or group's) add_argument; per: what K counts drafts per, for the help."""
    add("--speculate", type=non_negative, default=None, metavar="K",
        help=f"most drafts per {per} (0: off). Default: {AUTO_SPECULATE} where a step has remote trips (workers, "
             f"stages), off in local mode. Each step's count is chosen by the goodput rule, from the step cost and the "
             f"drafts' acceptance measured live, and is 0 when drafting does not pay (docs/drafts.md)")
    add("--speculate-policy", choices=POLICIES, default=POLICIES[0],
        help="goodput (default): each step's drafts counted by the goodput rule under --speculate; fixed: up to "
             "--speculate every step")
