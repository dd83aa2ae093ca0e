"""The next step's plan: which sequences feed how many tokens, in which forwards. Plain data.

`Scheduler.schedule` is the one place a step is decided: its token budget (engine/step_budget.py),
what each slot feeds (`plan_step`, a pure function of plain numbers) and how the feeding slots are
grouped into forwards (`group_slots`: the configured or measured count, engine/group_policy.py).
Its answer, a `StepPlan`, holds numbers only: the engine binds it to its sequences.

Every decoding sequence takes its next token plus its drafts: a step never leaves a stream
waiting. Prompts are prefilled in chunks, oldest first, within what is left of the step's token
budget, so a long prompt shares steps with the streams already running instead of freezing them
for its whole length. The oldest prompt always moves by at least one chunk.

A chunk is always whole (`prefill_chunk` tokens, or the prompt's rest): a prompt that the budget
cannot take whole sits the step out. So a prompt's chunks start at the same positions whatever
else shares its steps, as when it runs alone, and each chunk's attention has the same shape: a
CPU attention kernel's bits depend on how many queries it computes at once (a prompt split 40 + 8
gave other logits than 48 at once, 0.04 apart on a random-weight model), so a prompt cut at the
budget's edge would give other tokens than the same request alone. The prefix cache reuses whole
chunks only, for the same reason (engine/prefix_cache.py).

A greedy sequence may carry several alternative drafts, one row each (generation/branches.py):
its rows are padded to its longest draft, so B branches cost B x (1 + L) tokens. Its first row is
fed like a single draft; the others are a speed-up, so they take only what the budget has left
after the prompts, one more row per sequence in turn (oldest first), always a sequence's first
branches: a step never exceeds its budget for the sake of a branch.

The feeding slots are split into groups of about equal tokens, the forwards a step has in flight
(engine/turns.py); a slot asking for log-probabilities gets a forward of its own (`apart`), since
other sequences' rows in its forward would change the bits of its logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moeswarm.engine.group_policy import GroupPolicy
from moeswarm.engine.step_budget import GROWTH, StepBudget


@dataclass(frozen=True)
class Slot:
    prefill_left: int  # prompt tokens not yet in the KV cache; 0: decoding
    branches: tuple[int, ...] = ()  # decoding: the draft tokens of each alternative draft, best guess first; (): none


@dataclass(frozen=True)
class Feed:
    tokens: int  # tokens fed this step (0: the slot sits this step out)
    rows: int = 1  # a decoder's branches fed (its first ones); 1 for a prompt chunk, 0 when sitting out


def rows_cost(branches: tuple[int, ...], rows: int) -> int:
    """Tokens fed by the first `rows` branches: each row is the last token plus the longest one's drafts."""
    return rows * (1 + max(branches[:rows], default=0))


def plan_step(slots: Sequence[Slot], prefill_chunk: int, step_tokens: int) -> list[Feed]:
    """What each slot feeds this step, in slot order.

    slots are in admission order (oldest first); prefill_chunk and step_tokens are at least 1.
    """
    rows = [0 if slot.prefill_left else 1 for slot in slots]
    tokens = [0 if slot.prefill_left else rows_cost(slot.branches, 1) for slot in slots]
    budget = step_tokens - sum(tokens)
    first_prefill = True
    for i, slot in enumerate(slots):
        if not slot.prefill_left:
            continue
        chunk = min(slot.prefill_left, prefill_chunk)
        take = chunk if first_prefill or chunk <= budget else 0  # whole chunks only
        tokens[i], rows[i], budget, first_prefill = take, int(take > 0), budget - take, False
    growing = True
    while growing:  # one more branch per decoder per round, while the budget has room for it
        growing = False
        for i, slot in enumerate(slots):
            if slot.prefill_left or rows[i] >= len(slot.branches):
                continue
            extra = rows_cost(slot.branches, rows[i] + 1) - tokens[i]
            if extra <= budget:
                tokens[i], rows[i], budget, growing = tokens[i] + extra, rows[i] + 1, budget - extra, True
    return [Feed(n, r) for n, r in zip(tokens, rows)]


@dataclass(frozen=True)
class StepPlan:
    """One step in plain numbers: what every slot feeds, and the forwards that carry them."""

    budget: int  # the step's token budget when it was planned
    feeds: tuple[Feed, ...]  # per slot, in slot (admission) order; tokens 0: the slot sits this step out
    groups: tuple[tuple[int, ...], ...]  # one forward each, in flight together: slot indices, each in slot order

    @property
    def working(self) -> tuple[int, ...]:
        """The slots that feed this step, in slot order."""
        return tuple(slot for slot, feed in enumerate(self.feeds) if feed.tokens)

    @property
    def tokens(self) -> int:
        """Tokens fed, every row's, padding included."""
        return sum(feed.tokens for feed in self.feeds)


class Scheduler:
    """Plans each step (`schedule`) and learns from how the planned steps ran (`learn`)."""

    def __init__(self, prefill_chunk: int, step_tokens: int, max_batch: int, groups: int, packed: bool):
        """groups: forwards in flight per step (0: one or two, by measurement); packed: whether the
        runner packs a group's sequences into one forward (else every step is one group)."""
        self.prefill_chunk, self.max_batch, self.groups, self.packed = prefill_chunk, max_batch, groups, packed
        self.budget = StepBudget(step_tokens, GROWTH * step_tokens)
        self.group_policy = GroupPolicy()

    def schedule(self, slots: Sequence[Slot], alone: Sequence[bool], remote: bool) -> StepPlan:
        """The next step of `slots` (admission order); alone[i]: slot i's forwards must be its own
        (log-probabilities); remote: whether the step waits on other machines."""
        budget = self.budget.tokens()
        feeds = tuple(plan_step(slots, self.prefill_chunk, budget))
        working = [slot for slot, feed in enumerate(feeds) if feed.tokens]
        count = self._group_count(remote, len(working))
        groups = group_slots([feeds[slot].tokens for slot in working], [alone[slot] for slot in working], count,
                             self.max_batch)
        return StepPlan(budget, feeds, tuple(tuple(working[i] for i in group) for group in groups))

    def learn(self, plan: StepPlan, seconds: float, waiting_s: float, decoding: bool) -> None:
        """`plan` ran its forwards in `seconds`, `waiting_s` of them waiting on replies; decoding:
        every slot fed was decoding (only decode steps teach the group count)."""
        if decoding and not self.groups:
            self.group_policy.record(len(plan.groups), seconds, plan.tokens)
        self.budget.record(plan.tokens, seconds, waiting_s)

    def _group_count(self, remote: bool, sequences: int) -> int:
        """Forwards in flight: as configured, or (auto) as measured; never more than the sequences."""
        if not self.packed:
            return 1
        wanted = self.groups or self.group_policy.choose(remote, sequences)
        return max(1, min(wanted, sequences))


def group_slots(tokens: list[int], alone: list[bool], groups: int, most: int) -> list[list[int]]:
    """Indices into `tokens` per forward: `groups` groups of about equal tokens (`split_groups`),
    then those whose `alone` is true each in its own (`apart`), at most `most` forwards."""
    return apart(split_groups(tokens, groups), alone, most)


def split_groups(tokens: list[int], groups: int) -> list[list[int]]:
    """Slot indices per group: at most `groups` non-empty groups of about equal tokens, each in slot
    order (the heaviest slots placed first, each in the lightest group so far)."""
    groups = max(1, min(groups, len(tokens)))
    members: list[list[int]] = [[] for _ in range(groups)]
    load = [0] * groups
    for slot in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        lightest = min(range(groups), key=lambda g: (load[g], g))
        members[lightest].append(slot)
        load[lightest] += tokens[slot]
    return [sorted(group) for group in members if group]


def apart(groups: list[list[int]], alone: list[bool], most: int) -> list[list[int]]:
    """`groups` (slot indices per forward) with the slots whose `alone` is true each in a group of its
    own, as far as `most` groups (the forwards a step may have in flight) allow; the rest of them
    share the last group."""
    others = [[slot for slot in group if not alone[slot]] for group in groups]
    others = [group for group in others if group]
    if len(others) > 1 and any(alone):  # the others packed into one: room for more of their own
        others = [sorted(slot for group in others for slot in group)]
    singles = [[slot] for group in groups for slot in group if alone[slot]]
    room = max(1, most - len(others))
    if len(singles) > room:
        singles = singles[: room - 1] + [[slot for group in singles[room - 1 :] for slot in group]]
    return others + singles
