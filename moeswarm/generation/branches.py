"""Several drafts verified in one forward: the branch whose drafts the model keeps longest wins.

A round trip costs the same for one row or a few (the rows are a few hundred bytes each), so a
greedy step can carry every alternative its drafters have (n-gram continuations of different
earlier occurrences, the local model's second-best first token) and keep the longest accepted
run. Each branch is its own row of the batch, on its own copy of the cache (Stepper.forward_rows):
the rows never see each other, and the kept row's logits are those of an ordinary speculative
step on that branch. Greedy only: for sampling, choosing among drafts after seeing the model's
logits would bias the output, so sampled steps verify one draft.

Legend: B = branches, L = the longest branch's drafts, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeswarm.generation.sampling import SamplingParams, verify


@dataclass(frozen=True)
class Chosen:
    row: int  # the branch kept
    accepted: int  # of its drafts
    next_token: int  # the model's token after them


def rows_of(next_token: int, branches: list[list[int]]) -> list[list[int]]:
    """[B][1 + L] token rows: the last token, then each branch's drafts, padded by repeating its last
    token (padding's logits are never read, and its cache entries are cropped)."""
    longest = max(len(branch) for branch in branches)
    rows = []
    for branch in branches:
        row = [next_token] + branch
        rows.append(row + [row[-1]] * (1 + longest - len(row)))
    return rows


def choose(logits: torch.Tensor, branches: list[list[int]], sampling: SamplingParams,
           generator: torch.Generator, eos_token_id: int | None = None) -> Chosen:
    """The branch with the most accepted drafts (the first on a tie). logits [B, 1 + L, V].

    eos is never accepted as a draft: it comes as a step's own token, which ends the generation.
    """
    if len(branches) > 1:
        assert sampling.greedy, "branches are verified greedily only"
    best: Chosen | None = None
    for row, branch in enumerate(branches):
        kept = branch.index(eos_token_id) if eos_token_id in branch else len(branch)
        accepted, next_token = verify(logits[row, : 1 + kept], branch[:kept], sampling, generator)
        if best is None or accepted > best.accepted:
            best = Chosen(row, accepted, next_token)
    return best
