"""Several drafts verified in one forward (generation/branches.py, Stepper.forward_rows)."""

from __future__ import annotations

import torch

from moeswarm.generation.branches import choose, rows_of
from moeswarm.generation.draft import propose, propose_many
from moeswarm.engine.generate import generate
from moeswarm.generation.sampling import SamplingParams, make_generator
from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_local
from moeswarm.engine.whole_model import WholeModel

PROMPT = [5, 17, 23, 42, 8, 99, 3, 61]
GREEDY = SamplingParams()


def test_rows_are_padded_with_each_branch_last_token():
    assert rows_of(9, [[1, 2, 3], [4], [5, 6]]) == [[9, 1, 2, 3], [9, 4, 4, 4], [9, 5, 6, 6]]


def _logits(best: list[list[int]], vocabulary: int = 10) -> torch.Tensor:
    """[B, n, V] logits whose argmax at row b, position i is best[b][i]."""
    logits = torch.zeros(len(best), len(best[0]), vocabulary)
    for b, row in enumerate(best):
        for i, token in enumerate(row):
            logits[b, i, token] = 1.0
    return logits


def test_the_branch_accepted_longest_is_kept_and_the_first_wins_ties():
    branches = [[1, 2, 3], [1, 2, 4], [7, 8, 9]]
    logits = _logits([[1, 5, 0, 0], [1, 2, 4, 6], [1, 2, 4, 6]])  # row 1 accepts all 3; row 2 none
    chosen = choose(logits, branches, GREEDY, make_generator(0))
    assert (chosen.row, chosen.accepted, chosen.next_token) == (1, 3, 6)

    tie = choose(_logits([[1, 2, 0, 0], [1, 2, 0, 0], [3, 0, 0, 0]]), [[1, 3, 3], [1, 4, 4], [2, 2, 2]], GREEDY,
                 make_generator(0))
    assert (tie.row, tie.accepted, tie.next_token) == (0, 1, 2)


def test_ngram_branches_are_distinct_continuations_longest_match_first():
    tokens = [1, 2, 3, 1, 2, 4, 9, 2, 5, 1, 2]
    found = propose_many(tokens, 2, 3)
    assert found == [[4, 9], [3, 1], [5, 1]]  # "1 2" then, latest first; then "2" alone
    assert propose(tokens, 2) == found[0]
    assert propose_many(tokens, 2, 1) == [found[0]] and propose_many([1, 2, 3], 2, 3) == []


def test_a_kept_branch_continues_as_if_fed_alone(qwen2_moe):
    """Three branches in one forward; after keeping one, the cache is that branch's: the next
    forward's logits match a stepper that was fed the branch alone (same tokens, float-close)."""
    model = load_local(qwen2_moe)
    branched, alone = Stepper(model), Stepper(model)
    branched.forward(PROMPT)
    alone.forward(PROMPT)
    assert branched.branchable
    logits = branched.forward_rows([[7, 8, 9], [7, 10, 11], [7, 12, 13]])  # [B=3, n=3, V]
    assert logits.shape[:2] == (3, 3) and branched.rows == 3
    branched.keep_row(1)
    expected = alone.forward([7, 10, 11])  # [3, V]
    assert torch.allclose(logits[1], expected, atol=1e-5)
    assert branched.rows == 1 and branched.length == alone.length == len(PROMPT) + 3
    branched.crop(len(PROMPT) + 2)
    alone.crop(len(PROMPT) + 2)
    assert torch.allclose(branched.forward([3]), alone.forward([3]), atol=1e-5)


def test_greedy_ngram_branches_keep_the_plain_output_exactly(qwen2_moe):
    """Repetitive prompt: n-gram branches from several occurrences, through the engine; the tokens are
    plain decode's and every forward is torch.equal to a reference fed the same rows."""
    model = load_local(qwen2_moe)
    prompt = PROMPT + [5, 17, 40] + PROMPT[:4] + [5, 17]
    plain = generate(WholeModel(model), prompt, 10)
    result = generate(WholeModel(model), prompt, 10, 4, reference=load_local(qwen2_moe), draft="ngram")
    assert result.tokens == plain.tokens
    assert (result.bit_identical, result.tokens_match) == (True, True)
    assert result.branches > result.steps and result.drafted_all > result.drafted
