"""A GGUF backbone's RMSNorms, rotary embeddings and rotary tables in one C call each
(kernels/row_ops.py).

The rotary embedding must give transformers' bits exactly (it is swapped process-wide); the norm
gives each row the same bits in any batch, close to transformers' own; the rotary tables give each
position the bits of its exact values rounded once, whatever the batch or torch's threads; only the
plain (Llama-copied) forms are replaced; and a swarm over a GGUF file stays bit-identical to its local reference.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.llama import modeling_llama as llama

from moeswarm.sources.loading import load_local
from moeswarm.kernels import qkernels
from moeswarm.kernels.row_ops import (RowRMSNorm, RowRotaryEmbedding, _rope_pair, _same_code, use_rotary_tables,
                                      use_row_ops)

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")


@pytest.mark.parametrize("B, H, T, D", [(1, 16, 1, 128), (1, 16, 7, 128), (2, 4, 5, 64), (1, 3, 2, 6)])
def test_rope_gives_transformers_bits(B, H, T, D):
    generator = torch.Generator().manual_seed(B * 1000 + T)
    q = (torch.randn(B, T, H, D, generator=generator) * 10).transpose(1, 2)  # [B, H, T, D] as attention makes it
    k = torch.randn(B, H, T, D, generator=generator)
    cos, sin = torch.randn(2, B, T, D, generator=generator)  # [B, T, D] each
    q[0, 0, 0, 0] = float("inf")  # special values pass through the same operations
    fast = _rope_pair(llama.apply_rotary_pos_emb)
    for got, want in zip(fast(q, k, cos, sin), llama.apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)
        assert got.shape == want.shape


def test_rope_leaves_other_shapes_to_the_original():
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return q, k

    fast = _rope_pair(original)
    q = torch.randn(1, 4, 3, 8)
    fast(q, q, torch.randn(1, 3, 8), torch.randn(1, 3, 8), unsqueeze_dim=2)  # another layout
    fast(q, q, torch.randn(1, 3, 4), torch.randn(1, 3, 4))  # partial rotary: cos covers half the head
    fast(q.double(), q.double(), torch.randn(1, 3, 8).double(), torch.randn(1, 3, 8).double())
    assert calls == [2, 1, 1]


@pytest.mark.parametrize("d", [2048, 128, 100])
def test_norm_rows_have_their_bits_alone_and_are_close_to_transformers(d):
    torch.manual_seed(d)
    reference = llama.LlamaRMSNorm(d, eps=1e-6)
    reference.weight.data = torch.randn(d)
    norm = RowRMSNorm(reference.weight.detach(), 1e-6)
    x = torch.randn(3, 5, d) * torch.logspace(-4, 4, 5)[:, None]  # rows of very different scales
    batched = norm(x)  # [3, 5, d]
    alone = torch.stack([torch.stack([norm(x[i, j]) for j in range(5)]) for i in range(3)])
    assert torch.equal(batched, alone)
    assert torch.equal(norm(x.transpose(0, 1)), batched.transpose(0, 1))  # strided rows: the same bits
    assert torch.allclose(batched, reference(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="float32 rows of"):
        norm(x.double())


def _llama_rotary(rope_parameters: dict) -> llama.LlamaRotaryEmbedding:
    config = llama.LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=4096,
                               rope_parameters={"rope_theta": 10000.0, **rope_parameters})
    return llama.LlamaRotaryEmbedding(config)


def test_rotary_tables_are_each_positions_own_rounded_values():
    module = _llama_rotary({"rope_type": "default"})  # 64 pairs, as OLMoE's heads of 128
    table = RowRotaryEmbedding(module)
    assert table.config is module.config  # what a family's code reads besides the forward
    positions = torch.tensor([list(range(52)), list(range(3000, 3052))])  # [2, 52]
    x = torch.zeros(2, 52, 8)
    cos, sin = table(x, positions)  # [2, 52, 128] each
    angles = positions[..., None].float() * module.inv_freq  # float32, as transformers forms them
    exact = torch.cat((angles, angles), dim=-1).double()
    assert torch.equal(cos, exact.cos().float()) and torch.equal(sin, exact.sin().float())
    want_cos, want_sin = module(x, positions)  # torch's cos and sin: within a few units in the last place
    assert torch.allclose(cos, want_cos, rtol=0, atol=1e-6) and torch.allclose(sin, want_sin, rtol=0, atol=1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [table(x[i:i + 1, j:j + 1], positions[i:i + 1, j:j + 1]) for i in range(2) for j in (0, 26, 51)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(c[0, 0], cos[i, j]) and torch.equal(s[0, 0], sin[i, j])
               for (c, s), (i, j) in zip(alone, [(i, j) for i in range(2) for j in (0, 26, 51)]))
    half_cos, _ = table(x.bfloat16(), positions.int())  # other integer positions; the hidden states' dtype
    assert half_cos.dtype is torch.bfloat16 and torch.equal(half_cos, cos.bfloat16())
    with pytest.raises(ValueError, match="integer positions"):
        table(x, positions.float())


def test_only_plain_rotary_modules_get_tables():
    model = torch.nn.ModuleDict({
        "plain": _llama_rotary({"rope_type": "default"}),
        "scaled": _llama_rotary({"rope_type": "linear", "factor": 2.0}),  # frequencies fixed at load
        "dynamic": _llama_rotary({"rope_type": "dynamic", "factor": 2.0}),  # recomputed by the forward
    })
    replaced = use_rotary_tables(model)
    assert replaced == ["plain", "scaled"]
    assert type(model["scaled"]) is RowRotaryEmbedding and type(model["dynamic"]) is llama.LlamaRotaryEmbedding
    positions = torch.arange(7)[None]
    cos, _ = model["scaled"](torch.zeros(1, 7, 4), positions)
    want, _ = _llama_rotary({"rope_type": "linear", "factor": 2.0})(torch.zeros(1, 7, 4), positions)
    assert torch.allclose(cos, want, rtol=0, atol=1e-6) and not torch.equal(cos, model["plain"](torch.zeros(1, 7, 4), positions)[0])


def test_only_the_plain_forms_are_recognised():
    assert _same_code(llama.LlamaRMSNorm.forward, llama.LlamaRMSNorm.forward)

    class Shifted(llama.LlamaRMSNorm):  # Gemma's form: (1 + w)
        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return (1 + self.weight) * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    class Plain(torch.nn.Module):  # a verbatim copy under another name, as the families make them
        def __init__(self, hidden_size):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = 1e-6

        forward = types.FunctionType(llama.LlamaRMSNorm.forward.__code__, llama.__dict__)

    model = torch.nn.Sequential(Shifted(8), Plain(8), llama.LlamaRMSNorm(8))
    replaced = use_row_ops(model)
    assert replaced == ["1", "2"]
    assert type(model[0]) is Shifted and type(model[1]) is RowRMSNorm and type(model[2]) is RowRMSNorm
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "1.weight", "2.weight"]


def test_a_gguf_backbone_uses_them_and_its_swarm_stays_bit_identical(qwen3_q4_k_m):
    from moeswarm.forward.stepper import Stepper
    from moeswarm.swarm import open_swarm
    from moeswarm.local.workers import local_workers, split_experts

    path = qwen3_q4_k_m
    reference = load_local(path)
    norms = [name for name, module in reference.named_modules() if isinstance(module, RowRMSNorm)]
    layers = reference.config.num_hidden_layers
    assert len(norms) == 4 * layers + 1  # input, post-attention, q and k per layer; the final norm
    assert isinstance(reference.model.rotary_emb, RowRotaryEmbedding)
    family = __import__(type(reference).__module__, fromlist=["apply_rotary_pos_emb"])
    assert hasattr(family.apply_rotary_pos_emb, "original")
    local = Stepper(reference)
    with local_workers(path, split_experts(reference.config.num_experts, 2)) as addresses:
        with open_swarm(path, addresses) as swarm:
            remote = Stepper(swarm.model)
            feed = list(range(5, 25))
            for step in range(3):
                remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                assert torch.equal(remote_logits, local_logits), f"logits differ at step {step}"
                feed = [int(remote_logits[-1].argmax())]


def test_every_model_built_here_takes_its_tables_from_c():
    from pathlib import Path

    from moeswarm.sources.loading import load_backbone

    hf = Path(__file__).resolve().parents[1] / "models" / "pymoe" / "hf"  # a directory, as transformers loads it
    reference = load_local(hf)
    backbone, _ = load_backbone(hf)
    assert type(reference.model.rotary_emb) is RowRotaryEmbedding and type(backbone.model.rotary_emb) is RowRotaryEmbedding
    positions = torch.arange(80)[None]  # 80 positions x 32 values: more than torch splits between its threads
    x = torch.zeros(1, 80, 4)
    want = qkernels.rope_table(positions, reference.model.rotary_emb.inv_freq, 1.0)
    for model in (reference, backbone):
        cos, sin = model.model.rotary_emb(x, positions)
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
