"""One runner for every family: experts on 2 worker processes over TCP, logits torch.equal to eager.

Adding a family is adding a line to moeswarm.model.tiny.FAMILIES.
"""

from __future__ import annotations

import pytest
import torch

from moeswarm.generation.stepper import Stepper
from moeswarm.local_workers import local_workers, split_experts
from moeswarm.model.loading import load_local
from moeswarm.model.tiny import FAMILIES
from moeswarm.swarm import connect_swarm

DECODE_STEPS = 8


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_remote_equals_local(family, tiny_models):
    path = tiny_models(family)
    local = Stepper(load_local(path))
    num_experts = 8
    with local_workers(path, split_experts(num_experts, 2)) as addresses:
        swarm = connect_swarm(path, addresses)
        try:
            remote = Stepper(swarm.model)
            feed = [11, 42, 7, 99, 3, 250, 18, 64, 5, 77]  # prefill: 10 tokens in one dispatch per layer
            for step in range(1 + DECODE_STEPS):
                remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                assert torch.equal(remote_logits, local_logits), f"{family}: logits differ at step {step}"
                feed = [int(remote_logits[-1].argmax())]
            summary = swarm.dispatcher.accounting.summary()
        finally:
            swarm.close()
    assert set(summary["worker_rtt_ms_mean"]) == set(addresses), "both workers must have served experts"
    assert summary["layer_calls"] == (1 + DECODE_STEPS) * len(swarm.moe_layers)


def test_odd_sizes_and_uneven_split(tmp_path):
    """Experts whose byte size is not a multiple of 64, split 3 + 5: worker buffers must mirror the
    address alignment a local model gives each expert, or single-row matmuls differ in low bits."""
    from moeswarm.model.tiny import make_tiny_model

    path = str(make_tiny_model("qwen3_moe", tmp_path / "odd", hidden_size=33, moe_intermediate_size=7))
    local = Stepper(load_local(path))
    with local_workers(path, [(0, 2), (3, 7)]) as addresses:
        swarm = connect_swarm(path, addresses)
        try:
            remote = Stepper(swarm.model)
            feed = list(range(3, 30))
            for step in range(1 + DECODE_STEPS):
                remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                assert torch.equal(remote_logits, local_logits), f"logits differ at step {step}"
                feed = [int(remote_logits[-1].argmax())]
        finally:
            swarm.close()


def test_bf16_model_is_bit_identical(tmp_path):
    """A bf16 checkpoint: hidden states travel as bf16, routing weights in their own dtype."""
    from transformers import AutoModelForCausalLM

    from moeswarm.model.tiny import make_tiny_model

    path = make_tiny_model("gpt_oss", tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    local_model = load_local(path)
    assert next(local_model.parameters()).dtype == torch.bfloat16
    local = Stepper(local_model)
    with local_workers(str(path), split_experts(8, 2)) as addresses:
        swarm = connect_swarm(str(path), addresses)
        try:
            remote = Stepper(swarm.model)
            feed = list(range(3, 20))
            for step in range(1 + DECODE_STEPS):
                remote_logits, local_logits = remote.forward(feed), local.forward(feed)
                assert torch.equal(remote_logits, local_logits), f"logits differ at step {step}"
                feed = [int(remote_logits[-1].argmax())]
        finally:
            swarm.close()
