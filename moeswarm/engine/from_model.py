"""One generation from a model path, as `moeswarm generate` runs it: the model opened, the request
checked against it before the backbone loads or a holder is reached, the backbone's swarm
configured and opened, the generation run and reported.

How the swarm is configured and opened (workers, the swarm's DHT, stages) is the caller's: two
functions of the opened model.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from moeswarm.generation.draft_names import check_draft_flags
from moeswarm.generation.report import GenerationReport
from moeswarm.generation.request import GenerationRequest
from moeswarm.engine.generate import check_request, run_generation
from moeswarm.generation.sampling import SamplingParams
from moeswarm.sources.source import ModelSource, open_source
from moeswarm.engine.job import Event
from moeswarm.swarm import Swarm
from moeswarm.swarm_config import SwarmConfig

__all__ = ["GenerationRequest", "SamplingParams", "generate_from_model"]  # a request's types, for its callers

SwarmConfigFor = Callable[[ModelSource], SwarmConfig]
OpenBackbone = Callable[[ModelSource, SwarmConfig], AbstractContextManager[Swarm]]


def generate_from_model(model: str, request: GenerationRequest, swarm_config: SwarmConfigFor,
                        open_backbone: OpenBackbone, backbone_dtype: str = "file",
                        on_event: Callable[[Event], None] | None = None) -> GenerationReport:
    """`request` on the model at `model` (a directory or GGUF file); MoeSwarmError (one line) for a
    request the model cannot take, a bad swarm configuration or an unreachable holder."""
    source = open_source(model, backbone_dtype)
    check_request(source, request)  # before the backbone loads or a worker is reached
    config = swarm_config(source)
    check_draft_flags(request.draft, request.speculate, config.local_experts is not None)
    with open_backbone(source, config) as swarm:
        return run_generation(swarm, request, on_event=on_event)
