"""GGUF experts kept in their blocks: workers and the local reference compute from the same bytes.

The file is made by llama.cpp's converter and quantizer (Q4_K_M: Q4_K and Q6_K expert rows at
hidden 256). `generate --check-local` through real worker processes must stay bit-identical,
whatever experts a worker holds (non-contiguous sets) and however many threads it computes with
(the kernels' own determinism across threads, tokens and alignment: tests/test_quant_kernels.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from llamacpp_fixtures import make_fixture_ggufs
from moeswarm.errors import ModelError
from moeswarm.ids import LayerId
from moeswarm.model.hosted import HostedLayer
from moeswarm.wire.config import CombineMode
from moeswarm.wire.messages import Dispatch
from moeswarm.worker.store import ExpertStore
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import local_workers
from moeswarm.model.experts import experts_modules
from moeswarm.sources.loading import load_experts, load_local
from moeswarm.sources.source import open_source
from moeswarm.kernels import qk_library, qkernels
from moeswarm.swarm import open_swarm
from moeswarm.kernels.quant_experts import QuantExperts, QuantMatrix, quant_matrix
from moeswarm.kernels.quant_linear import QuantEmbedding, QuantLinear

TOKENS = [5, 18, 31, 44, 57, 70, 83, 96]

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    return str(make_fixture_ggufs("qwen2_moe", tmp_path_factory.mktemp("quant"), types=("Q4_K_M",))["Q4_K_M"])


def test_experts_stay_in_the_files_blocks(q4_k_m):
    hosted, source, num_experts = load_experts(q4_k_m, [1, 3, 4])
    module = hosted[0].module
    assert isinstance(module, QuantExperts) and module.num_experts == 3 and num_experts == 8
    assert {Q(module.gate.qtype), Q(module.down.qtype)} <= {Q.Q4_K, Q.Q6_K}
    stored = source.file.tensors["blk.0.ffn_gate_exps.weight"]
    assert all(np.shares_memory(m, source.file.header.data) for m in module.gate.experts), "views of the mapped file"
    assert module.gate.experts[1].tobytes() == np.asarray(stored.data[3]).tobytes()  # hosted expert 1 is expert 3
    assert module.nbytes == sum(int(np.asarray(source.file.tensors[f"blk.0.ffn_{r}_exps.weight"].data[:3]).nbytes)
                                for r in ("gate", "up", "down"))


def test_float32_path_on_request(q4_k_m):
    modules = experts_modules(load_local(open_source(q4_k_m, experts_dtype="f32")))
    assert not any(isinstance(m, QuantExperts) for _, m in modules.values())
    with pytest.raises(ModelError, match=r"^experts dtype 'int3': expected one of file, f32$"):
        open_source(q4_k_m, experts_dtype="int3")


def test_workers_equal_the_local_reference_bit_for_bit(q4_k_m):
    """What `generate --check-local` checks, through real worker processes (2 threads each, 1 here)."""
    local = Stepper(load_local(q4_k_m))
    assert all(isinstance(m, QuantExperts) for _, m in experts_modules(local.model).values())
    with local_workers(q4_k_m, [[0, 2, 5], [1, 3, 4, 6, 7]], extra_args=["--threads", "2"]) as addresses:
        with open_swarm(q4_k_m, addresses) as swarm:
            remote = Stepper(swarm.model)
            feed = TOKENS
            for step in range(4):
                remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                assert torch.equal(remote_logits, local_logits), f"logits differ at step {step}"
                feed = [int(remote_logits[-1].argmax())]


def test_backbone_keeps_the_files_encoding_unless_asked_for_float32(q4_k_m, monkeypatch):
    encoded = load_local(q4_k_m)
    plain = load_local(open_source(q4_k_m, backbone_dtype="f32"))
    attention = encoded.model.layers[0].self_attn
    assert isinstance(attention.q_proj, QuantLinear) and isinstance(encoded.model.embed_tokens, QuantEmbedding)
    assert type(plain.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    ids = torch.tensor([[5, 18, 31, 319]])
    assert torch.equal(encoded.model.embed_tokens(ids), plain.model.embed_tokens(ids))  # decoded rows: the same values
    x = torch.randn(3, attention.q_proj.in_features)
    q_proj = attention.q_proj
    assert q_proj.int8_activations  # a quantized type: int8 activations and integer dots, as llama.cpp does
    integer = qkernels.matmul(q_proj.qtype, q_proj.data, q_proj.in_features, x, 1, int8_activations=True)
    assert torch.equal(q_proj(x), integer + q_proj.bias if q_proj.bias is not None else integer)
    float_path = plain.model.layers[0].self_attn.q_proj(x)
    assert float((q_proj(x) - float_path).norm() / float_path.norm()) < 0.02  # the int8 rounding of x only
    logits = [Stepper(model).forward(TOKENS) for model in (encoded, plain)]
    cosine = torch.nn.functional.cosine_similarity(*logits, dim=-1)  # int8-rounded activations vs float ones
    assert float(cosine.mean()) > 0.998 and float(cosine.min()) > 0.99
    with pytest.raises(ModelError, match=r"^backbone dtype 'bf16': expected one of file, f32$"):
        open_source(q4_k_m, backbone_dtype="bf16")


def test_without_the_c_kernels_everything_is_float32(q4_k_m, monkeypatch):
    monkeypatch.setattr(qk_library, "_library", lambda: None)  # as when the extension was not built
    model = load_local(q4_k_m)
    assert not any(isinstance(m, QuantExperts) for _, m in experts_modules(model).values())
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def random_experts(activation: str, n: int = 5, H: int = 512, I: int = 256) -> QuantExperts:
    """n experts of Q4_K_M's types (gate, up Q4_K; down Q6_K), random blocks, gpt-oss biases when asked."""
    rng = np.random.default_rng(11)

    def matrix(qtype: Q, rows: int, row_length: int) -> QuantMatrix:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, rows, row_length // block, size), dtype=np.uint8)
        at = 0 if qtype == Q.Q4_K else 208  # the float16 scales (random bytes there would be NaN or huge)
        raw[..., at:at + 2] = (rng.random(raw.shape[:3]) * 0.02 + 0.001).astype(np.float16)[..., None].view(np.uint8)
        if qtype == Q.Q4_K:
            raw[..., 2:4] = (rng.random(raw.shape[:3]) * 0.02).astype(np.float16)[..., None].view(np.uint8)
        return quant_matrix([raw.reshape(n, rows, -1)], int(qtype), rows, row_length)

    biases = {}
    if activation == "gpt_oss":
        biases = {"gate_bias": torch.randn(n, I), "up_bias": torch.randn(n, I), "down_bias": torch.randn(n, H)}
    return QuantExperts(None, matrix(Q.Q4_K, I, H), matrix(Q.Q4_K, I, H), matrix(Q.Q6_K, H, I), activation, biases,
                        alpha=1.702, limit=7.0)


def eager_order(module: QuantExperts, hidden, top_k_index, top_k_weights):
    """The family's loop, one product at a time (what QuantExperts did before qk_experts)."""
    final = torch.zeros_like(hidden)
    for e in torch.unique(top_k_index[top_k_index >= 0]).tolist():
        slot, token = torch.where(top_k_index.T == e)
        x = hidden[token]
        gate = qkernels.matmul(module.gate.qtype, module.gate.experts[e], x.shape[1], x, 1, int8_activations=True)
        up = qkernels.matmul(module.up.qtype, module.up.experts[e], x.shape[1], x, 1, int8_activations=True)
        if module.activation == "silu":
            h = qkernels.silu_glu(gate, up)
        else:
            h = qkernels.oss_glu(gate + module.biases["gate_bias"][e], up + module.biases["up_bias"][e],
                                 module.alpha, module.limit)
        out = qkernels.matmul(module.down.qtype, module.down.experts[e], h.shape[1], h, 1, int8_activations=True)
        if "down_bias" in module.biases:
            out = out + module.biases["down_bias"][e]
        final.index_add_(0, token, (out * top_k_weights[token, slot, None]).to(final.dtype))
    return final


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
def test_one_call_per_layer_keeps_the_eager_order_and_bits(activation):
    """QuantExperts.forward (qk_experts: experts ascending, rows slot-major then token, weights, adds
    in turn) against the per-product loop: the same bits, for every routing shape a worker sends."""
    module = random_experts(activation)
    torch.manual_seed(0)
    for tokens, k in ((1, 3), (7, 2), (9, 1), (40, 4)):
        hidden = torch.randn(tokens, 512)
        index = torch.stack([torch.randperm(5)[:k] for _ in range(tokens)])
        index[0, -1] = -1  # a slot routed nowhere
        weights = torch.rand(tokens, k)
        expected = eager_order(module, hidden, index, weights)
        assert torch.equal(module(hidden, index, weights), expected)
        assert torch.equal(module(hidden, index.int(), weights.bfloat16()),
                           eager_order(module, hidden, index, weights.bfloat16()))
        part = module.narrow(2, 5)  # a worker's run of experts 2-4: ids local to it
        local = torch.where(index >= 2, index - 2, -1)
        assert torch.equal(part(hidden, local, weights), eager_order(part, hidden, local, weights))
        assert torch.equal(module(hidden, index, weights.double()), eager_order(module, hidden, index, weights.double()))
    with pytest.raises(ValueError, match=r"^expert id 5 out of range: this module holds experts 0-4$"):
        module(torch.randn(1, 512), torch.tensor([[5]]), torch.ones(1, 1))


def test_a_layers_experts_have_the_same_bits_on_any_thread_count():
    """qk_experts splits few-row layers by whole experts over threads (decode) and many-row ones by
    matrix rows (prefill): either way, every thread count gives the one-thread bits."""
    module = random_experts("silu", n=6)
    torch.manual_seed(3)
    for tokens, k in ((1, 4), (3, 2), (40, 3)):
        hidden = torch.randn(tokens, 512)
        index = torch.stack([torch.randperm(6)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k)
        alone = qkernels.experts(module._plan, hidden, index, weights, 1)
        for threads in (2, 3, 7):
            assert torch.equal(qkernels.experts(module._plan, hidden, index, weights, threads), alone)


def test_a_workers_partial_sums_have_the_bits_of_its_rows_added_in_eager_order():
    """A PARTIAL DISPATCH to a store of QuantExperts runs as one call over [T, k] (ids < 0 skipped);
    its sums equal the EXACT answer's rows (one per pair, experts ascending) added into zeros by
    index_add_ in order, for a store of every expert and for one of experts 2-4 (ids -1 elsewhere)."""
    module = random_experts("silu")
    torch.manual_seed(5)
    for held, tokens, k in (((0, 1, 2, 3, 4), 1, 3), ((0, 1, 2, 3, 4), 9, 2), ((2, 3, 4), 1, 3), ((2, 3, 4), 13, 3)):
        part = module.narrow(held[0], held[-1] + 1)
        store = ExpertStore({LayerId(0): HostedLayer(LayerId(0), held, part)}, num_experts=5, hidden_size=512)
        hidden, weights = torch.randn(tokens, 512), torch.rand(tokens, k)
        index = torch.stack([torch.randperm(5)[:k] for _ in range(tokens)])
        index = torch.where(index >= held[0], index, -1)  # the slots of experts held elsewhere
        index[0, 0] = held[-1]  # every token routes somewhere here
        exact = store.run(Dispatch(0, hidden, index, weights, CombineMode.EXACT))
        sums = store.run(Dispatch(0, hidden, index, weights, CombineMode.PARTIAL))
        token_of_row = torch.cat([torch.where(index.T == e)[1] for e in exact.experts])  # [S]: pairs' tokens, in row order
        assert torch.equal(sums.outputs, torch.zeros(tokens, 512).index_add_(0, token_of_row, exact.outputs))
        assert (sums.experts, sums.counts) == (exact.experts, exact.counts)
