"""Shared fixtures: tiny models made on the fly, worker processes over real TCP."""

from __future__ import annotations

import pytest
import torch

from moeswarm.bundled import TRAINED
from moeswarm.local.workers import local_workers, split_experts
from moeswarm_bench.serve_process import ServeProcess
from moeswarm.model.tiny import make_tiny_model

torch.set_num_threads(1)  # several processes share the CI machine's cores


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> directory of a tiny random model, made once per session."""
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(make_tiny_model(family, tmp_path_factory.mktemp(family)))
        return made[family]

    return get


@pytest.fixture(scope="session")
def qwen2_moe(tiny_models) -> str:
    return tiny_models("qwen2_moe")


@pytest.fixture(scope="session")
def qwen3_q4_k_m(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE converted and quantized to Q4_K_M by llama.cpp's tools, made once per session."""
    from llamacpp_fixtures import make_fixture_ggufs

    return str(make_fixture_ggufs("qwen3_moe", tmp_path_factory.mktemp("qwen3-q4km"), types=("Q4_K_M",),
                                  norm_topk_prob=True)["Q4_K_M"])


@pytest.fixture(scope="session")
def qwen2_workers(qwen2_moe):
    """Two worker processes holding experts 0-3 and 4-7 of the tiny qwen2_moe."""
    with local_workers(qwen2_moe, split_experts(8, 2)) as addresses:
        yield addresses


@pytest.fixture(scope="session")
def qwen2_replicas(qwen2_moe):
    """Two worker processes, each holding all 8 experts of the tiny qwen2_moe (tests that lie or
    check do it on the backbone's links, never to the processes, so one pair serves them all)."""
    with local_workers(qwen2_moe, [list(range(8))] * 2) as addresses:
        yield addresses


@pytest.fixture(scope="session")
def trained_workers():
    """Two worker processes holding experts 0-15 and 16-31 of the bundled trained model."""
    with local_workers(str(TRAINED), split_experts(32, 2)) as addresses:
        yield addresses


@pytest.fixture(scope="session")
def trained_serve(trained_workers):
    """`moeswarm serve --model-name pymoe` on the bundled model over `trained_workers`, as the
    third-party clients (tests/test_third_party_*.py) meet it."""
    with ServeProcess(str(TRAINED), trained_workers, "--model-name", "pymoe") as server:
        server.wait_ready()
        yield server


@pytest.fixture(scope="session")
def trained_local():
    """The bundled model run locally and its text codec: the reference the served answers equal."""
    from moeswarm.sources.loading import load_local
    from moeswarm.sources.tokenizer import load_text_codec

    model = load_local(TRAINED)
    return model, load_text_codec(TRAINED, model.config.vocab_size)
