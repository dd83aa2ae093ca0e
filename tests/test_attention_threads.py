"""Attention on one thread: a model's bits do not depend on the process's thread count.

torch's CPU attention splits its work by the thread count, and a row's bits depend on the split
(at OLMoE's real dimensions 3 of 17 greedy requests gave other text at 1 thread than at 2).
moeswarm/model/attention_threads.py runs transformers' sdpa attention on one thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from moeswarm.generation.stepper import Stepper
from moeswarm.model.attention_threads import sdpa_one_thread
from moeswarm.model.loading import load_local


class _Module(torch.nn.Module):
    is_causal = True


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def test_the_wrapped_attention_computes_on_one_thread_and_puts_the_count_back():
    torch.manual_seed(0)
    # one query (a decode step): torch's own kernel gives other bits at 2 threads than at 1 (measured here)
    query, key, value = torch.randn(1, 16, 1, 128), torch.randn(1, 16, 300, 128), torch.randn(1, 16, 300, 128)
    mask = None
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
