"""One runner for every family: experts on 2 worker processes over TCP, logits torch.equal to eager.

Adding a family is adding a line to moeswarm.model.tiny.FAMILIES.
"""

from __future__ import annotations

import pytest
import torch

from moeswarm.forward.stepper import Stepper
from moeswarm.swarm import open_swarm
from moeswarm.local.workers import spawn_worker, split_experts, stop, wait_listening
from moeswarm.sources.loading import load_local
from moeswarm.model.tiny import FAMILIES, make_tiny_model

DECODE_STEPS = 8


def assert_remote_equals_local(path: str, expert_sets: list[list[int]], prompt: list[int],
                               local_experts: list[int] | None = None) -> dict:
    """Prefill + DECODE_STEPS greedy steps, remote and local side by side; return the accounting.

    local_experts: experts the backbone holds itself (through the same link interface)."""
    workers = [spawn_worker(path, experts) for experts in expert_sets]  # they start while the local model loads
    try:
        local = Stepper(load_local(path))
        with open_swarm(path, [wait_listening(worker) for worker in workers], local_experts=local_experts) as swarm:
            remote = Stepper(swarm.model)
            feed = prompt  # prefill: every prompt token in one dispatch per layer
            for step in range(1 + DECODE_STEPS):
                remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                assert torch.equal(remote_logits, local_logits), f"{path}: logits differ at step {step}"
                feed = [int(remote_logits[-1].argmax())]
            summary = swarm.accounting()
            holders = swarm.workers
    finally:
        stop(workers)
    assert set(summary["worker_rtt_ms_mean"]) == set(holders), "every holder must have served experts"
    assert summary["layer_calls"] == (1 + DECODE_STEPS) * len(swarm.moe_layers)
    return summary


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_remote_equals_local(family, tiny_models):
    assert_remote_equals_local(tiny_models(family), split_experts(8, 2), [11, 42, 7, 99, 3, 250, 18, 64, 5, 77])


@pytest.fixture(scope="module")
def odd_sizes(tmp_path_factory) -> str:
    """A qwen3_moe whose experts' byte sizes are not multiples of 64 (read only: made once)."""
    return str(make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("odd"), hidden_size=33, moe_intermediate_size=7))


def test_odd_sizes_and_uneven_split(odd_sizes):
    """Experts whose byte size is not a multiple of 64, split 3 + 5: worker buffers must mirror the
    address alignment a local model gives each expert, or single-row matmuls differ in low bits."""
    assert_remote_equals_local(odd_sizes, [[0, 1, 2], [3, 4, 5, 6, 7]], list(range(3, 30)))


def test_non_contiguous_expert_sets(odd_sizes):
    """Workers holding scattered experts (odd byte sizes, so each run of experts needs its own
    alignment): still bit-identical."""
    assert_remote_equals_local(odd_sizes, [[0, 2, 3, 7], [1, 4, 5, 6]], list(range(3, 30)))


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_local_and_remote_holders_mixed(family, tiny_models):
    """Experts 0-2 and 6 on the backbone, the rest on two workers: exact combine stays bit-identical."""
    summary = assert_remote_equals_local(tiny_models(family), [[3, 4], [5, 7]], list(range(3, 20)), local_experts=[0, 1, 2, 6])
    assert "local" in summary["worker_rtt_ms_mean"]


def test_bf16_model_is_bit_identical(tmp_path):
    """A bf16 checkpoint: hidden states travel as bf16, routing weights in their own dtype."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("gpt_oss", tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    assert next(load_local(path).parameters()).dtype == torch.bfloat16
    assert_remote_equals_local(str(path), split_experts(8, 2), list(range(3, 20)))
