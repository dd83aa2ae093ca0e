"""After a ban, the steps that used the liar's unchecked answers are undone and recomputed: the
output equals an honest run, bit for bit (real worker processes of the tiny model, a lying link
in front of one of them, the backbone settling the dispute itself with two holders)."""

from __future__ import annotations

import pytest

from moeswarm_bench.bench.lying import LyingLink, generate_with_rollback, greedy
from moeswarm.forward.stepper import Stepper
from moeswarm.sources.loading import load_local
from moeswarm.swarm import open_swarm

PROMPT = [72, 101, 108, 108, 111, 44, 32]


@pytest.fixture(scope="module")
def honest(qwen2_moe):
    return greedy(Stepper(load_local(qwen2_moe)), PROMPT, 12)


@pytest.fixture(scope="module")
def addresses(qwen2_replicas):
    """Two worker processes, each holding every expert (conftest's: the lies are told by the links)."""
    return qwen2_replicas


def test_a_late_caught_liar_is_rolled_back_and_the_output_equals_an_honest_run(qwen2_moe, honest, addresses):
    """Two holders, zeros from the first, checks on 5 % of answers: wrong tokens are emitted before
    the ban; with the rollback the final output is the honest one, and the honest holder is kept."""
    with open_swarm(
            qwen2_moe, addresses, spot_check=0.05, spot_check_seed=4,
            wrap_link=lambda i, link: LyingLink(link, "zeros") if i == 0 else link) as swarm:
        out, emitted, rollbacks = generate_with_rollback(swarm, PROMPT, 12)
        assert [s["banned"] for s in swarm.standing()] == [True, False]
        assert swarm.resilience()["disputes_settled"] == 1  # the backbone computed the rows itself
        assert emitted != honest and rollbacks == 1  # the lie reached tokens before the ban ...
        assert out == honest  # ... and the rollback undid every one of them


def test_one_absurd_row_is_caught_in_the_first_step(qwen2_moe, honest, addresses):
    with open_swarm(
            qwen2_moe, addresses, wrap_link=lambda i, link: LyingLink(link, "huge") if i == 0 else link) as swarm:
        steps = []
        out, emitted, _ = generate_with_rollback(swarm, PROMPT, 12, lambda: steps.append(swarm.resilience()["bans"]))
        assert steps[0] == 1 and swarm.resilience()["implausible"] == 1
        assert out == honest and emitted == honest
        assert [s["banned"] for s in swarm.standing()] == [True, False]


def test_the_serving_engine_rolls_back_a_request_and_takes_its_text_back(qwen2_moe, honest, addresses):
    """The same liar under the engine: the request's steps after the first tainted one are undone,
    the caller told to take their output back (Rewind), and the final tokens are the honest ones."""
    from moeswarm.generation.sampling import SamplingParams
    from moeswarm.sources.tokenizer import load_text_codec
    from moeswarm.engine.engine import Engine, EngineConfig
    from moeswarm.engine.job import Delta, Finished, Job, Rewind

    tokens, rewinds, ends = [], [], []

    def emit(event):
        if isinstance(event, Delta):
            tokens.extend(event.tokens)
        elif isinstance(event, Rewind):
            rewinds.append(event)
            del tokens[event.tokens :]
        elif isinstance(event, Finished):
            ends.append(event)

    with open_swarm(
            qwen2_moe, addresses, spot_check=0.05, spot_check_seed=4,
            wrap_link=lambda i, link: LyingLink(link, "zeros") if i == 0 else link) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, cache_slots=0))
        engine.run(Job(PROMPT, 12, SamplingParams(), emit))
        engine.close()
        assert [s["banned"] for s in swarm.standing()] == [True, False]
    assert len(rewinds) == 1 and ends and ends[0].completion_tokens == 12
    assert tokens == [t for t in honest if t != codec.eos_token_id]
    assert engine.metrics.rolled_back._value.get() == 1
