"""Routing statistics: the counts and pair counts are the routing's, a profile file round-trips,
`moeswarm profile` writes what a direct count of the router's choices gives, and a malformed
profile is refused in one line naming the field."""

from __future__ import annotations

import json
import pytest
import torch

from moeswarm.cli import main
from moeswarm.errors import MoeSwarmError
from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_local
from moeswarm.sources.source import open_source
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.placement.profile import RoutingStats, hot_sets, read_profile


def test_counts_and_pairs_of_a_known_routing():
    stats = RoutingStats(4)
    stats.update(3, torch.tensor([[0, 2], [2, 1], [2, 0]]))
    stats.update(3, torch.tensor([[3, -1]]))  # a slot marked -1 is not counted; the row is
    assert stats.tokens == {3: 4}
    assert stats.counts[3].tolist() == [2, 1, 3, 1]
    assert stats.pairs[3].tolist() == [[2, 0, 2, 0], [0, 1, 1, 0], [2, 1, 3, 0], [0, 0, 0, 1]]
    data = json.loads(json.dumps(stats.to_json()))
    assert data["pairs"] == {"3": [[0, 2, 2], [1, 2, 1]]}
    again = RoutingStats.from_json(data)
    assert torch.equal(again.pairs[3], stats.pairs[3]) and torch.equal(again.counts[3], stats.counts[3])
    assert hot_sets(stats, [3], 2) == {3: (0, 2)}  # counts 3 (expert 2), then 2 (expert 0)
    assert stats.summary()["layers"]["3"]["top_pairs"] == [[0, 2, 2], [1, 2, 1]]


def test_the_hottest_experts_carry_the_most_routing_weight():
    """Expert 0 is chosen most, always with little weight; 1 and 3 carry the mass. A profile without
    mass (an older file) still ranks by counts."""
    stats = RoutingStats(4)
    stats.update(0, torch.tensor([[0, 1], [0, 3], [0, 2], [1, 3]]),
                 torch.tensor([[0.1, 0.9], [0.2, 0.8], [0.1, 0.3], [0.6, 0.4]]))
    assert stats.counts[0].tolist() == [3, 2, 1, 2]
    assert torch.allclose(stats.mass[0], torch.tensor([0.4, 1.5, 0.3, 1.2], dtype=torch.float64))
    assert hot_sets(stats, [0], 2) == {0: (1, 3)}
    data = json.loads(json.dumps(stats.to_json()))
    assert hot_sets(RoutingStats.from_json(data), [0], 2) == {0: (1, 3)}
    del data["mass"]
    assert hot_sets(RoutingStats.from_json(data), [0], 2) == {0: (0, 1)}  # counts 3, then 2 (the lower id of 1 and 3)


@pytest.mark.parametrize("change, message", [
    ({"format": "x"}, 'not a routing profile (no "format": "moeswarm-routing-profile")'),
    ({"num_experts": -1}, "bad num_experts -1"),
    ({"counts": {"0": [1, 2]}}, "counts of layer 0 must be 4 non-negative integers"),
    ({"pairs": {"0": [[2, 1, 5]]}}, "pairs of layer 0 must be [i, j, n] with 0 <= i < j < 4"),
    ({"tokens": {}}, '"tokens" must have one entry per layer of "layers"'),
    ({"mass": {"0": [0.5, -1.0, 0.0, 0.0]}}, "mass of layer 0 must be 4 non-negative numbers"),
    ({"mass": {"1": [0.5, 1.0, 0.0, 0.0]}}, '"mass" must have one entry per layer of "layers"'),
])
def test_malformed_profiles_are_refused(tmp_path, change, message):
    good = {"format": "moeswarm-routing-profile", "version": 1, "num_experts": 4, "layers": [0],
            "tokens": {"0": 3}, "counts": {"0": [1, 2, 3, 0]}, "pairs": {"0": [[0, 1, 1]]}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**good, **change}))
    with pytest.raises(MoeSwarmError) as caught:
        read_profile(path)
    assert str(caught.value) == f"{path}: {message}"


def test_profile_command_counts_what_the_router_chose(qwen2_moe, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "x = [i * i for i in range(10)]"]
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", qwen2_moe, "--prompts", str(prompts), "--max-tokens", "12", "-o", str(out),
                 "--threads", "1", "--quiet"]) == 0
    profile = read_profile(out)

    model = load_local(qwen2_moe)  # a direct count: the routers' top-k, seen at their outputs
    codec = load_text_codec(qwen2_moe, model.config.vocab_size)
    chosen: dict[int, list[torch.Tensor]] = {}
    for index, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=index: chosen.setdefault(i, []).append(out[2]))
    for text in texts:
        Stepper(model).forward(codec.encode(text)[:12])
    assert profile.layers == sorted(chosen)
    for layer, parts in chosen.items():
        index = torch.cat(parts)  # [T, k]
        assert torch.equal(profile.counts[layer], torch.bincount(index.flatten(), minlength=8))
        pairs = torch.zeros(8, 8, dtype=torch.long)
        for row in index.tolist():
            for a in row:
                for b in row:
                    pairs[a, b] += 1
        assert torch.equal(profile.pairs[layer], pairs)
        assert profile.tokens[layer] == index.shape[0] == sum(min(12, len(codec.encode(t))) for t in texts)
    assert json.loads(out.read_text())["model"] == open_source(qwen2_moe).fingerprint


def test_counts_folded_in_inference_mode_stay_usable_outside_it_and_none_are_dropped():
    """The model's thread folds under torch.inference_mode; a reader outside it (the dashboard) must
    still fold and read, and every call's rows are counted once."""
    from moeswarm.placement.profile import PENDING_CALLS, RoutingStats

    stats, generator = RoutingStats(8), torch.Generator().manual_seed(0)
    rows = 0
    for calls in (PENDING_CALLS + 5, 37, PENDING_CALLS * 2 + 1):
        with torch.inference_mode():
            for call in range(calls):
                index = torch.randint(0, 8, (1 + call % 3, 2), generator=generator)
                stats.update(call % 4, index, torch.rand(index.shape, generator=generator))
                rows += index.shape[0]
        summary = stats.summary()  # outside inference mode: folds what is pending
        assert sum(layer["tokens"] for layer in summary["layers"].values()) == rows
        assert sum(int(c.sum()) for c in stats.counts.values()) == 2 * rows
        assert not any(t.is_inference() for table in (stats.counts, stats.pairs, stats.mass) for t in table.values())
