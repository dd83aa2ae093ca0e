"""A GGUF file's F32 matrices (the routers) give each token the same bits in any batch.

torch's one-row and many-row products associate differently; a router's logits in a batched step
then differ in the last bits from the same token's alone, and a greedy request served next to
others can pick another token (measured at OLMoE's real dimensions: 6 of 16 requests differed
before, 0 after). kernels/row_invariant.py routes those products through qkernels' float path.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeswarm.engine.generate import generate
from moeswarm.generation.sampling import SamplingParams
from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.engine.engine import Engine, EngineConfig
from moeswarm.engine.job import Delta, Job
from moeswarm.engine.whole_model import WholeModel
from moeswarm.swarm import open_swarm
from moeswarm.kernels import qkernels
from moeswarm.kernels.row_invariant import RowInvariantWeight, make_rows_invariant

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")


def _marked(out_features: int, in_features: int) -> torch.nn.Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features)
    assert make_rows_invariant(linear) == ["weight"]
    return linear


def _rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("rows", [2, 16, 64])
def test_a_marked_products_rows_have_their_bits_alone_on_any_thread_count(rows):
    linear = _marked(64, 2048)  # a router's shape: 64 experts over hidden 2048
    x = torch.randn(rows, 2048)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = linear(x)
        torch.set_num_threads(1)
        one_thread = linear(x)
    finally:
        torch.set_num_threads(before)
    assert type(batched) is torch.Tensor
    assert torch.equal(batched, _rows_alone(linear, x))
    assert torch.equal(batched, one_thread)
    assert torch.equal(F.linear(x, linear.weight), _rows_alone(lambda r: F.linear(r, linear.weight), x))
    plain = F.linear(x, linear.weight.detach().as_subclass(torch.Tensor), linear.bias)
    assert torch.allclose(batched, plain, atol=1e-4, rtol=1e-5)  # the same product, other association


def test_every_other_use_is_torchs_and_gives_plain_tensors():
    linear = _marked(8, 32)
    weight = linear.weight
    assert isinstance(weight, torch.nn.Parameter) and isinstance(weight, RowInvariantWeight)
    assert not weight.requires_grad
    doubled, transposed = weight * 2, weight.T
    assert type(doubled) is torch.Tensor and type(transposed) is torch.Tensor
    assert torch.equal(doubled, weight.detach().as_subclass(torch.Tensor) * 2)
    x = torch.randn(3, 32)
    assert torch.equal(linear(x[None])[0], linear(x))  # any leading shape


def test_marking_keeps_tied_matrices_tied_and_leaves_embeddings_alone():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(16, 8), "head": torch.nn.Linear(8, 16, bias=False),
                                 "low": torch.nn.Linear(8, 4).to(torch.float16)})
    model["head"].weight = model["embed"].weight
    assert make_rows_invariant(model) == ["head.weight"]
    assert type(model["embed"].weight) is torch.nn.Parameter  # looked up, never a product
    assert model["head"].weight.data_ptr() == model["embed"].weight.data_ptr()  # the same memory
    assert type(model["low"].weight) is torch.nn.Parameter  # only float32 matrices


def test_a_gguf_models_moe_layers_give_each_token_its_bits_alone(qwen3_q4_k_m):
    model = load_local(qwen3_q4_k_m)
    block = model.model.layers[0].mlp
    assert isinstance(block.gate.weight, RowInvariantWeight)
    x = torch.randn(1, 16, model.config.hidden_size)
    with torch.no_grad():
        batched = block(x)
        alone = torch.cat([block(x[:, i : i + 1]) for i in range(16)], dim=1)
    assert torch.equal(batched, alone)


def test_greedy_requests_batched_on_the_engine_equal_each_alone(qwen3_q4_k_m):
    prompts = [[5 + 7 * i + j for j in range(6 + 3 * i)] for i in range(4)]
    reference = load_local(qwen3_q4_k_m)
    alone = [generate(WholeModel(reference), prompt, 10).tokens for prompt in prompts]
    got, finished = [[] for _ in prompts], threading.Semaphore(0)

    def emit_for(i: int):
        def emit(event) -> None:
            if isinstance(event, Delta):
                got[i] += event.tokens
            else:
                finished.release()
        return emit

    experts = reference.config.num_experts
    with open_swarm(qwen3_q4_k_m, [], local_experts=list(range(experts))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=64, speculate=0, prefill_chunk=8), reference=reference)
        engine.start()
        try:
            for i, prompt in enumerate(prompts):
                engine.submit(Job(prompt, 10, SamplingParams(), emit_for(i)))
            for _ in prompts:
                assert finished.acquire(timeout=120), "the engine did not finish every job"
        finally:
            engine.stop()
    assert got == alone
    assert engine.checked_rows > 0 and engine.mismatched_rows == 0


def _fixed_dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    """The float path's documented association in float32 (kernels/qk_vec.h, fixed_dot): lane k mod 16
    gets a[k] * b[k] in the order of k, then the lanes are added +8, +4, +2, +1."""
    products = (a.astype(np.float32) * b.astype(np.float32)).astype(np.float32)
    lanes = np.zeros(16, dtype=np.float32)
    for k, p in enumerate(products):
        lanes[k % 16] = np.float32(lanes[k % 16] + p)
    for width in (8, 4, 2, 1):
        lanes[:width] = (lanes[:width] + lanes[width : 2 * width]).astype(np.float32)
    return lanes[0]


@pytest.mark.parametrize("in_features,rows", [(2048, 1), (100, 3), (8, 2), (33, 4)])
def test_the_float_path_sums_in_its_documented_order(in_features, rows):
    # the bits of a router's product and of a norm's sum are pinned: any rewrite of the kernels keeps them
    torch.manual_seed(3)
    weight, x = torch.randn(7, in_features), torch.randn(rows, in_features)
    got = qkernels.matmul(0, weight.numpy().view(np.uint8), in_features, x, 2)  # F32 rows, 2 threads
    expected = torch.tensor([[_fixed_dot(weight[o].numpy(), x[t].numpy()) for o in range(7)] for t in range(rows)])
    assert torch.equal(got, expected)
    d = in_features
    norm_weight = torch.randn(d)
    normed = torch.empty(rows, d)
    qkernels.rms_norm(x, norm_weight, 1e-6, normed)
    for t in range(rows):
        row = x[t].numpy()
        scale = np.float32(1.0) / np.sqrt(np.float32(_fixed_dot(row, row) / np.float32(d)) + np.float32(1e-6))
        assert torch.equal(normed[t], torch.from_numpy(norm_weight.numpy() * (row * np.float32(scale))))
