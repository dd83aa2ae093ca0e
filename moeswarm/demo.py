"""`moeswarm demo`: the bundled model (or a given one), local workers, one generation checked against
a local run with the same seed.

The bundled model is tiny (6.8 M parameters, trained for 27 minutes on Python source): greedy
decoding soon loops on it, so the demo samples from it (temperature 0.7, top-p 0.9, a fixed seed:
the same text every run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from moeswarm.bundled import DEMO_PROMPT, demo_model
from moeswarm.errors import MoeSwarmError
from moeswarm.generation.report import GenerationReport
from moeswarm.generation.request import GenerationRequest
from moeswarm.engine.generate import check_request, run_generation
from moeswarm.generation.sampling import SamplingParams
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.source import open_source
from moeswarm.engine.job import Event
from moeswarm.local.workers import local_swarm, split_experts

BUNDLED_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "seed": 2}  # reads like Python on the bundled model


@dataclass(frozen=True)
class DemoOptions:
    model: str | None = None  # None: the bundled model
    prompt: str | None = None  # None: a Python function header
    max_new_tokens: int = 48
    workers: int = 2  # local worker processes, at least 2
    speculate: int = 0  # n-gram drafts per step
    temperature: float | None = None  # None: 0.7 with top-p 0.9 on the bundled model, greedy on another
    seed: int | None = None  # None: BUNDLED_SAMPLING's, the same text every run

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise MoeSwarmError("the demo runs at least 2 workers")


@dataclass(frozen=True)
class DemoStart:
    """What the demo runs, known before its workers start."""

    model: str
    bundled: bool
    config: PretrainedConfig
    num_experts: int
    expert_sets: list[list[int]]  # per worker
    prompt: str


def run_demo(options: DemoOptions, on_start: Callable[[DemoStart], None] = lambda start: None,
             on_ready: Callable[[DemoStart], None] = lambda start: None,
             on_event: Callable[[Event], None] | None = None) -> GenerationReport:
    """One generation on local workers, checked against a local run: `on_start` before the workers
    start, `on_ready` once they serve, `on_event` as the text comes."""
    model = options.model or str(demo_model())
    source = open_source(model)
    prompt = options.prompt if options.prompt is not None else DEMO_PROMPT
    bundled = options.model is None
    temperature = options.temperature if options.temperature is not None else (
        BUNDLED_SAMPLING["temperature"] if bundled else 0.0)
    sampling = SamplingParams(temperature, BUNDLED_SAMPLING["top_p"] if temperature else 1.0, 0,
                              options.seed if options.seed is not None else BUNDLED_SAMPLING["seed"])
    request = GenerationRequest(prompt, None, options.max_new_tokens, options.speculate, True, sampling=sampling)
    check_request(source, request)  # before any worker starts
    num_experts = num_experts_in_config(source.config)
    start = DemoStart(model, bundled, source.config, num_experts, split_experts(num_experts, options.workers), prompt)
    on_start(start)
    with local_swarm(model, start.expert_sets) as swarm:
        on_ready(start)
        return run_generation(swarm, request, on_event=on_event)
