"""How long a bench repeats one timed step: enough samples that one slow turn moves no median.

At least 3 runs always; then runs go on while fewer than MIN_RUNS were taken or less than
`min_s` has passed, up to MAX_RUNS or `budget_s`. A one-token DISPATCH (a few ms) gets a hundred
samples or more, a 64-token prefill of a large layer a handful within the budget.
"""

from __future__ import annotations

import time

MIN_RUNS = 7
MAX_RUNS = 400
MIN_S = 0.5


class Repeats:
    def __init__(self, budget_s: float, min_s: float = MIN_S):
        self.budget_s = budget_s
        self.min_s = min(min_s, budget_s)
        self.start = time.perf_counter()

    def more(self, done: int) -> bool:
        """Whether to take another run, `done` taken so far."""
        if done < 3:
            return True
        elapsed = time.perf_counter() - self.start
        if done >= MAX_RUNS or elapsed >= self.budget_s:
            return False
        return done < MIN_RUNS or elapsed < self.min_s
