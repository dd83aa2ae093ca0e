"""Several batches in flight (engine/turns.py): groups take turns at every MoE layer, and a step of
two groups through real workers stays bit-identical to the same groups computed locally."""

from __future__ import annotations

import threading

import torch

from moeswarm.generation.sampling import SamplingParams
from moeswarm.local.workers import local_swarm
from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.engine.engine import Engine, EngineConfig
from moeswarm.engine.job import Delta, Finished, Job
from moeswarm.engine.scheduler import split_groups
from moeswarm.engine.turns import TakingTurns


class Recorder:
    """An inner backend that logs every dispatch and combine, in the order they happen."""

    def __init__(self):
        self.log: list[str] = []

    def dispatch(self, layer, hidden, index, weights):
        self.log.append(f"send {threading.current_thread().name} {layer}")
        return hidden

    def combine(self, handle):
        self.log.append(f"gather {threading.current_thread().name}")
        return handle * 2


def _group(turns: TakingTurns, index: int, layers: int, results: list) -> None:
    turns.enter(index)
    try:
        hidden = torch.full((1, 2), float(index))
        for layer in range(layers):
            hidden = turns.combine(turns.dispatch(layer, hidden, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)))
        results[index] = hidden
    finally:
        turns.leave()


def test_groups_alternate_and_each_gathers_after_the_other_has_sent():
    inner = Recorder()
    turns = TakingTurns(inner)
    turns.begin(2)
    results = [None, None]
    threads = [threading.Thread(target=_group, args=(turns, i, 3, results), name=name) for i, name in enumerate("AB")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert inner.log == ["send A 0", "send B 0", "gather A", "send A 1", "gather B", "send B 1",
                         "gather A", "send A 2", "gather B", "send B 2", "gather A", "gather B"]
    assert torch.equal(results[1], torch.full((1, 2), 8.0))


def test_a_group_that_ends_early_leaves_the_other_running_alone():
    inner = Recorder()
    turns = TakingTurns(inner)
    turns.begin(2)
    results = [None, None]
    short = threading.Thread(target=_group, args=(turns, 0, 1, results), name="A")
    long = threading.Thread(target=_group, args=(turns, 1, 4, results), name="B")
    short.start()
    long.start()
    short.join(10)
    long.join(10)
    assert not long.is_alive() and inner.log.count("send B 3") == 1


def test_split_groups_balances_tokens_and_keeps_slot_order():
    assert split_groups([1, 1, 1, 1], 2) == [[0, 2], [1, 3]]
    assert split_groups([64, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_groups([5], 2) == [[0]]
    assert split_groups([3, 3], 1) == [[0, 1]]


def test_two_groups_through_workers_equal_the_same_groups_locally(qwen2_moe):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 9, 8, 7], list(range(20, 32)), [40, 41, 42]]
    with local_swarm(qwen2_moe, 2) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=128, speculate=2, groups=2), reference=load_local(qwen2_moe))
        tokens: list[list[int]] = [[] for _ in prompts]
        ends: list = [None] * len(prompts)

        def emit_for(i):
            def emit(event):
                if isinstance(event, Delta):
                    tokens[i].extend(event.tokens)
                elif isinstance(event, Finished):
                    ends[i] = event
            return emit

        for i, prompt in enumerate(prompts):
            engine.submit(Job(prompt, 8, SamplingParams(), emit_for(i)))
        groups = 0
        while engine.step():
            groups = max(groups, engine.groups_in_flight)
        engine.close()
    assert groups == 2
    assert engine.check.positions > 0 and engine.check.bit_identical and engine.mismatched_rows == 0
    assert all(end is not None and end.reason == "length" for end in ends)


def test_the_group_policy_uses_what_measured_cheaper_and_tries_the_other_now_and_then():
    from moeswarm.engine.group_policy import EXPLORE_EVERY, GroupPolicy

    policy = GroupPolicy()
    assert policy.choose(remote=False, sequences=8) == 1 and policy.choose(remote=True, sequences=1) == 1
    assert policy.choose(True, 8) == 1
    policy.record(1, 1.0, 10)  # 0.1 s per token
    assert policy.choose(True, 8) == 2
    policy.record(2, 0.5, 10)  # 0.05 s per token: two groups pay
    picks = [policy.choose(True, 8) for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count(2) == 2 * EXPLORE_EVERY - 2 and picks.count(1) == 2
