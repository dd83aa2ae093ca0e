"""Spot checks: does another holder compute the same answer as the one we were given?

A drawn fraction of shares is recomputed by another holder (the backbone's own process first
when it holds the experts). Exact mode on a lossless wire: any bit of difference is a lie.
Otherwise (partial sums, lossy codecs) a row whose cosine to the recomputed row falls below the
gate's threshold is. The dispatcher bans the liar and uses the recomputed rows.

Legend: T = tokens in the step, d = hidden size, n_e = rows of expert e.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeswarm.dispatch.plan import WorkerShare
from moeswarm.wire.config import CombineMode
from moeswarm.wire.messages import Result

GATE_MIN_COSINE = 0.998  # gate.GateConfig.min_cosine_mean: the bar a lossy wire must clear


@dataclass(frozen=True)
class SpotCheckPolicy:
    fraction: float = 0.0  # of the shares answered by a remote holder
    seed: int | None = None
    min_cosine: float = GATE_MIN_COSINE

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"spot-check fraction must be in [0, 1], got {self.fraction}")


class SpotChecker:
    def __init__(self, policy: SpotCheckPolicy):
        self.policy = policy
        self._rng = random.Random(policy.seed)

    def draw(self) -> bool:
        return self.policy.fraction > 0 and self._rng.random() < self.policy.fraction


def disagreement(mode: CombineMode, lossless: bool, min_cosine: float, tokens: int,
                 checked: tuple[WorkerShare, Result], recomputed: Sequence[tuple[WorkerShare, Result]],
                 exact_sums: bool = False) -> str | None:
    """How `checked` differs from `recomputed` (the same rows by other holders), or None.

    exact_sums: partial RESULTs that must equal their recomputation bit for bit (exact mode's summed
    shares over a lossless wire), not only in cosine."""
    if mode == CombineMode.EXACT:
        mine, theirs = _blocks(*checked), {}
        for share, result in recomputed:
            theirs.update(_blocks(share, result))
        if sorted(mine) != sorted(theirs):
            return f"answered experts {sorted(mine)}, the check computed {sorted(theirs)}"
        for expert in sorted(mine):
            if lossless and not torch.equal(mine[expert], theirs[expert]):
                return f"expert {expert} differs from its recomputation (exact mode)"
            if not lossless and (low := _low_cosine(mine[expert], theirs[expert], min_cosine)) is not None:
                return f"expert {expert}: a row's cosine to its recomputation is {low:.4f} < {min_cosine}"
        return None
    width = checked[1].outputs.shape[1]
    mine = _per_token(tokens, width, [checked])  # [T, d]
    theirs = _per_token(tokens, width, recomputed)  # [T, d]
    rows = checked[0].tokens
    if exact_sums:  # exact mode's summed shares (dispatch/flight.py `request`): the same adds, the same bits
        return None if torch.equal(mine[rows], theirs[rows]) else "a token's sum differs from its recomputation (exact mode)"
    low = _low_cosine(mine[rows], theirs[rows], min_cosine)
    return None if low is None else f"a token's partial sum has cosine {low:.4f} < {min_cosine} to its recomputation"


def _blocks(share: WorkerShare, result: Result) -> dict[int, torch.Tensor]:
    """{e: [n_e, d]} of an exact RESULT."""
    return dict(zip(result.experts, torch.split(result.outputs, result.counts)))


def _per_token(tokens: int, width: int, parts: Sequence[tuple[WorkerShare, Result]]) -> torch.Tensor:
    out = torch.zeros(tokens, width, dtype=torch.float64)  # [T, d]
    for share, result in parts:
        out.index_add_(0, share.tokens, result.outputs.to(torch.float64))
    return out


def _low_cosine(a: torch.Tensor, b: torch.Tensor, min_cosine: float) -> float | None:
    """The lowest row cosine of a vs b [n, d] if it is under `min_cosine` (rows both zero agree)."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30)  # [n]
    both_zero = (a.abs().amax(dim=-1) == 0) & (b.abs().amax(dim=-1) == 0)
    cos = torch.where(both_zero, torch.ones_like(cos), cos)
    low = float(cos.min()) if cos.numel() else 1.0
    return low if low < min_cosine or bool(torch.isnan(cos).any()) else None
