"""How many tokens a step may feed: `--step-tokens` at least, more while their compute fills the wait.

A step over remote experts waits on its trips (MoE layers x RTT) whatever it carries, and the
backbone computes nothing meanwhile. Prompt tokens added to such a step cost only their compute,
so the budget grows to the tokens whose compute, at the measured seconds per fed token, fits in
the time the last steps waited on replies, capped at `cap` (GROWTH x the floor in serve). On a WAN many prompts arriving at once
then reach their first token in a few steps instead of one `floor`-sized chunk per step; a stream
already decoding sees its step grow by at most about the wait it had anyway. Without remote
trips (local mode, a fast LAN) the wait is ~0 and the budget stays at `floor`.

The cost of a fed token is the slope of a step's compute against its tokens (a least-squares line
over moving averages): a decode step's compute is mostly what any step costs (its weights read
once), so seconds / tokens of small steps would overstate it tenfold and hold the budget at its
floor just when a burst of prompts arrives. Until the steps' sizes have varied, the average cost
per token stands in (an overestimate: a smaller budget, the safe side).

Plain numbers in, a count out.
"""

from __future__ import annotations

WEIGHT = 0.25  # of the newest step in the moving averages
GROWTH = 8  # the cap, in floors: a step's compute stays bounded whatever the wait


class StepBudget:
    def __init__(self, floor: int, cap: int):
        """floor: the budget without measurements or without waits (--step-tokens); cap: the most ever."""
        self.floor = max(1, floor)
        self.cap = max(self.floor, cap)
        self._means: list[float] | None = None  # moving averages of tokens, compute s, tokens^2, tokens x compute
        self.waiting_s: float | None = None

    @property
    def compute_per_token_s(self) -> float | None:
        """Seconds of compute one more fed token adds to a step, as measured (None: not yet)."""
        if self._means is None:
            return None
        tokens, compute, squares, products = self._means
        variance = squares - tokens * tokens
        if variance > 1.0:
            slope = (products - tokens * compute) / variance
            if slope > 0:
                return slope
        return compute / tokens

    def tokens(self) -> int:
        """The next step's token budget."""
        per_token = self.compute_per_token_s
        if not per_token or not self.waiting_s:
            return self.floor
        return max(self.floor, min(self.cap, int(self.waiting_s / per_token)))

    def record(self, tokens: int, seconds: float, waiting_s: float) -> None:
        """A step fed `tokens` in `seconds` of forwards, of which `waiting_s` waiting on replies."""
        if tokens <= 0 or seconds <= 0:
            return
        compute = max(0.0, seconds - waiting_s)
        sample = (float(tokens), compute, float(tokens) * tokens, tokens * compute)
        self._means = list(sample) if self._means is None else [_mix(m, v) for m, v in zip(self._means, sample)]
        self.waiting_s = max(0.0, waiting_s) if self.waiting_s is None else _mix(self.waiting_s, max(0.0, waiting_s))


def _mix(average: float, value: float) -> float:
    return (1 - WEIGHT) * average + WEIGHT * value
