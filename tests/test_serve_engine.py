"""The serving engine in-process: scheduling, the step batcher, the prefix cache, batched generation.

Experts are held in this process (the same link interface as a worker), so these tests exercise
batching, speculation and exactness without sockets; tests/test_serve.py drives the real server.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moeswarm.errors import WorkerError
from moeswarm.engine.generate import generate
from moeswarm.engine.whole_model import WholeModel
from moeswarm.generation.sampling import SamplingParams
from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.engine.batcher import StepBatcher
from moeswarm.engine.engine import Engine, EngineConfig
from moeswarm.engine.job import Delta, Failed, Finished, Job
from moeswarm.engine.prefix_cache import PrefixCache
from moeswarm.engine.scheduler import Feed, Slot, plan_step
from moeswarm.swarm import open_swarm

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [5, 6, 7, 5, 6, 7, 5, 6],  # repetitive: n-gram drafts get accepted
    list(range(11, 51)),  # 40 tokens: prefilled in chunks while the others decode
]


# -- the scheduler ------------------------------------------------------------------------------

def _tokens(plans) -> list[int]:
    return [plan.tokens for plan in plans]


def test_decoders_always_step_and_prompts_share_what_is_left_in_whole_chunks():
    slots = [Slot(0, (3,)), Slot(100), Slot(0), Slot(50), Slot(10)]
    # 11 tokens left after the oldest prompt's chunk: the 50-token prompt sits out, the 10-token one fits
    assert _tokens(plan_step(slots, prefill_chunk=64, step_tokens=80)) == [4, 64, 1, 0, 10]
    assert _tokens(plan_step(slots, prefill_chunk=8, step_tokens=80)) == [4, 8, 1, 8, 8]


def test_a_prompts_chunks_start_where_they_would_alone_whatever_shares_its_steps():
    """Each prompt is cut at multiples of the chunk from its start, as alone: the attention of a
    chunk then has the same shape (and bits) in a crowded step as alone."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        chunk = rng.choice([4, 8, 64])
        lefts = [rng.randrange(1, 200) for _ in range(rng.randrange(1, 6))]
        fed = [0] * len(lefts)
        while any(left > 0 for left in lefts):
            slots = [Slot(left) if left > 0 else Slot(0, (rng.randrange(0, 5),)) for left in lefts]
            for i, feed in enumerate(plan_step(slots, prefill_chunk=chunk, step_tokens=rng.randrange(1, 300))):
                if lefts[i] > 0 and feed.tokens:
                    assert fed[i] % chunk == 0 and feed.tokens == min(lefts[i], chunk)
                    fed[i] += feed.tokens
                    lefts[i] -= feed.tokens


def test_the_oldest_prompt_moves_even_when_decoders_fill_the_budget():
    slots = [Slot(0, (4,))] * 10 + [Slot(30), Slot(30)]
    assert _tokens(plan_step(slots, prefill_chunk=16, step_tokens=20)) == [5] * 10 + [16, 0]


def test_the_budget_counts_every_branch_row_and_drops_the_last_branches_first():
    # three branches of 4, 2 and 3 drafts: rows padded to the longest of the branches kept
    three = Slot(0, (4, 2, 3))
    assert plan_step([three], prefill_chunk=8, step_tokens=15) == [Feed(15, 3)]  # 3 x (1 + 4)
    assert plan_step([three], prefill_chunk=8, step_tokens=14) == [Feed(10, 2)]  # 2 x 5: the first two
    assert plan_step([three], prefill_chunk=8, step_tokens=9) == [Feed(5, 1)]
    assert plan_step([three], prefill_chunk=8, step_tokens=2) == [Feed(5, 1)]  # one row always steps
    assert plan_step([Slot(0, (2, 4))], prefill_chunk=8, step_tokens=9) == [Feed(3, 1)]  # 2 x (1 + 4) > 9
    # prompts come before the extra rows; the rows go round the decoders, oldest first
    slots = [Slot(0, (3, 3, 3)), Slot(0, (1, 1)), Slot(6)]
    assert plan_step(slots, prefill_chunk=4, step_tokens=16) == [Feed(8, 2), Feed(4, 2), Feed(4, 1)]
    assert plan_step(slots, prefill_chunk=4, step_tokens=20) == [Feed(12, 3), Feed(4, 2), Feed(4, 1)]
    assert plan_step(slots, prefill_chunk=4, step_tokens=11) == [Feed(4, 1), Feed(2, 1), Feed(4, 1)]
    for budget in range(1, 40):  # never over the budget for a branch's sake
        plans = plan_step(slots, prefill_chunk=4, step_tokens=budget)
        assert sum(_tokens(plans)) <= max(budget, 4 + 2 + 4)


# -- the step batcher -------------------------------------------------------------------------------

class RecordingDispatcher:
    """An inner dispatcher computing hidden * (1 + expert id sum), failing on a chosen expert."""

    def __init__(self, poison: int | None = None):
        self.calls: list[tuple[int, int]] = []  # (layer, rows)
        self.poison = poison

    def dispatch(self, layer, hidden, index, weights):
        self.calls.append((layer, hidden.shape[0]))
        if self.poison is not None and (index == self.poison).any():
            raise WorkerError("127.0.0.1:9", f"layer {layer}: holder of expert {self.poison} is gone")
        return hidden * (1 + index.sum(dim=1, keepdim=True))

    def combine(self, handle):
        return handle


def _run_step(batcher: StepBatcher, rows: list[tuple[torch.Tensor, torch.Tensor]], layers: int) -> list:
    """Each sequence walks `layers` MoE layers in its own thread, as the engine's forwards do."""
    results: list = [None] * len(rows)
    batcher.begin(len(rows))

    def forward(order: int) -> None:
        batcher.enter(order)
        try:
            hidden, index = rows[order]
            for layer in range(layers):
                time.sleep(0.001 * order)  # arrive in a different order than the slots
                hidden = batcher.combine(batcher.dispatch(layer, hidden, index, torch.ones_like(index, dtype=torch.float)))
            results[order] = hidden
        except WorkerError as error:
            results[order] = error
        finally:
            batcher.leave()

    threads = [threading.Thread(target=forward, args=(i,)) for i in range(len(rows))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_one_dispatch_per_layer_for_every_sequence_of_the_step():
    inner = RecordingDispatcher()
    rows = [(torch.full((n, 4), float(n)), torch.full((n, 2), n, dtype=torch.long)) for n in (1, 3, 2)]
    results = _run_step(StepBatcher(inner), rows, layers=3)
    assert inner.calls == [(0, 6), (1, 6), (2, 6)]
    for (hidden, index), got in zip(rows, results):
        expected = hidden
        for _ in range(3):
            expected = expected * (1 + index.sum(dim=1, keepdim=True))
        assert torch.equal(got, expected)


def test_a_failed_holder_fails_only_the_sequences_that_routed_to_it():
    inner = RecordingDispatcher(poison=7)
    rows = [(torch.ones(1, 4), torch.tensor([[1, 2]])), (torch.ones(2, 4), torch.tensor([[7, 2], [1, 3]])),
            (torch.ones(1, 4), torch.tensor([[3, 4]]))]
    results = _run_step(StepBatcher(inner), rows, layers=2)
    assert isinstance(results[1], WorkerError) and "expert 7" in str(results[1])
    assert torch.equal(results[0], torch.ones(1, 4) * 4 * 4)
    assert torch.equal(results[2], torch.ones(1, 4) * 8 * 8)
    # layer 0: the batch, then each alone; layer 1: the two survivors together
    assert inner.calls == [(0, 4), (0, 1), (0, 2), (0, 1), (1, 2)]


# -- the prefix cache -------------------------------------------------------------------------------

def test_prefix_cache_gives_the_longest_shared_prefix_and_keeps_the_last_prompt_token():
    cache = PrefixCache(slots=2)
    cache.put([1, 2, 3, 4], "a")
    cache.put([1, 2, 9], "b")
    assert cache.take([1, 2, 3, 4, 5]) == (4, "a")
    assert cache.take([1, 2, 3, 4]) == (3, "a")  # the last prompt token is fed again for its logits
    assert cache.take([1, 2, 9, 9]) == (3, "b")
    assert cache.take([7]) == (0, None)
    cache.put([1, 2, 3, 4, 5, 6], "c")  # extends "a": replaces it
    assert len(cache) == 2 and cache.take([1, 2, 3, 4, 5, 6, 7]) == (6, "c")


def test_prefix_cache_reuses_whole_prefill_chunks_only():
    cache = PrefixCache(slots=2, chunk=4)
    cache.put([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert cache.take([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == (8, "a")  # 9 shared: the rest from position 8, as alone
    assert cache.take([1, 2, 3, 4, 5, 6, 0]) == (4, "a")
    assert cache.take([1, 2, 3, 0]) == (0, None)  # less than a chunk: a miss


# -- the engine ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_reference(qwen2_moe):
    return load_local(qwen2_moe)


def _alone(reference, prompt, max_tokens) -> list[int]:
    return generate(WholeModel(reference), prompt, max_tokens).tokens


class Collector:
    def __init__(self, count: int):
        self.tokens = [[] for _ in range(count)]
        self.text = [""] * count
        self.ends: list = [None] * count
        self._left = count
        self._done = threading.Event()

    def emit_for(self, i: int):
        def emit(event) -> None:
            if isinstance(event, Delta):
                self.tokens[i] += event.tokens
                self.text[i] += event.text
            else:
                self.ends[i] = event
                self._left -= 1
                if not self._left:
                    self._done.set()
        return emit

    def wait(self) -> None:
        assert self._done.wait(120), "the engine did not finish every job"


def _serve_greedy(model_dir, prompts: list[list[int]], speculate: int):
    """Every prompt as a greedy 12-token job on one engine with a local eager reference: (engine, collector)."""
    with open_swarm(model_dir, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, speculate=speculate, prefill_chunk=8),
                        reference=load_local(model_dir))
        engine.start()
        try:
            got = Collector(len(prompts))
            for i, prompt in enumerate(prompts):
                engine.submit(Job(prompt, 12, SamplingParams(), got.emit_for(i)))
            got.wait()
        finally:
            engine.stop()
    return engine, got


@pytest.mark.parametrize("speculate", [0, 3])
def test_batched_greedy_equals_alone_and_local_eager_bit_for_bit(qwen2_moe, local_reference, speculate):
    engine, got = _serve_greedy(qwen2_moe, PROMPTS, speculate)
    for i, prompt in enumerate(PROMPTS):
        assert got.tokens[i] == _alone(local_reference, prompt, 12)
        assert got.ends[i] == Finished("length", len(prompt), 12, 0)
    assert engine.checked_rows > 0 and engine.mismatched_rows == 0
    # every step carried every active sequence: fewer steps than tokens generated by all of them
    assert engine.steps < sum(len(t) for t in got.tokens)


def test_latent_attention_batches_and_every_step_equals_its_local_reference(tiny_models):
    """DeepSeek V3 (multi-head latent attention, forward/latent.py), drafts on: one packed forward
    a step for all the jobs, each step compared bit for bit with the same step on the local model."""
    engine, got = _serve_greedy(tiny_models("deepseek_v3"), PROMPTS, speculate=3)
    assert engine.packed
    assert got.ends == [Finished("length", len(prompt), 12, 0) for prompt in PROMPTS]
    assert engine.checked_rows > 0 and engine.mismatched_rows == 0
    assert engine.steps < sum(len(t) for t in got.tokens)  # a step carries every active sequence


def test_same_seed_same_tokens_with_and_without_other_requests(qwen2_moe):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    runs = []
    with open_swarm(qwen2_moe, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, prefill_chunk=8))
        engine.start()
        try:
            for company in (0, 2):
                got = Collector(1 + company)
                engine.submit(Job(PROMPTS[0], 10, params, got.emit_for(0)))
                for j in range(company):
                    engine.submit(Job(PROMPTS[j + 1], 10, SamplingParams(temperature=1.0, seed=j), got.emit_for(j + 1)))
                got.wait()
                runs.append(got.tokens[0])
        finally:
            engine.stop()
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_a_cancelled_job_leaves_at_the_next_step_and_a_repeated_prompt_hits_the_prefix_cache(qwen2_moe, local_reference):
    with open_swarm(qwen2_moe, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, prefill_chunk=8))  # reuse comes in whole chunks of 8
        engine.start()
        try:
            first = threading.Event()
            job = Job(PROMPTS[0], 100, SamplingParams(), lambda event: first.set())
            engine.submit(job)
            assert first.wait(60)
            job.cancelled.set()
            deadline = time.monotonic() + 30
            while engine.active and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.active == 0
            miss, hit = Collector(1), Collector(1)
            engine.submit(Job(PROMPTS[2], 6, SamplingParams(), miss.emit_for(0)))
            miss.wait()
            engine.submit(Job(PROMPTS[2] + [3, 4], 6, SamplingParams(), hit.emit_for(0)))
            hit.wait()
        finally:
            engine.stop()
    assert miss.ends[0].cached_tokens == 0
    assert hit.ends[0].cached_tokens == len(PROMPTS[2])  # the first request's prompt (5 chunks of 8) was reused
    assert hit.tokens[0] == _alone(local_reference, PROMPTS[2] + [3, 4], 6)


def test_a_failing_forward_fails_its_job_with_a_one_line_error(qwen2_moe):
    with open_swarm(qwen2_moe, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128))
        engine.start()
        try:
            got = Collector(2)
            engine.submit(Job([10**6], 4, SamplingParams(), got.emit_for(0)))  # an id the embedding cannot index
            engine.submit(Job(PROMPTS[0], 4, SamplingParams(), got.emit_for(1)))
            got.wait()
        finally:
            engine.stop()
    assert isinstance(got.ends[0], Failed) and got.ends[0].status == 500 and "\n" not in got.ends[0].message
    assert isinstance(got.ends[1], Finished) and len(got.tokens[1]) == 4


def test_a_long_prompt_is_prefilled_in_chunks_without_pausing_a_running_stream(qwen2_moe):
    with open_swarm(qwen2_moe, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, prefill_chunk=8, step_tokens=16))
        engine.start()
        try:
            steps_of_a: list[int] = []
            started = threading.Event()
            got = Collector(2)

            def emit_a(event) -> None:
                if isinstance(event, Delta):
                    steps_of_a.append(engine.steps)
                    started.set()
                got.emit_for(0)(event)

            engine.submit(Job(PROMPTS[0], 30, SamplingParams(), emit_a))
            assert started.wait(60)
            engine.submit(Job(list(range(1, 97)), 2, SamplingParams(), got.emit_for(1)))  # 96 tokens: 12 chunks of 8
            got.wait()
        finally:
            engine.stop()
    assert got.ends[1] == Finished("length", 96, 2, 0)
    assert steps_of_a == list(range(steps_of_a[0], steps_of_a[0] + 30))  # a token every step, prefill or not


# -- branches: several drafts of a greedy sequence verified side by side ----------------------------

BRANCHY = [  # the last tokens occurred several times before, each followed by something else
    [5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6],
    [3, 4, 11, 3, 4, 12, 3, 4, 13, 3, 4, 11, 3, 4],
]


def test_greedy_sequences_verify_ngram_branches_side_by_side_exactly(qwen2_moe, local_reference):
    """Concurrent greedy requests feed every n-gram continuation as a row of its own: the tokens are
    generate's greedy tokens, and every row of every branch is torch.equal to local eager."""
    engine, got = _serve_greedy(qwen2_moe, BRANCHY, 4)
    for i, prompt in enumerate(BRANCHY):
        assert got.tokens[i] == _alone(local_reference, prompt, 12)
        assert got.ends[i] == Finished("length", len(prompt), 12, 0)
    assert engine.mismatched_rows == 0 and engine.checked_rows == engine.stats.totals["fed"]  # every row checked
    assert engine.branches > engine.decode_steps  # some steps fed several branches
    totals = engine.stats.totals
    assert 0 < totals["accepted"] <= totals["drafted"] <= 4 * engine.decode_steps  # the kept branches' drafts only
    assert totals["generated"] == 24


def test_a_sampled_sequence_feeds_one_draft(qwen2_moe):
    with open_swarm(qwen2_moe, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, speculate=4, prefill_chunk=8))
        engine.start()
        try:
            got = Collector(1)
            engine.submit(Job(BRANCHY[0], 12, SamplingParams(temperature=0.8, seed=3), got.emit_for(0)))
            got.wait()
        finally:
            engine.stop()
    assert len(got.tokens[0]) == 12
    assert engine.decode_steps > 0 and engine.branches == engine.decode_steps
    assert engine.stats.totals["drafted"] > 0  # it drafted, one draft a step


def test_copies_of_one_prompt_prefill_it_once_and_stay_exact(qwen2_moe):
    """n > 1 (or one prompt sent several times): the first copy prefills, the others take its cache
    and feed only the last prompt token; the local reference sees the same, bit for bit."""
    prompt = list(range(11, 41))
    with open_swarm(qwen2_moe, [], local_experts=list(range(8))) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, prefill_chunk=8, cache_slots=0),
                        reference=load_local(qwen2_moe))
        got = Collector(3)
        for i in range(3):
            engine.submit(Job(prompt, 6, SamplingParams(temperature=0.8, seed=i), got.emit_for(i)))
        while engine.step():
            pass
        engine.close()
    assert [end.cached_tokens for end in got.ends] == [0, len(prompt) - 1, len(prompt) - 1]
    assert engine.metrics.cached_prompt_tokens._value.get() == 2 * (len(prompt) - 1)
    assert engine.check.positions > 0 and engine.check.bit_identical and engine.mismatched_rows == 0
    assert all(len(tokens) == 6 for tokens in got.tokens)
