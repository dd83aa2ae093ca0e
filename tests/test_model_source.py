"""One model source (HF directory or GGUF file) and workers holding any set of experts, in process.

Two ExpertStores holding complementary, non-contiguous expert sets, driven with DISPATCH
messages built from a real forward's routing and combined as the backbone combines, equal the
local eager experts module bit for bit; loaders read exactly the requested experts' rows.
"""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from moeswarm.commands import worker as worker_command
from moeswarm.dispatch.combine import combine_exact, combine_partial
from moeswarm.errors import ModelError, ProtocolError
from moeswarm.ids import format_ids, parse_experts
from moeswarm.sources.hf_directory import Checkpoint
from moeswarm.model.experts import experts_modules
from moeswarm.sources.loading import load_backbone, load_experts, load_local
from moeswarm.sources.source import open_source
from moeswarm.gguf.gguf_slice import write_slice
from moeswarm.sources.gguf_source import GGUFCheckpoint
from moeswarm.wire.config import CombineMode
from moeswarm.wire.messages import Dispatch
from moeswarm.worker.store import ExpertStore

SETS = ([0, 1, 2, 5], [3, 4, 6, 7])  # two workers, each holding a non-contiguous set
TOKENS = torch.arange(5, 45).unsqueeze(0)  # [1, 40]


def _routed_calls(model) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{layer: (hidden [T, d], top_k_index [T, k], top_k_weights [T, k])} as the model's forward calls its experts."""
    calls, handles = {}, []
    for layer, (_, module) in experts_modules(model).items():
        def hook(_module, args, kwargs, layer=layer):
            values = list(args) + [kwargs[name] for name in ("hidden_states", "top_k_index", "top_k_weights")[len(args):]]
            calls[layer] = tuple(value.detach().clone() for value in values)
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(TOKENS)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _dispatch(layer: int, hidden, index, weights, held: list[int], mode: CombineMode):
    """What a backbone sends a worker holding `held`: its tokens, other workers' experts as -1."""
    mine = torch.isin(index, torch.tensor(held))  # [T, k]
    tokens = mine.any(dim=1).nonzero().squeeze(1)  # [T_w]
    ids = torch.where(mine, index, torch.full_like(index, -1))[tokens]  # [T_w, k]
    return tokens, Dispatch(layer, hidden[tokens], ids, weights[tokens], mode)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss", "mixtral"])
def test_non_contiguous_stores_equal_local_eager(family, tiny_models):
    path = tiny_models(family)
    local = load_local(path)
    stores = []
    for held in SETS:
        hosted, source, num_experts = load_experts(path, held)
        assert num_experts == 8 and {h.experts for h in hosted.values()} == {tuple(held)}
        stores.append(ExpertStore(hosted, num_experts, source.config.hidden_size))
    assert stores[0].describe() == f"layers {format_ids(sorted(hosted))}, experts 0-2,5"
    modules = experts_modules(local)
    calls = _routed_calls(local)
    assert sorted(calls) == sorted(modules)
    routed = set(torch.cat([index.flatten() for _, index, _ in calls.values()]).tolist())
    assert routed == set(range(8)), "the forward should route to every expert"
    for layer, (hidden, index, weights) in calls.items():
        with torch.no_grad():
            expected = modules[layer][1](hidden, index, weights)  # [T, d]
        per_expert, partials = {}, []
        for held, store in zip(SETS, stores):
            _, request = _dispatch(layer, hidden, index, weights, held, CombineMode.EXACT)
            result = store.run(request)
            assert result.experts == sorted(set(index[torch.isin(index, torch.tensor(held))].tolist()))
            for expert, block in zip(result.experts, torch.split(result.outputs, result.counts)):
                per_expert[expert] = block
            tokens, request = _dispatch(layer, hidden, index, weights, held, CombineMode.PARTIAL)
            result = store.run(request)
            assert result.mode == CombineMode.PARTIAL and result.outputs.shape == (len(tokens), hidden.shape[1])
            partials.append((tokens, result.outputs))
        assert torch.equal(combine_exact(hidden, index, per_expert), expected), f"{family} layer {layer}: exact"
        # top-2: each token's sum has two terms, so adding per worker then across workers is eager's sum
        assert torch.equal(combine_partial(hidden, partials), expected), f"{family} layer {layer}: partial"


def test_hf_experts_are_the_hosted_rows(qwen2_moe):
    local = experts_modules(load_local(qwen2_moe))
    hosted, source, _ = load_experts(qwen2_moe, [1, 2, 6], layers=(1, 2))
    assert isinstance(source, Checkpoint) and source.kind == "hf" and sorted(hosted) == [1, 2]
    rows = torch.tensor([1, 2, 6])
    for layer, h in hosted.items():
        assert h.layer == layer and h.experts == (1, 2, 6) and h.module.num_experts == 3
        for name, param in h.module.named_parameters():
            assert torch.equal(param, getattr(local[layer][1], name)[rows]), f"layer {layer} {name}"


def test_store_refuses_an_expert_it_does_not_hold(qwen2_moe):
    hosted, source, num_experts = load_experts(qwen2_moe, SETS[0])
    store = ExpertStore(hosted, num_experts, source.config.hidden_size)
    assert store.held == {layer: (0, 1, 2, 5) for layer in hosted}
    layer = min(hosted)
    hidden = torch.zeros(2, source.config.hidden_size)
    request = Dispatch(layer, hidden, torch.tensor([[0, 3], [5, -1]]), torch.ones(2, 2))
    message = f"expert 3 of layer {layer} is not held by this worker (it holds experts 0-2,5)"
    with pytest.raises(ProtocolError, match=f"^{re.escape(message)}$"):
        store.run(request)


def test_load_experts_refuses_bad_sets(qwen2_moe):
    with pytest.raises(ModelError, match=r"^experts 7-8 out of range: the model has experts 0-7$"):
        load_experts(qwen2_moe, [7, 8])
    with pytest.raises(ModelError, match=r"^experts must be a non-empty list of distinct ascending ids, got \[2, 1\]$"):
        load_experts(qwen2_moe, [2, 1])
    with pytest.raises(ModelError, match=r"no MoE layer in range 5-9: the model's MoE layers are 0-2$"):
        load_experts(qwen2_moe, [0], layers=(5, 9))


# -- open_source ----------------------------------------------------------------------------------

HIDDEN, EXPERTS, FF = 32, 4, 32


def _write_gguf(path) -> str:
    """A minimal two-layer qwen2moe-shaped GGUF written with gguf-py (random F32 expert weights)."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "qwen2moe")
    for key, value in {"block_count": 2, "embedding_length": HIDDEN, "feed_forward_length": FF, "attention.head_count": 4,
                       "attention.head_count_kv": 2, "expert_count": EXPERTS, "expert_used_count": 2,
                       "expert_feed_forward_length": FF, "context_length": 64}.items():
        writer.add_uint32(f"qwen2moe.{key}", value)
    writer.add_tensor("token_embd.weight", rng.standard_normal((50, HIDDEN)).astype(np.float32))
    for layer in range(2):
        for role, shape in (("gate", (EXPERTS, FF, HIDDEN)), ("up", (EXPERTS, FF, HIDDEN)), ("down", (EXPERTS, HIDDEN, FF))):
            writer.add_tensor(f"blk.{layer}.ffn_{role}_exps.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_open_source_picks_the_kind(qwen2_moe, tmp_path):
    hf = open_source(qwen2_moe)
    assert isinstance(hf, Checkpoint) and hf.kind == "hf" and hf.config.model_type == "qwen2_moe"
    assert hf.held_layers is None and hf.held_experts is None
    gguf = open_source(_write_gguf(tmp_path / "model.GGUF"))
    assert isinstance(gguf, GGUFCheckpoint) and gguf.kind == "gguf" and gguf.config.model_type == "qwen2_moe"
    assert gguf.held_layers is None and gguf.held_experts is None and gguf.fingerprint.startswith("gguf-")
    model, source = load_backbone(hf)  # a source is accepted wherever a path is
    assert source is hf and not any(p.is_meta for n, p in model.named_parameters() if "experts" not in n)


def test_open_source_names_what_is_wrong(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelError, match=f"^{re.escape(str(missing))}: not a model directory \\(nothing at that path\\)$"):
        open_source(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match=f"^{re.escape(str(empty))}: no config.json$"):
        open_source(empty)
    with pytest.raises(ModelError, match=f"^{re.escape(str(tmp_path / 'gone.gguf'))}: no such GGUF file$"):
        open_source(tmp_path / "gone.gguf")


def test_gguf_experts_any_set_and_slice_files(tmp_path):
    full = _write_gguf(tmp_path / "full.gguf")
    everything, _, _ = load_experts(full)
    assert {layer: h.experts for layer, h in everything.items()} == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}
    some, _, num_experts = load_experts(full, [0, 2, 3], layers=(1, 1))
    assert num_experts == EXPERTS and sorted(some) == [1] and some[1].experts == (0, 2, 3)
    for name, param in some[1].module.named_parameters():
        assert torch.equal(param, getattr(everything[1].module, name)[[0, 2, 3]]), name

    part = tmp_path / "part.gguf"
    write_slice(full, part, [0, 3], layers=(1, 1))
    source = open_source(part)
    assert source.held_experts == (0, 3) and source.held_layers == frozenset({1})
    assert source.fingerprint == open_source(full).fingerprint
    sliced, _, _ = load_experts(source)  # what the slice file holds
    assert sorted(sliced) == [1] and sliced[1].experts == (0, 3)
    for name, param in sliced[1].module.named_parameters():
        assert torch.equal(param, getattr(everything[1].module, name)[[0, 3]]), name
    with pytest.raises(ModelError, match=r"part\.gguf: this slice file holds experts 0,3, not the requested experts 1-2 "
                                         r"\(requested 0-3\)$"):
        load_experts(source, [0, 1, 2, 3])
    with pytest.raises(ModelError, match=r"part\.gguf: this slice file holds the experts of MoE layers 1, "
                                         r"not of the requested layers 0$"):
        load_experts(source, [0], layers=(0, 1))


# -- parse_experts --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, ids", [
    ("0-3,9,17-20", [0, 1, 2, 3, 9, 17, 18, 19, 20]),
    ("5", [5]),
    (" 1, 3-4 ", [1, 3, 4]),
    ("2-2,4", [2, 4]),
])
def test_parse_experts(text, ids):
    assert parse_experts(text) == ids
    assert parse_experts(format_ids(ids)) == ids


@pytest.mark.parametrize("text, message", [
    ("", "bad expert list '': '' is not an expert id or an A-B range (expected e.g. 0-3,9,17-20)"),
    ("0-3,x", "bad expert list '0-3,x': 'x' is not an expert id or an A-B range (expected e.g. 0-3,9,17-20)"),
    ("-1", "bad expert list '-1': '-1' is not an expert id or an A-B range (expected e.g. 0-3,9,17-20)"),
    ("1,,2", "bad expert list '1,,2': '' is not an expert id or an A-B range (expected e.g. 0-3,9,17-20)"),
    ("5-2", "bad experts range '5-2' in '5-2': expected A-B with A <= B"),
    ("0-3,2", "bad expert list '0-3,2': '2' does not come after expert 3 (list experts in ascending order, each once)"),
    ("4,4", "bad expert list '4,4': '4' does not come after expert 4 (list experts in ascending order, each once)"),
    ("0-70000", "bad expert list '0-70000': '0-70000' goes past the largest expert id 65535"),
])
def test_parse_experts_names_the_bad_part(text, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_experts(text)


def test_worker_experts_flag_is_optional():
    parser = argparse.ArgumentParser()
    worker_command.add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).experts is None
    assert parser.parse_args(["--model", "m", "--experts", "0-1,5"]).experts == [0, 1, 5]
