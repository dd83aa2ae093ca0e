"""Which sequences feed how many tokens in the next step: a pure function of plain numbers.

Every decoding sequence takes its next token plus its drafts: a step never leaves a stream
waiting. Prompts are prefilled in chunks, oldest first, within what is left of the step's token
budget, so a long prompt shares steps with the streams already running instead of freezing them
for its whole length. The oldest prompt always moves by at least one chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    prefill_left: int  # prompt tokens not yet in the KV cache; 0: decoding
    drafts: int = 0  # draft tokens proposed for this step (decoding only)


def plan_step(slots: Sequence[Slot], prefill_chunk: int, step_tokens: int) -> list[int]:
    """Tokens each slot feeds this step, in slot order (0: it sits this step out).

    slots are in admission order (oldest first); prefill_chunk and step_tokens are at least 1.
    """
    feeds = [0 if slot.prefill_left else 1 + slot.drafts for slot in slots]
    budget = step_tokens - sum(feeds)
    first_prefill = True
    for i, slot in enumerate(slots):
        if not slot.prefill_left:
            continue
        chunk = min(slot.prefill_left, prefill_chunk)
        take = chunk if first_prefill else min(chunk, max(0, budget))
        feeds[i], budget, first_prefill = take, budget - take, False
    return feeds
