"""Which sequences feed how many tokens in the next step: a pure function of plain numbers.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
