"""How many batches a step puts in flight when the server chooses (`--groups 0`): by measurement.

Two groups pay when a step waits on its trips longer than it computes and its compute grows with
its rows (prefill, long contexts, many sequences); they lose when each forward costs about the
same whatever its rows (a small batch on a CPU reads every weight once per group). Which case
holds changes with RTT and load, so the policy measures: it keeps a moving average of seconds per
fed token for one and for two groups, uses the cheaper, and tries the other every EXPLORE_EVERY
steps. Plain numbers in, a count out.
"""

from __future__ import annotations

EXPLORE_EVERY = 16  # steps between tries of the count not in use
WEIGHT = 0.25  # of the newest step in the moving average


class GroupPolicy:
    def __init__(self):
        self.cost: dict[int, float] = {}  # groups -> seconds per fed token, averaged
        self.steps = 0

    def choose(self, remote: bool, sequences: int) -> int:
        """Groups for the next step: 1 without remote trips or with one sequence; else the cheaper."""
        if not remote or sequences < 2:
            return 1
        self.steps += 1
        untried = [count for count in (1, 2) if count not in self.cost]
        if untried:
            return untried[0]
        best = min(self.cost, key=self.cost.get)
        return (3 - best) if self.steps % EXPLORE_EVERY == 0 else best

    def record(self, groups: int, seconds: float, tokens: int) -> None:
        if groups not in (1, 2) or tokens <= 0:
            return
        cost = seconds / tokens
        self.cost[groups] = cost if groups not in self.cost else (1 - WEIGHT) * self.cost[groups] + WEIGHT * cost
