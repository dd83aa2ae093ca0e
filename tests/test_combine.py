"""`combine_exact` and `combine_partial` against transformers' eager experts, in-process.

Legend: T = tokens, k = top-k, d = hidden size, E = routed experts, n_e = rows of expert e.

Per-expert outputs are made the way a worker makes them (moeswarm/worker/store.py `run`): one
call of the eager experts module over the (token, expert) pairs of the experts it holds, each
expert's rows in eager's order (slot-major, then token), each row one pair's w * E_e(x).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from moeswarm.dispatch.combine import RANK_ADD_TOKENS, combine_exact, combine_partial, combine_token
from moeswarm.dispatch.plan import plan_layer
from moeswarm.model.experts import experts_modules
from moeswarm.worker.store import _by_token

FAMILIES = ("qwen2_moe", "mixtral", "gpt_oss")
TOKENS = 9
TOP_K = 4  # above the models' own top-2: with 2 experts a token's sum has one association only
PARTIAL_TOLERANCE = dict(rtol=1e-6, atol=1e-6)  # a few float32 ulps of outputs of order 1 (measured: 1-2 ulps)


@pytest.fixture(scope="module")
def experts_of(tiny_models):
    """family -> {layer: experts module} of the tiny model loaded with eager experts."""
    loaded: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in loaded:
            model = AutoModelForCausalLM.from_pretrained(tiny_models(family), experts_implementation="eager")
            loaded[family] = {layer: module for layer, (_, module) in experts_modules(model).items()}
        return loaded[family]

    return get


def _routing(module: torch.nn.Module, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden [T, d], top_k_index [T, k] (distinct experts per row), top_k_weights [T, k] (softmaxed)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = next(module.parameters()).dtype
    hidden = torch.randn(TOKENS, module.config.hidden_size, generator=generator, dtype=dtype)  # [T, d]
    index = torch.rand(TOKENS, module.num_experts, generator=generator).argsort(dim=1)[:, :TOP_K]  # [T, k]
    weights = torch.randn(TOKENS, TOP_K, generator=generator).softmax(dim=-1).to(dtype)  # [T, k]
    return hidden, index, weights


@torch.inference_mode()
def _worker_outputs(module, hidden, index, weights) -> tuple[list[int], list[int], torch.Tensor]:
    """What a worker returns for one share: experts hit (ascending), rows per expert, outputs [sum(n_e), d].

    hidden [T_w, d], index [T_w, k] with -1 for other workers' experts, weights [T_w, k].
    """
    hit = torch.unique(index[index >= 0]).tolist()  # ascending, as eager visits them
    slots, tokens = zip(*(torch.where(index.T == expert) for expert in hit))  # per expert [n_e], eager's order
    counts = [t.numel() for t in tokens]
    rows = torch.cat(tokens)  # [S]
    experts = torch.repeat_interleave(torch.tensor(hit), torch.tensor(counts)).unsqueeze(1)  # [S, 1]
    pair_weights = torch.cat([weights[t, s] for t, s in zip(tokens, slots)]).unsqueeze(1)  # [S, 1]
    return hit, counts, module(hidden[rows], experts, pair_weights)  # [S, d]


def _split(num_experts: int, workers: int) -> torch.Tensor:
    """owner [E]: experts dealt round-robin, so a token's experts alternate between workers."""
    return torch.arange(num_experts) % workers


@pytest.mark.parametrize("family", FAMILIES)
def test_combine_exact_is_eager_bit_for_bit(experts_of, family):
    for layer, module in experts_of(family).items():
        hidden, index, weights = _routing(module, seed=layer)
        with torch.inference_mode():
            eager = module(hidden, index, weights)  # [T, d]
        per_expert: dict[int, torch.Tensor] = {}
        for share in plan_layer(_split(module.num_experts, 2), index, weights):
            hit, counts, outputs = _worker_outputs(module, hidden[share.tokens], share.top_k_index, share.top_k_weights)
            per_expert.update(zip(hit, torch.split(outputs, counts)))  # {e: [n_e, d]}

        combined = combine_exact(hidden, index, per_expert)

        assert sorted(per_expert) == torch.unique(index).tolist()
        assert combined.dtype == eager.dtype and torch.equal(combined, eager), f"{family} layer {layer}"


@pytest.mark.parametrize("family", FAMILIES)
def test_combine_partial_is_eager_up_to_addition_order(experts_of, family):
    """Partial combine is NOT required to be bit-identical, and this test does not ask it to be.

    Each worker first adds its own experts' rows per token, then the backbone adds the workers'
    sums: a token routed to experts 0, 1, 2, 3 on workers {0, 2} and {1, 3} gets
    (y0 + y2) + (y1 + y3) where eager computes ((y0 + y1) + y2) + y3. Float addition is not
    associative, so the last bits may differ; the products w * E_e(x) themselves are the same.
    """
    for layer, module in experts_of(family).items():
        hidden, index, weights = _routing(module, seed=100 + layer)
        with torch.inference_mode():
            eager = module(hidden, index, weights)  # [T, d]
        partials = []
        for share in plan_layer(_split(module.num_experts, 2), index, weights):
            hit, counts, outputs = _worker_outputs(module, hidden[share.tokens], share.top_k_index, share.top_k_weights)
            _, local_tokens = zip(*(torch.where(share.top_k_index.T == e) for e in hit))
            sums = torch.zeros(share.tokens.numel(), hidden.shape[1], dtype=hidden.dtype)  # [T_w, d]
            sums.index_add_(0, torch.cat(local_tokens), outputs)  # experts in ascending order, as the worker does
            partials.append((share.tokens, sums))

        combined = combine_partial(hidden, partials)

        assert len(partials) == 2
        torch.testing.assert_close(combined, eager, **PARTIAL_TOLERANCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_combine_partial_of_one_worker_is_eager_bit_for_bit(experts_of, family):
    """With every expert on one worker, its per-token sum adds in eager's order: nothing to reassociate."""
    for layer, module in experts_of(family).items():
        hidden, index, weights = _routing(module, seed=200 + layer)
        with torch.inference_mode():
            eager = module(hidden, index, weights)
        hit, counts, outputs = _worker_outputs(module, hidden, index, weights)
        _, tokens = zip(*(torch.where(index.T == e) for e in hit))
        sums = torch.zeros_like(hidden).index_add_(0, torch.cat(tokens), outputs)  # [T, d]

        assert torch.equal(combine_partial(hidden, [(torch.arange(TOKENS), sums)]), eager)


def test_combine_exact_by_hand():
    hidden = torch.zeros(3, 2)  # [T, d]: only its shape and dtype count
    index = torch.tensor([[0, 1], [1, 2], [2, 0]])  # [T, k]
    # rows in eager order: expert 0 at (slot 0, token 0), (slot 1, token 2); expert 1 at (0, 1), (1, 0); ...
    per_expert = {
        0: torch.tensor([[1.0, 2.0], [3.0, 4.0]]),  # tokens 0, 2
        1: torch.tensor([[10.0, 20.0], [30.0, 40.0]]),  # tokens 1, 0
        2: torch.tensor([[100.0, 200.0], [300.0, 400.0]], dtype=torch.bfloat16),  # tokens 2, 1: cast to f32
    }

    combined = combine_exact(hidden, index, per_expert)

    assert combined.dtype == torch.float32
    assert torch.equal(combined, torch.tensor([[31.0, 42.0], [310.0, 420.0], [103.0, 204.0]]))


def test_combine_partial_by_hand():
    hidden = torch.zeros(3, 2, dtype=torch.float64)
    partials = [
        (torch.tensor([0, 2]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])),
        (torch.tensor([2]), torch.tensor([[10.0, 20.0]], dtype=torch.float16)),
    ]

    combined = combine_partial(hidden, partials)

    assert combined.dtype == torch.float64
    assert torch.equal(combined, torch.tensor([[1.0, 2.0], [0.0, 0.0], [13.0, 24.0]], dtype=torch.float64))


def _index_add_reference(hidden, top_k_index, per_expert):
    final = torch.zeros_like(hidden)
    for expert in sorted(per_expert):
        _, token = torch.where(top_k_index.T == expert)
        final.index_add_(0, token, per_expert[expert])
    return final


@pytest.mark.parametrize("tokens, repeat", [(1, True), (3, True), (64, True), (65, True),
                                            (2, False), (16, False), (RANK_ADD_TOKENS, False), (RANK_ADD_TOKENS + 1, False)])
def test_combine_exact_has_eager_index_add_bits(tokens, repeat):
    """combine_exact (its one-row path, its adds by rank and its loop per expert) equals eager's
    per-expert index_add_, bit for bit (int32 views: signed zeros and all), with unrouted slots (-1),
    uneven experts per token, infinities, experts whose rows came summed elsewhere (absent from
    per_expert), and (repeat) an expert repeated in a row."""
    generator = torch.Generator().manual_seed(tokens)
    E, k, d = 16, 4, 32
    index = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(tokens)])  # [T, k]
    index[torch.rand(tokens, k, generator=generator) < 0.3] = -1
    if repeat:
        index[0, 1] = index[0, 0]  # a router that picks an expert twice for a row (deepseek_v4's hash routing does)
    hidden = torch.randn(tokens, d, generator=generator)
    per_expert = {}
    for expert in torch.unique(index[index >= 0]).tolist():
        if not repeat and expert % 5 == 4:
            continue  # as if another holder summed its tokens' rows (dispatch/flight.py)
        n = int((index == expert).sum())
        rows = torch.randn(n, d, generator=generator) * 10.0 ** torch.randint(-3, 4, (n, 1), generator=generator)
        rows[rows.abs() < 0.05] = -0.0
        rows[torch.rand(n, d, generator=generator) < 0.01] = float("-inf")
        per_expert[expert] = rows
    got, want = combine_exact(hidden, index, per_expert), _index_add_reference(hidden, index, per_expert)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("tokens", [1, 16, RANK_ADD_TOKENS + 1])
def test_combine_exact_goes_on_from_a_holders_first_sums(tokens):
    """A holder of the lowest experts sums its rows per token from zero (partial mode, as a worker's
    store does); combine_exact goes on from those sums with the other holder's rows: eager's bits."""
    generator = torch.Generator().manual_seed(tokens)
    E, k, d, split = 16, 4, 32, 6  # experts below `split` on the first holder
    index = torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(tokens)])  # [T, k]
    index[0] = torch.tensor([0, 1, 2, 3])  # a token wholly on the first holder
    hidden = torch.randn(tokens, d, generator=generator)
    per_expert = {}
    for expert in torch.unique(index).tolist():
        n = int((index == expert).sum())
        rows = torch.randn(n, d, generator=generator) * 10.0 ** torch.randint(-3, 4, (n, 1), generator=generator)
        rows[rows.abs() < 0.05] = -0.0
        per_expert[expert] = rows
    want = _index_add_reference(hidden, index, per_expert)
    low = torch.where(index < split, index, -1)  # [T, k]: the first holder's slots
    tokens_low = torch.nonzero((low >= 0).any(dim=1)).flatten()  # [T_w]
    summed = _index_add_reference(hidden, low, {e: r for e, r in per_expert.items() if e < split})[tokens_low]
    rest = {e: r for e, r in per_expert.items() if e >= split}
    got = combine_exact(hidden, index, rest, [(tokens_low, summed)])
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("tokens", [1, 5])
def test_one_holders_sums_of_every_token_are_added_to_zero(tokens):
    """One holder summed every token (partial mode): the result is 0 + its sums, bit for bit, so a
    -0.0 it sent becomes +0.0 as in eager's index_add_ into zeros; NaN and inf pass through."""
    sums = torch.randn(tokens, 8)
    sums[0, :3] = torch.tensor([-0.0, float("nan"), float("-inf")])
    index = torch.arange(tokens * 2).view(tokens, 2)
    got = combine_exact(torch.zeros(tokens, 8), index, {}, [(torch.arange(tokens), sums)])
    want = torch.zeros(tokens, 8).index_add_(0, torch.arange(tokens), sums)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got.view(torch.int32)[0, 0] == 0 and sums.view(torch.int32)[0, 0] != 0  # the zero's sign was +
    assert got.data_ptr() != sums.data_ptr()  # a new tensor: the reply's buffer is not handed on


@pytest.mark.parametrize("rows", [1, 9, 64, 65])
def test_a_workers_partial_adds_are_index_adds(rows):
    """A worker's PARTIAL answer from per-pair rows (worker/store.py `_by_token`: numpy's add.at for
    a few rows, index_add_ beyond): the bits of index_add_ into zeros, rows added in order."""
    generator = torch.Generator().manual_seed(rows)
    tokens = 3
    outputs = torch.randn(rows, 16, generator=generator) * 10.0 ** torch.randint(-6, 6, (rows, 1), generator=generator)
    outputs[outputs.abs() < 1e-3] = -0.0
    token_ids = torch.randint(0, tokens, (rows,), generator=generator)
    got = _by_token(outputs, token_ids.numpy(), tokens)
    want = torch.zeros(tokens, 16).index_add_(0, token_ids, outputs)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("first_sum", [False, True])
def test_a_decode_tokens_exact_rows_go_in_as_they_came(first_sum):
    """combine_token: each exact holder's rows (its experts ascending, a repeated expert's two rows in
    order) added into the token in one call per holder, with or without a first holder's sum, has the
    bits of combine_exact's per-expert adds, -0.0 and inf included; holders whose experts interleave
    are left to combine_exact (None)."""
    torch.manual_seed(3)
    index = torch.tensor([[1, 4, 9, 9, 12, 20]])  # expert 9 twice: a hash-routed row
    hidden = torch.zeros(1, 16)
    sums = [(torch.tensor([0]), torch.randn(1, 16))] if first_sum else []
    b_experts, c_experts = [4, 9], [12, 20]
    b_rows, c_rows = torch.randn(3, 16), torch.randn(2, 16)  # [n, d]: expert 9 has two rows
    b_rows[0, 0], c_rows[1, 1] = -0.0, float("inf")
    per_expert = {4: b_rows[0:1], 9: b_rows[1:3], 12: c_rows[0:1], 20: c_rows[1:2]}
    if not first_sum:
        per_expert[1] = torch.randn(1, 16)
        b_experts, b_rows = [1] + b_experts, torch.cat([per_expert[1], b_rows])
    want = combine_exact(hidden, index, per_expert, sums)
    got = combine_token(hidden, sums, [(c_experts, c_rows), (b_experts, b_rows)])  # any holder order
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert combine_token(hidden, sums, [([4, 20], c_rows), ([9, 12], b_rows[1:])]) is None
