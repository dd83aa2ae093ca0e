"""Attention on one thread: a model's bits do not depend on the process's thread count.

torch's CPU attention splits its work by the thread count, and a row's bits depend on the split
(at OLMoE's real dimensions 3 of 17 greedy requests gave other text at 1 thread than at 2).
moeswarm/model/attention_threads.py runs transformers' sdpa attention on one thread, and a decode
step's single unmasked query in C (qkernels.attend_one).
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from moeswarm.forward.stepper import Stepper
from moeswarm.model.attention_threads import sdpa_one_thread
from moeswarm.sources.loading import load_local
from moeswarm.kernels import qkernels


class _Module(torch.nn.Module):
    is_causal = True


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def test_the_wrapped_attention_computes_on_one_thread_and_puts_the_count_back():
    torch.manual_seed(0)
    # two queries after 298 cached positions, with their causal mask (a single unmasked query goes to C)
    query, key, value = torch.randn(1, 16, 2, 128), torch.randn(1, 16, 300, 128), torch.randn(1, 16, 300, 128)
    mask = torch.zeros(1, 1, 2, 300)
    mask[0, 0, 0, 299] = torch.finfo(torch.float32).min
    before = _threads(1)
    try:
        expected, _ = sdpa_attention_forward(_Module(), query, key, value, mask)
        torch.set_num_threads(2)
        got, _ = sdpa_one_thread(_Module(), query, key, value, mask)
        assert torch.get_num_threads() == 2
        assert torch.equal(got, expected)
        results, errors = [], []

        def call():
            try:
                torch.set_num_threads(2)
                results.append(sdpa_one_thread(_Module(), query, key, value, mask)[0])
                assert torch.get_num_threads() == 2
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        workers = [threading.Thread(target=call) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not errors and all(torch.equal(r, expected) for r in results)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_gguf_models_logits_are_the_same_on_one_thread_and_on_two(qwen3_q4_k_m):
    model = load_local(qwen3_q4_k_m)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_one_thread
    feed = [(7 * i + 3) % 200 + 5 for i in range(40)]
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            stepper = Stepper(model)
            rows = [stepper.forward(feed)]
            for _ in range(6):
                rows.append(stepper.forward([int(rows[-1][-1].argmax())]))
            runs.append(torch.cat(rows))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[0], runs[1])


def _reference(query, key, value, scale):
    """softmax(q k^T * scale) v in float64, key/value heads repeated for grouped queries: [B, 1, Hq, Dv]."""
    groups = query.shape[1] // key.shape[1]
    k, v = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    weights = torch.softmax(query.double() @ k.transpose(-1, -2) * scale, dim=-1)  # [B, Hq, 1, p]
    return (weights @ v).transpose(1, 2)


@pytest.mark.skipif(not qkernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("batch,heads,kv_heads,positions,head_dim", [(1, 16, 16, 100, 128), (2, 32, 4, 37, 128),
                                                                      (1, 8, 2, 1, 64), (1, 4, 4, 9, 72)])
def test_a_single_query_is_attended_in_c_with_the_same_bits_at_any_thread_count(batch, heads, kv_heads, positions,
                                                                                 head_dim):
    torch.manual_seed(1)
    query = torch.randn(batch, heads, 1, head_dim)
    # the cache's buffers hold more positions than are attended (views with a position stride, as a
    # sequence cache hands them over)
    key = (3 * torch.randn(batch, kv_heads, positions + 5, head_dim))[:, :, :positions]
    value = torch.randn(batch, kv_heads, positions + 5, head_dim)[:, :, :positions]
    module = _Module()
    module.num_key_value_groups = heads // kv_heads
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, weights = sdpa_one_thread(module, query, key, value, None, scaling=0.1, dropout=0.0)
            runs.append(out)
    finally:
        torch.set_num_threads(before)
    assert weights is None and runs[0].shape == (batch, 1, heads, head_dim) and runs[0].is_contiguous()
    assert torch.equal(runs[0], runs[1])
    for threads in (1, 2, 3, 7):  # the heads split among threads, each whole on one: the same bits
        assert torch.equal(runs[0], qkernels.attend_one(query, key, value, 0.1, threads))
    assert torch.allclose(runs[0].double(), _reference(query, key, value, 0.1), rtol=0, atol=2e-6)
    # transformers' sdpa path computes the same attention, up to the order of its sums
    expected, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.1)
    assert torch.allclose(runs[0], expected, rtol=0, atol=2e-5)


@pytest.mark.skipif(not qkernels.available(), reason="needs the C kernels")
def test_a_masked_or_dropped_out_query_keeps_transformers_attention():
    torch.manual_seed(2)
    query, key, value = torch.randn(1, 4, 1, 32), torch.randn(1, 4, 6, 32), torch.randn(1, 4, 6, 32)
    mask = torch.zeros(1, 1, 1, 6)
    mask[..., 2] = torch.finfo(torch.float32).min  # a position the query must not see
    got, _ = sdpa_one_thread(_Module(), query, key, value, mask)
    expected, _ = sdpa_attention_forward(_Module(), query, key, value, mask)
    assert torch.equal(got, expected)
    assert not torch.allclose(got, qkernels.attend_one(query, key, value, 32 ** -0.5), atol=1e-4)


@pytest.mark.skipif(not qkernels.available(), reason="needs the C kernels")
def test_a_single_query_with_a_position_bias_keeps_transformers_attention():
    # a tensor argument that changes the result (a relative position bias) is never taken for "none given"
    torch.manual_seed(3)
    query, key, value = torch.randn(1, 4, 1, 32), torch.randn(1, 4, 6, 32), torch.randn(1, 4, 6, 32)
    bias = torch.randn(1, 4, 1, 6)
    got, _ = sdpa_one_thread(_Module(), query, key, value, None, position_bias=bias)
    expected, _ = sdpa_attention_forward(_Module(), query, key, value, None, position_bias=bias)
    assert torch.equal(got, expected)
