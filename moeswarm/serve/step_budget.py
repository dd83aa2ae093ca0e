"""How many tokens a step may feed: `--step-tokens` at least, more while their compute fills the wait.

A step over remote experts waits on its trips (MoE layers x RTT) whatever it carries, and the
backbone computes nothing meanwhile. Prompt tokens added to such a step cost only their compute,
so the budget grows to the tokens whose compute, at the measured seconds per fed token, fits in
the time the last steps waited on replies, capped at `cap` (GROWTH x the floor in serve). On a WAN many prompts arriving at once
then reach their first token in a few steps instead of one `floor`-sized chunk per step; a stream
already decoding sees its step grow by at most about the wait it had anyway. Without remote
trips (local mode, a fast LAN) the wait is ~0 and the budget stays at `floor`.

Plain numbers in, a count out: moving averages of seconds per fed token computed and of seconds
waited per step.
"""

from __future__ import annotations

WEIGHT = 0.25  # of the newest step in the moving averages
GROWTH = 8  # the cap, in floors: a step's compute stays bounded whatever the wait


class StepBudget:
    def __init__(self, floor: int, cap: int):
        """floor: the budget without measurements or without waits (--step-tokens); cap: the most ever."""
        self.floor = max(1, floor)
        self.cap = max(self.floor, cap)
        self.compute_per_token_s: float | None = None
        self.waiting_s: float | None = None

    def tokens(self) -> int:
        """The next step's token budget."""
        if not self.compute_per_token_s or not self.waiting_s:
            return self.floor
        return max(self.floor, min(self.cap, int(self.waiting_s / self.compute_per_token_s)))

    def record(self, tokens: int, seconds: float, waiting_s: float) -> None:
        """A step fed `tokens` in `seconds` of forwards, of which `waiting_s` waiting on replies."""
        if tokens <= 0 or seconds <= 0:
            return
        per_token = max(0.0, seconds - waiting_s) / tokens
        self.compute_per_token_s = _mix(self.compute_per_token_s, per_token)
        self.waiting_s = _mix(self.waiting_s, max(0.0, waiting_s))


def _mix(average: float | None, value: float) -> float:
    return value if average is None else (1 - WEIGHT) * average + WEIGHT * value
