"""A GGUF backbone's RMSNorms and rotary embeddings in one C call each (weights/row_ops.py).

The rotary embedding must give transformers' bits exactly (it is swapped process-wide); the norm
gives each row the same bits in any batch, close to transformers' own; only the plain (Llama-copied)
forms are replaced; and a swarm over a GGUF file stays bit-identical to its local reference.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.llama import modeling_llama as llama

from moeswarm.model.loading import load_local
from moeswarm.weights import qkernels
from moeswarm.weights.row_ops import RowRMSNorm, _rope_pair, _same_code, use_row_ops

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
    from moeswarm.generation.stepper import Stepper
    from moeswarm.swarm import open_swarm
    from moeswarm.tools.local_workers import local_workers, split_experts

    path = qwen3_q4_k_m
    reference = load_local(path)
    norms = [name for name, module in reference.named_modules() if isinstance(module, RowRMSNorm)]
    layers = reference.config.num_hidden_layers
    assert len(norms) == 4 * layers + 1  # input, post-attention, q and k per layer; the final norm
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
