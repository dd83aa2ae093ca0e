"""How a step's forwards run: packed (one forward per group for all its sequences), or one thread
per sequence where the model's layers cannot be packed.

`PackedRunner` is the engine's path for every model whose attention layers take packed forwards
(forward/packed.py): the step's sequences split into groups of about equal tokens
(engine/scheduler.py's `StepPlan`), each group ONE forward, the groups taking turns at every MoE layer
(engine/turns.py). `ThreadedRunner` is the fallback for layers that keep a state packing cannot
hold (recurrent and linear-attention layers): each sequence its own forward in its own thread,
meeting at every MoE layer in a StepBatcher (one dispatch per worker per layer for the step).

A layer call that fails fails only the sequences that needed the failed holder (and a bug set off
by one sequence's input fails only that sequence): the group's caches are rolled back to where
the step found them and each sequence runs again alone, getting its own logits or its own error.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from transformers import PreTrainedModel

from moeswarm.errors import MoeSwarmError
from moeswarm.forward.packed import KV_DTYPE, Item, PackedStepper, forward_packed, install, kv_dtype, supports_ragged
from moeswarm.forward.stepper import Stepper
from moeswarm.model.backend import attach, set_overlap
from moeswarm.engine.batcher import StepBatcher
from moeswarm.engine.eager import EagerExperts
from moeswarm.engine.turns import TakingTurns
from moeswarm.engine.whole_model import WholeModel
from moeswarm.swarm import Swarm

Feed = list[int] | list[list[int]]


def build_runners(backbone: Swarm | WholeModel, reference: PreTrainedModel | None, max_batch: int, groups: int):
    """(runner, reference runner or None): packed where both models' layers allow, else a thread per
    sequence. A swarm's MoE layers go through the runner's meeting point (`swarm.interpose`); a
    model that computes its own experts (a WholeModel's, the reference) runs as `local_runner`."""
    packed = supports_ragged(backbone.model) and (reference is None or supports_ragged(reference))
    if kv_dtype(backbone.model) is not None:
        if not packed:
            raise MoeSwarmError(f"--kv-cache f16: {backbone.model.config.model_type}'s layers keep a state packed "
                                "forwards cannot hold (recurrent layers, or an index of its own): its cache stays in the model's dtype")
        if reference is not None:
            setattr(reference, KV_DTYPE, kv_dtype(backbone.model))  # the local check keeps its cache as the backbone does
    reference_runner = local_runner(reference, packed, max_batch) if reference is not None else None
    if isinstance(backbone, WholeModel):
        return local_runner(backbone.model, packed, max_batch), reference_runner
    if packed:
        install(backbone.model)
        turns = backbone.interpose(TakingTurns)
        return PackedRunner(backbone.model, turns, max(2, groups, max_batch)), reference_runner  # a thread per group
    batcher = backbone.interpose(StepBatcher)
    return ThreadedRunner(backbone.model, batcher, max_batch), reference_runner


def local_runner(model: PreTrainedModel, packed: bool, max_batch: int):
    """The runner of a model computing its own experts. Packed: each group's rows through its experts
    as loaded (one forward per group already holds the rows every dispatch holds); threaded: its
    forwards meet at their own StepBatcher over the family's eager experts."""
    if packed:
        install(model)
        return PackedRunner(model, None)
    batcher = StepBatcher(EagerExperts(model))
    attach(model, batcher)
    set_overlap(model, False)  # no trip to overlap; and the shared expert then runs where its block calls it
    return ThreadedRunner(model, batcher, max_batch)


class PackedRunner:
    def __init__(self, model: PreTrainedModel, turns: TakingTurns | None, max_groups: int = 2):
        self.model = model
        self.turns = turns  # None: groups run one after the other (a local reference)
        self.max_groups = max(1, max_groups)  # every group of a step needs its own thread to take its turn
        self._pool = ThreadPoolExecutor(self.max_groups, thread_name_prefix="moeswarm-group")

    def stepper(self) -> PackedStepper:
        return PackedStepper(self.model)

    @property
    def waiting_s(self) -> float:
        """Seconds the last step spent gathering replies, when nobody computed (0 without turns)."""
        return self.turns.waiting_s if self.turns is not None else 0.0

    def run(self, work: list[tuple[PackedStepper, Feed, str]], groups: list[list[int]]) -> list:
        """Each work item's logits ([n, V], [1, V] for keep "last", [B, n, V] for B rows) or the
        exception its forward raised; `groups` are indices into `work` (a StepPlan's groups)."""
        results: list = [None] * len(work)
        if self.turns is None or len(groups) == 1:
            if self.turns is not None:
                self.turns.begin(1)
            for group in groups:
                self._run_group(work, group, results)
            return results
        if len(groups) > self.max_groups:
            raise ValueError(f"{len(groups)} groups in one step, more than the {self.max_groups} threads that take turns")
        self.turns.begin(len(groups))
        futures = [self._pool.submit(self._group_in_turn, index, work, group, results)
                   for index, group in enumerate(groups)]
        for future in futures:
            future.result()
        return results

    def _group_in_turn(self, index: int, work, group: list[int], results: list) -> None:
        self.turns.enter(index)
        try:
            self._run_group(work, group, results)
        finally:
            self.turns.leave()

    def _run_group(self, work, group: list[int], results: list) -> None:
        before = [(work[i][0].cache.length, work[i][0].cache.rows) for i in group]
        items = [Item(work[i][0].cache, work[i][1], work[i][2]) for i in group]
        try:
            outputs = forward_packed(self.model, items)
        except Exception as error:  # a failed holder, or a bug one sequence's input set off
            for (length, rows), i in zip(before, group):
                _roll_back(work[i][0], length, rows)
            if len(group) == 1:
                results[group[0]] = error
                return
            for i in group:  # again one sequence at a time: only those that need the failed holder (or hit the bug) fail
                self._run_group(work, [i], results)
            return
        for i, output in zip(group, outputs):
            results[i] = output

    def close(self) -> None:
        self._pool.shutdown()


def _roll_back(stepper: PackedStepper, length: int, rows: int) -> None:
    stepper.cache.pending.clear()
    stepper.cache.rows = rows
    stepper.cache.crop(length)


class ThreadedRunner:
    def __init__(self, model: PreTrainedModel, batcher: StepBatcher, max_batch: int):
        self.model = model
        self.batcher = batcher
        self._pool = ThreadPoolExecutor(max_batch, thread_name_prefix="moeswarm-seq")

    def stepper(self) -> Stepper:
        return Stepper(self.model)

    waiting_s = 0.0  # the forwards wait for each other too: not measured here

    def run(self, work: list[tuple[Stepper, Feed, str]], groups: list[list[int]]) -> list:
        """As PackedRunner.run, every sequence in one group (keep is ignored: every row comes back)."""
        self.batcher.begin(len(work))
        futures = [self._pool.submit(_forward_one, self.batcher, order, stepper, feed)
                   for order, (stepper, feed, _) in enumerate(work)]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._pool.shutdown()


def _forward_one(batcher: StepBatcher, order: int, stepper: Stepper, feed: Feed):
    batcher.enter(order)
    try:
        is_rows = bool(feed) and isinstance(feed[0], list)
        return stepper.forward_rows(feed) if is_rows else stepper.forward(feed)  # [B, n, V] or [n, V]
    except Exception as error:
        return error
    finally:
        batcher.leave()

