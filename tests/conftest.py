"""Shared fixtures: tiny models made on the fly, worker processes over real TCP."""

from __future__ import annotations

import pytest
import torch

from moeswarm.tools.local_workers import local_workers, split_experts
from moeswarm.tools.tiny import make_tiny_model

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
def qwen2_workers(qwen2_moe):
    """Two worker processes holding experts 0-3 and 4-7 of the tiny qwen2_moe."""
    with local_workers(qwen2_moe, split_experts(8, 2)) as addresses:
        yield addresses
