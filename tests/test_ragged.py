"""Packed forwards (forward/packed.py): many sequences in one forward, each attending to its own cache.

Three properties: a sequence packed alone gives the very bits of an ordinary forward; a packed step
of several sequences (a prompt chunk, a decode token, alternative draft rows) through workers is
bit-identical to the same packed step on the local model; and packed beside others, a sequence's
logits stay those it has alone up to float rounding (the matrices see more rows), greedy choices
included.
"""

from __future__ import annotations

import pytest
import torch

from moeswarm.forward.packed import Item, PackedStepper, forward_packed, install, supports_ragged
from moeswarm.forward.sequence_cache import SequenceCache
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import local_swarm, split_experts
from moeswarm.sources.loading import load_local
from moeswarm.model.tiny import FAMILIES

# Families whose layers keep a state packing cannot hold: recurrent and linear-attention layers
# (Jamba, Qwen3-Next, ZAYA), DeepSeek V4's compressed attention; the engine runs them one forward
# per sequence. Multi-head latent attention (DeepSeek V2/V3) packs: its latents are cached, and
# its attention runs absorbed (forward/latent.py), whose sums differ from the expanded form's
# in the last places: alone, those families are close to an ordinary forward, not equal.
NOT_PACKED = {"deepseek_v4", "jamba", "qwen3_next", "zaya"}
ABSORBED = {"deepseek_v2", "deepseek_v3"}
PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5, 77]
OTHER = [5, 6, 7, 8, 9, 10]


def _step(model, caches: list[SequenceCache]) -> list[torch.Tensor]:
    """Prefill two sequences together, then one step of: a decode token, two draft rows, a prompt chunk."""
    first, second, third = caches
    forward_packed(model, [Item(first, PROMPT), Item(second, OTHER)])
    return forward_packed(model, [Item(first, [3, 4]), Item(second, [[1, 2, 3], [1, 9, 9]]), Item(third, PROMPT[:7])])


def _after(model, context: list[int], tokens: list[int]) -> torch.Tensor:
    stepper = Stepper(model)
    stepper.forward(context)
    return stepper.forward(tokens)  # [n, V]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_alone_is_an_ordinary_forward_and_together_stays_close(family, tiny_models):
    model = load_local(tiny_models(family))
    assert supports_ragged(model) == (family not in NOT_PACKED)
    if family in NOT_PACKED:
        return
    plain = Stepper(model)
    expected = [plain.forward(PROMPT), plain.forward([3, 4]), None, torch.stack([_after(model, OTHER, row) for row in ([1, 2, 3], [1, 9, 9])])]
    install(model)
    alone = PackedStepper(model)
    for got, want in [(alone.forward(PROMPT), expected[0]), (alone.forward([3, 4]), expected[1])]:
        if family in ABSORBED:
            assert torch.allclose(got, want, atol=1e-5, rtol=0) and torch.equal(got.argmax(-1), want.argmax(-1))
        else:
            assert torch.equal(got, want)
    caches = [SequenceCache() for _ in range(3)]
    together = _step(model, caches)
    for got, want in [(together[0], expected[1]), (together[1], expected[3])]:
        assert torch.allclose(got, want, atol=1e-4, rtol=0), f"{family}: {(got - want).abs().max()}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert [cache.length for cache in caches] == [len(PROMPT) + 2, len(OTHER), 7]
    assert caches[1].rows == 2
    caches[1].keep_row(1)
    assert caches[1].length == len(OTHER) + 3 and not caches[1].pending


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_a_packed_step_through_workers_equals_the_same_step_locally(family, tiny_models):
    path = tiny_models(family)
    local = load_local(path)
    install(local)
    expected = _step(local, [SequenceCache() for _ in range(3)])
    with local_swarm(path, split_experts(8, 2)) as swarm:
        install(swarm.model)
        swarm.reset_accounting()
        got = _step(swarm.model, [SequenceCache() for _ in range(3)])
        calls = swarm.layer_calls()
    for remote, reference in zip(got, expected):
        assert torch.equal(remote, reference)
    assert len(calls) == 2 * len(swarm.moe_layers)  # one layer call per MoE layer per packed forward
    assert calls[-1].tokens == 2 + 2 * 3 + 7


def test_a_cache_grows_in_place_and_crops():
    cache = SequenceCache()
    keys = torch.arange(2 * 20 * 3, dtype=torch.float32).reshape(1, 2, 20, 3)
    for start in range(0, 20, 5):
        cache.append(0, keys[:, :, start : start + 5], -keys[:, :, start : start + 5], None)
    k, v = cache.view(0, None)
    assert torch.equal(k, keys) and torch.equal(v, -keys) and cache.length == 20
    cache.crop(12)
    assert torch.equal(cache.view(0, None)[0], keys[:, :, :12])
    cache.append(0, keys[:, :, :2], keys[:, :, :2], 1)
    with pytest.raises(ValueError, match="keep one row first"):
        cache.crop(5)
    cache.keep_row(1)
    assert cache.length == 14 and torch.equal(cache.view(0, None)[0][:, :, 12:], keys[:, :, :2])
