"""`plan_layer`: which rows of a layer's step go to which worker (pure, in-process).

Legend: T = tokens, k = router top-k, E = routed experts, W = workers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswarm.dispatch.plan import WorkerShare, plan_layer

LONG = torch.long


def _share_tuple(share: WorkerShare) -> tuple:
    return share.worker, share.tokens.tolist(), share.top_k_index.tolist(), share.top_k_weights.tolist()


def test_three_workers_by_hand():
    owner = torch.tensor([0, 0, 1, 1, 2, 2])  # [E]: experts 0-1 on worker 0, 2-3 on 1, 4-5 on 2
    index = torch.tensor([[0, 2], [3, 1], [4, 5], [1, 0]])  # [T, k]
    weights = torch.tensor([[0.625, 0.375], [0.75, 0.25], [0.5, 0.5], [0.875, 0.125]])  # [T, k]

    shares = plan_layer(owner, index, weights)

    assert [_share_tuple(s) for s in shares] == [
        (0, [0, 1, 3], [[0, -1], [-1, 1], [1, 0]], [[0.625, 0.375], [0.75, 0.25], [0.875, 0.125]]),
        (1, [0, 1], [[-1, 2], [3, -1]], [[0.625, 0.375], [0.75, 0.25]]),
        (2, [2], [[4, 5]], [[0.5, 0.5]]),
    ]
    for share in shares:
        assert share.tokens.dtype == LONG and share.top_k_index.dtype == LONG
        assert share.top_k_weights.dtype == torch.float32


def test_a_worker_without_tokens_gets_no_share():
    owner = torch.tensor([0, 0, 1, 1, 2, 2])
    index = torch.tensor([[5, 0], [1, 4]])  # nothing routed to experts 2-3 (worker 1)
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75]])

    shares = plan_layer(owner, index, weights)

    assert [_share_tuple(s) for s in shares] == [
        (0, [0, 1], [[-1, 0], [1, -1]], [[0.5, 0.5], [0.25, 0.75]]),
        (2, [0, 1], [[5, -1], [-1, 4]], [[0.5, 0.5], [0.25, 0.75]]),
    ]


def test_workers_come_in_ascending_order_whatever_the_expert_order():
    owner = torch.tensor([3, 1, 3, 0])  # non-contiguous placement, worker 2 holds nothing
    index = torch.tensor([[0, 1], [3, 2]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.bfloat16)

    shares = plan_layer(owner, index, weights)

    assert [_share_tuple(s) for s in shares] == [
        (0, [1], [[3, -1]], [[0.25, 0.75]]),
        (1, [0], [[-1, 1]], [[0.5, 0.5]]),
        (3, [0, 1], [[0, -1], [-1, 2]], [[0.5, 0.5], [0.25, 0.75]]),
    ]
    assert {s.top_k_weights.dtype for s in shares} == {torch.bfloat16}


def test_one_worker_gets_everything_unchanged():
    owner = torch.zeros(4, dtype=LONG)
    index = torch.tensor([[2, 0], [1, 3], [3, 2]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.125, 0.875]])

    (share,) = plan_layer(owner, index, weights)

    assert share.worker == 0
    assert torch.equal(share.tokens, torch.tensor([0, 1, 2]))
    assert torch.equal(share.top_k_index, index) and torch.equal(share.top_k_weights, weights)


def test_no_tokens_no_shares():
    owner = torch.tensor([0, 1])
    assert plan_layer(owner, torch.empty(0, 2, dtype=LONG), torch.empty(0, 2)) == []


def test_an_unheld_expert_is_named():
    owner = torch.tensor([0, 0, -1, 1, -1, 1])  # experts 2 and 4 have no worker
    index = torch.tensor([[4, 0], [2, 3], [4, 2]])
    weights = torch.full((3, 2), 0.5)

    with pytest.raises(LookupError) as caught:
        plan_layer(owner, index, weights)

    assert str(caught.value) == "no worker holds experts [2, 4]"


def test_an_unheld_expert_that_nobody_routes_to_is_fine():
    owner = torch.tensor([0, -1, 1])
    shares = plan_layer(owner, torch.tensor([[2, 0]]), torch.tensor([[0.5, 0.5]]))
    assert [_share_tuple(s) for s in shares] == [(0, [0], [[-1, 0]], [[0.5, 0.5]]), (1, [0], [[2, -1]], [[0.5, 0.5]])]


@st.composite
def routings(draw):
    """(owner [E] with -1 for unheld experts, top_k_index [T, k] distinct per row, top_k_weights [T, k])."""
    num_experts = draw(st.integers(1, 8))
    workers = draw(st.integers(1, 4))
    unheld_allowed = draw(st.booleans())  # half the placements cover every expert
    owner = draw(st.lists(st.integers(-1 if unheld_allowed else 0, workers - 1), min_size=num_experts, max_size=num_experts))
    k = draw(st.integers(1, min(num_experts, 4)))
    tokens = draw(st.integers(0, 6))
    rows = [draw(st.permutations(range(num_experts)))[:k] for _ in range(tokens)]
    weights = [draw(st.lists(st.floats(0, 1, width=32), min_size=k, max_size=k)) for _ in range(tokens)]
    return (torch.tensor(owner, dtype=LONG), torch.tensor(rows, dtype=LONG).reshape(tokens, k),
            torch.tensor(weights, dtype=torch.float32).reshape(tokens, k))


@settings(max_examples=300, deadline=None)
@given(routings())
def test_shares_partition_the_token_slot_pairs(routing):
    owner, index, weights = routing  # [E], [T, k], [T, k]
    missing = sorted({e for e in index.flatten().tolist() if owner[e] < 0})
    if missing:
        with pytest.raises(LookupError) as caught:
            plan_layer(owner, index, weights)
        assert str(caught.value) == f"no worker holds experts {missing}"
        return

    shares = plan_layer(owner, index, weights)

    workers = [s.worker for s in shares]
    assert workers == sorted(set(owner[index].flatten().tolist()))  # ascending, exactly the workers involved
    covered = []
    for share in shares:
        tokens = share.tokens.tolist()
        assert tokens == sorted(set(tokens))
        assert torch.equal(share.top_k_weights, weights[share.tokens])
        for row, token in enumerate(tokens):
            expected = [e if owner[e] == share.worker else -1 for e in index[token].tolist()]
            assert share.top_k_index[row].tolist() == expected
            assert expected != [-1] * len(expected)  # a token is in a share only if it uses the worker
            covered += [(token, slot) for slot, e in enumerate(expected) if e >= 0]
    tokens, k = index.shape
    assert sorted(covered) == [(t, s) for t in range(tokens) for s in range(k)]  # each pair exactly once
