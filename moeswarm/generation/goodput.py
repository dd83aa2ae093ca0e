"""How many drafts a step should carry: the K maximising expected tokens per second of step.

Plain numbers in, K out (no clocks, no torch). The inputs are measured live by
generation/draft_measure.py: the step's cost as a line in the tokens it feeds (over a WAN the line's
intercept, the round trips, dwarfs its slope, the rows' bytes and compute) and a drafter's
acceptance per draft position, each the probability that position i is kept given the ones before
it were (an EMA, as vLLM's adaptive K keeps it).

Legend: K = drafts per row, a_i = acceptance at position i (1-based), B = rows (branches) the
sequence feeds, n = the step's tokens.

    tokens(K)  = 1 + sum_{k=1..K} prod_{i<=k} a_i           expected tokens a step emits
    seconds(K) = fixed + per_token * (base + B(K) * (1 + K)) + draft_s    (K >= 1)
    seconds(0) = fixed + per_token * (base + 1)                              (one row, one token)
    K*         = argmax_{1<=K<=cap} tokens(K) / seconds(K), where it beats K = 0 by the factor
                 (1 + DRAFT_MARGIN); else 0

Branches (a greedy step verifying several drafts side by side, generation/branches.py) are one
step whose kept run is the longest accepted one. The model's greedy token at each position is one
token, so the drafts' distinct prefixes of one length are exclusive: the run reaches position i
with probability mass_i, the sum over the distinct i-token prefixes of the product of their own
rates; the step's a_i is mass_i / mass_{i-1} (`branch_acceptance`), and B(K) is the number of
distinct drafts once cut to K, a draft that is the start of another not counted (the longer one's
row verifies its tokens: `own_rows`). Three drafts each kept at 0.17 make a step kept at 0.5, for
three rows.

A branch is fed only where its row pays (`choose_branches`): the step feeds the drafter's first n
drafts, n chosen with K, so a weak rival is dropped where a row is dear (a fast link, on the star:
every row reaches its own experts) and kept where rows are nearly free (a slow one). Feeding every
branch at every K made a step whose chance lies in one draft pay the others' rows too: it fed none,
or cut the strong one short.

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


def branch_acceptance(drafts: Sequence[Sequence[int]], rates: Sequence[Sequence[float]]) -> tuple[list[float], list[int]]:
    """Branches verified side by side as one step: (a_1..a_L, B(1)..B(L)), L the longest draft.
    drafts[b]: branch b's tokens; rates[b][i]: P(drafts[b][i] kept | drafts[b][:i] kept). Branches
    sharing a prefix share its rates (the first branch's are read); a_i is capped at 1."""
    acceptance: list[float] = []
    rows: list[int] = []
    reach = {(): 1.0}  # distinct prefixes of the current length -> P(the kept run follows it)
    for i in range(max((len(d) for d in drafts), default=0)):
        grown: dict[tuple[int, ...], float] = {}
        for draft, rate in zip(drafts, rates):
            if len(draft) > i and tuple(draft[:i + 1]) not in grown:
                grown[tuple(draft[:i + 1])] = reach[tuple(draft[:i])] * (rate[i] if i < len(rate) else 0.0)
        before, after = sum(reach.values()), sum(grown.values())
        acceptance.append(min(after / before, 1.0) if before > 0 else 0.0)
        rows.append(len(own_rows([d[:i + 1] for d in drafts if d])))
        reach = grown
    return acceptance, rows


def own_rows(drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The rows that verify `drafts`: each distinct draft once, in order, except one that is the start
    of another (the longer draft's row verifies every token it has)."""
    distinct: list[list[int]] = []
    for draft in drafts:
        if list(draft) not in distinct:
            distinct.append(list(draft))
    return [d for d in distinct if not any(len(o) > len(d) and o[:len(d)] == d for o in distinct)]


def goodput(acceptance: Sequence[float], cost: StepCost, k: int, rows: int | Sequence[int] = 1,
            base: int = 0) -> float:
    """Expected tokens per second of a step carrying K drafts in each of its rows (`rows`: how many,
    or B(1), B(2), ... by K, the last repeated); `base`: the tokens the step's other sequences feed."""
    if not k:
        return 1.0 / cost.seconds(base + 1, False)  # plain decoding: one row of one token
    if not isinstance(rows, int):
        rows = rows[min(k, len(rows)) - 1] if rows else 1
    return expected_tokens(acceptance, k) / cost.seconds(base + rows * (1 + k), True)


def choose_k(acceptance: Sequence[float], cost: StepCost, cap: int, rows: int | Sequence[int] = 1, base: int = 0,
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


def choose_branches(drafts: Sequence[Sequence[int]], rates: Sequence[Sequence[float]], cost: StepCost, cap: int,
                    base: int = 0, margin: float = DRAFT_MARGIN) -> tuple[int, int]:
    """(n, K): feed the first n of `drafts` (the drafter's order, its best first) cut to K drafts,
    the pair with the most expected tokens per second (the fewest rows, then the smallest K, on a
    tie), where that beats plain decoding by the factor (1 + margin); else (0, 0).
    rates[b][i]: P(drafts[b][i] kept | drafts[b][:i] kept), as `branch_acceptance` reads them."""
    plain = goodput((), cost, 0, 1, base)
    best_n, best_k, best = 0, 0, 0.0
    for n in range(1, len(drafts) + 1):
        acceptance, rows = branch_acceptance(drafts[:n], rates[:n])
        for k in range(1, max(0, cap) + 1):
            value = goodput(acceptance, cost, k, rows, base)
            if value > best * (1 + 1e-12):
                best_n, best_k, best = n, k, value
    return (best_n, best_k) if best > plain * (1 + margin) else (0, 0)
