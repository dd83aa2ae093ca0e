"""How many drafts a step should carry: the K maximising expected tokens per second of step.

Plain numbers in, K out (no clocks, no torch). The inputs are measured live by
generation/draft_measure.py: the step's cost as a line in the tokens it feeds (over a WAN the line's
intercept, the round trips, dwarfs its slope, the rows' bytes and compute) and a drafter's
acceptance per draft position, each the probability that position i is kept given the ones before
it were (an EMA, as vLLM's adaptive K keeps it).

Legend: K = drafts per row, a_i = acceptance at position i (1-based), B = rows (branches) the
sequence feeds, n = the step's tokens.

    tokens(K)  = 1 + sum_{k=1..K} prod_{i<=k} a_i           expected tokens a step emits
    seconds(K) = fixed + per_token * (base + B * (1 + K)) + (draft_s if K else 0)
    K*         = argmax_{1<=K<=cap} tokens(K) / seconds(K), where it beats K = 0 by the factor
                 (1 + DRAFT_MARGIN); else 0

The margin: acceptance and cost are estimates from a few steps, and a draft row costs more than the
line says when it is rejected (the rollback, the drafter's own lookups). A step drafts only when the
gain the estimates promise is worth being wrong about; where drafts are kept, the gain is far past it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DRAFT_MARGIN = 0.05  # the least gain in expected tokens per second for which a step drafts


@dataclass(frozen=True)
class StepCost:
    """A step's seconds as a line in its tokens, plus the drafting a drafting step adds."""

    fixed_s: float  # the intercept: round trips, the per-step work whatever the rows
    per_token_s: float  # each token fed: bytes, the union of experts the rows reach, compute
    draft_s: float = 0.0  # drafting a step's drafts (model-free: ~0; local drafts: local forwards)

    def seconds(self, tokens: int, drafting: bool) -> float:
        return self.fixed_s + self.per_token_s * tokens + (self.draft_s if drafting else 0.0)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a step with K drafts emits on average: its own token plus each draft kept with all
    before it (acceptance[i] = a_{i+1}; positions past its end count as 0)."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acceptance[i] if i < len(acceptance) else 0.0
        total += reach
    return total


def goodput(acceptance: Sequence[float], cost: StepCost, k: int, rows: int = 1, base: int = 0) -> float:
    """Expected tokens per second of a step carrying K drafts in each of `rows` rows; `base`: the
    tokens the step's other sequences feed."""
    return expected_tokens(acceptance, k) / cost.seconds(base + rows * (1 + k), k > 0)


def choose_k(acceptance: Sequence[float], cost: StepCost, cap: int, rows: int = 1, base: int = 0,
             margin: float = DRAFT_MARGIN) -> int:
    """The K in [1, cap] with the most expected tokens per second (the smallest such K on a tie),
    where that beats plain decoding (K = 0) by the factor (1 + margin); else 0."""
    plain = goodput(acceptance, cost, 0, rows, base)
    best_k, best = 0, 0.0
    for k in range(1, max(0, cap) + 1):
        value = goodput(acceptance, cost, k, rows, base)
        if value > best * (1 + 1e-12):
            best_k, best = k, value
    return best_k if best > plain * (1 + margin) else 0
